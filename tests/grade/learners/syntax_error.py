"""A file that does not parse."""

import torch.nn as nn


class MultiHeadAttention(nn.Module):
    def forward(self, x)
        return x
