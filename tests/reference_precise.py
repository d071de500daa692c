"""Softcapped attention in 40-digit arithmetic (mpmath), for errors of float64 code itself.

A float64 reference cannot judge a float64 computation (both round at the same place); this
one can. Written from the definition, like ``reference_variants``, and slow: small problems only.
Rules: logit_j = cap * tanh(q·k_j * scale / cap); causal aligned bottom-right (query i sits at
position i + S - T and sees keys j <= i + S - T); softmax over the visible keys; weights @ v.
"""

from __future__ import annotations

import mpmath
import torch
from torch import Tensor


def precise_softcap_attention(q: Tensor, k: Tensor, v: Tensor, *, softcap: float, causal: bool = False) -> Tensor:
    """(B, H, T, Dv) float64 context of (B, H, T, D) x (B, H, S, D), each number computed to 40 digits."""
    mpmath.mp.dps = 40
    B, H, T, D = q.shape
    S = k.shape[2]
    cap, scale = mpmath.mpf(softcap), 1 / mpmath.sqrt(D)
    as_mp = lambda t: [[[[mpmath.mpf(float(x)) for x in row] for row in head] for head in b] for b in t.double().tolist()]  # noqa: E731
    qm, km, vm = as_mp(q), as_mp(k), as_mp(v)
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                seen = [j for j in range(S) if not causal or j <= i + S - T]
                logits = [cap * mpmath.tanh(mpmath.fsum(x * y for x, y in zip(qm[b][h][i], km[b][h][j], strict=True)) * scale / cap) for j in seen]
                top = max(logits, default=0)
                e = [mpmath.exp(x - top) for x in logits]
                total = mpmath.fsum(e)
                for c in range(v.shape[-1]):
                    out[b, h, i, c] = float(mpmath.fsum(w * vm[b][h][j][c] for w, j in zip(e, seen, strict=True)) / total) if seen else 0.0
    return out


def error(got: Tensor, want: Tensor) -> float:
    """The largest absolute difference, in float64."""
    return float((got.double() - want).abs().max()) if got.numel() else 0.0


