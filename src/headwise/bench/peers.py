"""The implementations timed side by side: headwise's, the book's, torch's, transformers', a fused reference."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cases import DTYPES, Case


@dataclass(frozen=True)
class Impl:
    """A way to build the layer: ``build(case)`` -> (module, call) with ``call(x) -> (B, T, C)``."""

    name: str
    peer: bool
    build: Callable[[Case], tuple[nn.Module, Callable[[Tensor], Tensor]]]
    scores: bool = False  # materialises (B, H, T, T) scores: skipped where they would not fit
    out_proj: bool = True
    needs: str = ""  # a module that must be importable


def _future(case: Case) -> Tensor:
    """(T, T) bool, True above the diagonal: the keys a causal query may NOT see."""
    return torch.ones(case.tokens, case.tokens, dtype=torch.bool, device=case.device).triu(1)  # (T, T)


def _headwise_mha(case: Case):
    from ..teaching import MultiHeadAttention

    m = MultiHeadAttention(case.width, case.width, case.tokens, 0.0, case.heads)
    return m, m


def _headwise_gpt2(backend: str):
    def build(case: Case):
        from ..config import GPT2Config
        from ..fused import GPT2MultiHeadAttention

        cfg = GPT2Config(n_embd=case.width, n_head=case.heads, n_positions=max(case.tokens, 1024), attn_pdrop=0.0, resid_pdrop=0.0)
        m = GPT2MultiHeadAttention(cfg, backend=backend)
        return m, m

    return build


def _book(wrapper: bool):
    def build(case: Case):
        from llms_from_scratch import ch03

        if wrapper:
            m = ch03.MultiHeadAttentionWrapper(case.width, case.width // case.heads, case.tokens, 0.0, case.heads)
        else:
            m = ch03.MultiHeadAttention(case.width, case.width, case.tokens, 0.0, case.heads)
        return m, m

    return build


def _torch_mha(bias: bool, is_causal: bool):
    def build(case: Case):
        m = nn.MultiheadAttention(case.width, case.heads, bias=bias, batch_first=True)
        future = _future(case)  # (T, T) True = may NOT attend

        def call(x: Tensor) -> Tensor:
            return m(x, x, x, attn_mask=future, need_weights=False, is_causal=is_causal)[0]  # (B, T, C)

        return m, call

    return build


def _transformers(implementation: str):
    def build(case: Case):
        from transformers import GPT2Config as HFConfig
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

        cfg = HFConfig(n_embd=case.width, n_head=case.heads, n_positions=max(case.tokens, 1024), attn_pdrop=0.0, resid_pdrop=0.0,
                       attn_implementation=implementation)
        m = GPT2Attention(cfg, layer_idx=0)
        mask = None
        if implementation == "eager":  # what GPT2Model builds once per forward: additive, finfo.min above the diagonal
            dtype = DTYPES[case.dtype]
            future = _future(case)  # (T, T)
            mask = torch.zeros(1, 1, case.tokens, case.tokens, dtype=dtype, device=case.device).masked_fill(future, torch.finfo(dtype).min)  # (1, 1, T, T)

        def call(x: Tensor) -> Tensor:
            return m(x, attention_mask=mask)[0]  # (B, T, C)

        return m, call

    return build


class FusedReference(nn.Module):
    """The plain fast layer anyone would write: fused Linear, SDPA(is_causal), Linear."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=-1)  # (B, T, C) x3
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


def _fused_reference(compiled: bool):
    def build(case: Case):
        m = FusedReference(case.width, case.heads)
        return m, (torch.compile(m) if compiled else m)

    return build


IMPLS: list[Impl] = [
    Impl("headwise MultiHeadAttention", False, _headwise_mha),
    Impl("headwise GPT2MultiHeadAttention", False, _headwise_gpt2("auto")),
    Impl("headwise GPT2MultiHeadAttention (math)", False, _headwise_gpt2("math"), scores=True),
    Impl("book MultiHeadAttention", True, _book(False), scores=True, needs="llms_from_scratch"),
    Impl("book MultiHeadAttentionWrapper", True, _book(True), out_proj=False, needs="llms_from_scratch"),  # one head's scores at a time
    Impl("nn.MultiheadAttention (bias, mask)", True, _torch_mha(True, False)),
    Impl("nn.MultiheadAttention (no bias, is_causal)", True, _torch_mha(False, True)),
    Impl("transformers GPT2Attention eager", True, _transformers("eager"), scores=True, needs="transformers"),
    Impl("transformers GPT2Attention sdpa", True, _transformers("sdpa"), needs="transformers"),
    Impl("fused Linear + SDPA + Linear", True, _fused_reference(False)),
    Impl("fused Linear + SDPA + Linear, torch.compile", True, _fused_reference(True)),
]
DEFAULT_SKIP = ("torch.compile",)  # minutes of compiling on a small CPU: ask for it with --impls


def select(patterns: Sequence[str] | None = None) -> list[Impl]:
    """The implementations whose name contains any of ``patterns`` (default: all but torch.compile)."""
    if not patterns:
        return [i for i in IMPLS if not any(s in i.name for s in DEFAULT_SKIP)]
    chosen = [i for i in IMPLS if any(p.lower() in i.name.lower() for p in patterns)]
    if not chosen:
        raise ValueError(f"impls {list(patterns)} match no implementation; the names are {[i.name for i in IMPLS]}")
    return chosen


def skip_reason(impl: Impl, case: Case, max_scores_gib: float) -> str:
    """Why ``impl`` cannot run ``case`` here ("" when it can): a missing package, or scores too big."""
    return _missing(impl) or _too_big(impl, case, max_scores_gib)


def _missing(impl: Impl) -> str:
    if not impl.needs:
        return ""
    try:
        __import__(impl.needs)
    except ImportError:
        return f"{impl.needs} is not installed"
    return ""


def _too_big(impl: Impl, case: Case, max_scores_gib: float) -> str:
    if not impl.scores:
        return ""
    gib = 3 * case.batch * case.heads * case.tokens**2 * torch.finfo(DTYPES[case.dtype]).bits / 8 / 2**30  # scores, masked, softmax
    return f"skipped: its (B, H, T, T) scores need ~{gib:.1f} GiB (> --max-scores-gib {max_scores_gib:g})" if gib > max_scores_gib else ""


def prepare(impl: Impl, case: Case, seed: int = 0) -> tuple[nn.Module, Callable[[Tensor], Tensor], Tensor]:
    """Seeded module, its call and a seeded input x (B, T, C), all in the case's dtype and on its device, in eval mode."""
    with torch.random.fork_rng():  # seeded weights without touching the caller's RNG
        torch.manual_seed(seed)
        module, call = impl.build(case)
    module.to(device=case.device, dtype=DTYPES[case.dtype]).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(case.batch, case.tokens, case.width, generator=gen).to(device=case.device, dtype=DTYPES[case.dtype])  # (B, T, C)
    return module, call, x
