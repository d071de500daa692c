"""What one attention call asks for, unfolded (``Spec``), and the masks and biases of any block of it.

A backend folds only the block it computes (``allowed`` and ``bias`` for query rows r0..r1 and
keys c0..c1): a block or a packed document costs a mask of its own size, plain causal none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..masks import document_mask, position_mask
from ..scores import alibi_bias


@dataclass(slots=True)
class Spec:
    """One call's terms. Shapes: T queries over S keys; queries sit at positions S-T .. S-1."""

    T: int
    S: int
    causal: bool = False
    window: int | None = None  # None when the window covers every key
    mask: Tensor | None = None  # bool (True = may attend) or additive float, 4-D, broadcastable to (B, H, T, S)
    attention_mask: Tensor | None = None  # (B, S) bool, True = real key
    documents: Tensor | None = None  # (B, S) int document ids of the keys
    softcap: float | None = None
    sinks: Tensor | None = None  # (H,) sink logits
    alibi: Tensor | None = None  # (1 or B, H) slopes
    dropout_p: float = 0.0
    scale: float = 1.0

    @property
    def tensors(self) -> tuple[Tensor | None, ...]:
        """The terms given as tensors (a mask, padding, documents, sinks, slopes): what a transform may wrap too."""
        return self.mask, self.attention_mask, self.documents, self.sinks, self.alibi

    @property
    def changes_scores(self) -> bool:
        """True when the scores themselves change (softcap or ALiBi): no fused kernel computes them."""
        return self.softcap is not None or self.alibi is not None

    @property
    def causal_prompt(self) -> bool:
        """Top-left causal over T == S keys with nothing else but the keys' padding."""
        return (
            self.causal and self.T == self.S and self.window is None and self.mask is None
            and self.documents is None and self.alibi is None
        )

    @property
    def plain_causal(self) -> bool:
        """``causal_prompt`` with no padding: SDPA's ``is_causal`` says it all."""
        return self.causal_prompt and self.attention_mask is None

    def allowed(self, rows: tuple[int, int], cols: tuple[int, int], device: torch.device) -> Tensor | None:
        """Bool (1 or B, 1 or H, r1-r0, c1-c0), True = query may see key; None = every key."""
        (r0, r1), (c0, c1) = rows, cols
        off = self.S - self.T  # position of the first query
        parts: list[Tensor] = []
        if self.causal and (r1 - r0 > 1 or self.window is not None or off + r0 < c1 - 1):
            q_pos = torch.arange(off + r0, off + r1, device=device)  # (t,)
            k_pos = torch.arange(c0, c1, device=device)  # (s,)
            parts.append(position_mask(q_pos, k_pos, window=self.window))  # (t, s)
        if self.attention_mask is not None:
            parts.append(self.attention_mask[:, None, None, c0:c1])  # (B, 1, 1, s)
        if self.documents is not None:
            parts.append(document_mask(self.documents[:, off + r0 : off + r1], self.documents[:, c0:c1]))  # (B, 1, t, s)
        if self.mask is not None and self.mask.dtype == torch.bool:
            parts.append(mask_block(self.mask, rows, cols))  # (B?, H?, t, s)
        allowed = None
        for part in parts:
            allowed = part if allowed is None else allowed & part  # broadcasts to (B?, H?, t, s)
        return allowed

    def bias(self, rows: tuple[int, int], cols: tuple[int, int], device: torch.device, dtype: torch.dtype) -> Tensor | None:
        """Additive floats (1 or B, 1 or H, t, s): ALiBi (in ``dtype``, the scores', or wider) plus an additive user mask; None = nothing."""
        (r0, r1), (c0, c1) = rows, cols
        off = self.S - self.T
        bias = None
        if self.alibi is not None:
            q_pos = torch.arange(off + r0, off + r1, device=device)  # (t,)
            bias = alibi_bias(self.alibi, q_pos, torch.arange(c0, c1, device=device), dtype)  # (Bs, H, t, s)
        if self.mask is not None and self.mask.dtype != torch.bool:
            user = mask_block(self.mask, rows, cols)  # (B?, H?, t, s)
            bias = user if bias is None else bias + user
        return bias

    def sliced(self, b: int, rows: tuple[int, int], cols: tuple[int, int]) -> Spec:
        """The terms of row ``b``'s queries r0..r1 over keys c0..c1 (the queries must be the block's last positions)."""
        (r0, r1), (c0, c1) = rows, cols
        pick = lambda t: None if t is None else t[b : b + 1] if t.shape[0] > 1 else t  # noqa: E731
        mask = None if self.mask is None else mask_block(pick(self.mask), rows, cols)
        real = None if self.attention_mask is None else self.attention_mask[b : b + 1, c0:c1]
        return dataclasses.replace(
            self, T=r1 - r0, S=c1 - c0, mask=mask, attention_mask=real, documents=None, alibi=pick(self.alibi)
        )


def kernel_terms(spec: Spec) -> tuple[float, Tensor | None, Tensor | None]:
    """The C++ kernels' terms of a call: its softcap (0: none), sinks (H,) and ALiBi slopes (1 or B, H) as contiguous
    float32 (no copy where they are so already: a module's own, read as they stand at each call), or None."""
    sinks = None if spec.sinks is None else spec.sinks.detach().float().contiguous()  # (H,)
    alibi = None if spec.alibi is None else spec.alibi.detach().float().contiguous()  # (1 or B, H)
    return spec.softcap or 0.0, sinks, alibi


def mask_block(t: Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> Tensor:
    """A 4-D mask's block: rows and columns sliced where the mask has them (size-1 dims broadcast)."""
    if t.shape[-2] > 1:
        t = t[..., rows[0] : rows[1], :]
    if t.shape[-1] > 1:
        t = t[..., cols[0] : cols[1]]
    return t
