"""MultiHeadAttention with einsum: heads stay in the (b, num_tokens, num_heads, head_dim) layout, no transpose."""

import math

import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("causal", torch.tril(torch.ones(context_length, context_length, dtype=torch.bool)))

    def forward(self, x):
        b, t, _ = x.shape
        q = self.W_query(x).view(b, t, self.num_heads, self.head_dim)
        k = self.W_key(x).view(b, t, self.num_heads, self.head_dim)
        v = self.W_value(x).view(b, t, self.num_heads, self.head_dim)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        weights = self.dropout(scores.softmax(dim=-1))
        context = torch.einsum("bhqk,bkhd->bqhd", weights, v)  # (b, t, num_heads, head_dim)
        return self.out_proj(context.reshape(b, t, -1))
