"""MultiHeadAttention with reshape/permute, layers created in another order, extra attributes,
the scaling before the mask, a finite "minus infinity" and a mask built in forward."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.out_proj = nn.Linear(d_out, d_out)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.h = num_heads
        self.attn_dropout = nn.Dropout(dropout)
        self.last_weights = None  # kept for plotting

    def split(self, t):
        b, n, c = t.shape
        return t.reshape(b, n, self.h, c // self.h).permute(0, 2, 1, 3)  # (b, h, n, hd)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.split(self.W_query(x)), self.split(self.W_key(x)), self.split(self.W_value(x))
        att = (q @ k.transpose(-2, -1)) * k.size(-1) ** -0.5
        future = torch.ones(n, n, device=x.device).tril() == 0
        att = att.masked_fill(future, -1e9)
        att = F.softmax(att, dim=-1)
        self.last_weights = att
        y = self.attn_dropout(att) @ v  # (b, h, n, hd)
        y = y.permute(0, 2, 1, 3).reshape(b, n, -1)
        return self.out_proj(y)
