"""The book's side of grading: configurations, and every named step of the correct forward pass.

The reference is headwise's own book class of the same kind, built in float64 with the
``"math"`` backend and watched with ``headwise.observe``, so each step is the tensor the
correct code computes: ``queries``, ``queries.view``, ``queries.transpose``, ``scores``,
``masked_scores``, ``weights``, ``context``, ``context.transpose``, ``merged``, ``output``
(a single head reports no view/transpose/merge; the wrapper's steps are per head,
``heads.0.queries`` ..., then ``output``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..explain import book_batch
from ..observe import observe
from ..teaching import CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper

BOOK_CLASSES: dict[str, type[nn.Module]] = {
    "CausalAttention": CausalAttention,
    "MultiHeadAttentionWrapper": MultiHeadAttentionWrapper,
    "MultiHeadAttention": MultiHeadAttention,
}


@dataclass(frozen=True)
class Config:
    """One way to build and call a class. ``seed=None`` is the book's: seed 123, its (2, 6, 3) batch."""

    d_in: int
    d_out: int
    context_length: int
    num_heads: int
    batch: int
    num_tokens: int
    qkv_bias: bool
    seed: int | None = None

    def args(self, kind: str, dropout: float = 0.0) -> tuple:
        """The book's positional constructor arguments (dropout 0.0 unless given)."""
        if kind == "CausalAttention":
            return (self.d_in, self.d_out, self.context_length, dropout, self.qkv_bias)
        return (self.d_in, self.d_out, self.context_length, dropout, self.num_heads, self.qkv_bias)

    def describe(self, name: str, kind: str, dropout: float = 0.0) -> str:
        """E.g. ``MultiHeadAttention(3, 2, 6, 0.0, 2, False) on x of shape (2, 6, 3)``."""
        where = "the book's batch" if self.seed is None else "x"
        return f"{name}{self.args(kind, dropout)} on {where} of shape {(self.batch, self.num_tokens, self.d_in)}"


# Sizes kept distinct (d_in, d_out, num_heads, head_dim, tokens) so that each known mistake
# gives its own numbers; tokens < context_length in some, bias on in some, batch > 1 in all.
CONFIGS: dict[str, tuple[Config, ...]] = {
    "CausalAttention": (
        Config(3, 2, 6, 1, 2, 6, False),
        Config(5, 4, 9, 1, 3, 7, True, seed=1),
        Config(6, 7, 5, 1, 2, 5, False, seed=2),
    ),
    "MultiHeadAttentionWrapper": (
        Config(3, 2, 6, 2, 2, 6, False),
        Config(5, 4, 9, 3, 3, 7, True, seed=1),
        Config(6, 3, 5, 4, 2, 5, False, seed=2),
    ),
    "MultiHeadAttention": (
        Config(3, 2, 6, 2, 2, 6, False),
        Config(5, 12, 9, 3, 3, 7, True, seed=1),
        Config(7, 8, 5, 4, 2, 5, False, seed=2),
        Config(4, 12, 8, 6, 2, 3, True, seed=3),
    ),
}


@dataclass
class Reference:
    """The correct forward pass for one configuration.

    Attributes:
        x: the input, (B, T, d_in) float64.
        steps: step name -> tensor, in the order the book computes them.
        state: the book module's parameters (float64), to copy into the learner's.
        scale: 1 / sqrt(head size), the factor between ``scores`` and the softmax's input.
    """

    x: Tensor
    steps: dict[str, Tensor]
    state: dict[str, Tensor]
    scale: float

    @property
    def output(self) -> Tensor:
        return self.steps["output"]


@contextmanager
def book_defaults() -> Iterator[None]:
    """torch's own defaults, float32 on the CPU, for the block: a learner's file may set others for its own code
    (``torch.set_default_dtype(torch.float64)``, ``torch.set_default_device(...)``), which the book's classes and
    batch are not built under."""
    dtype = torch.get_default_dtype()
    device = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)  # set_default_device's, or None
    torch.set_default_dtype(torch.float32)
    if device is not None:
        torch.set_default_device(None)  # (setting "cpu" would leave a device mode on every later call of the process)
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        if device is not None:
            torch.set_default_device(device.device)


def reference(kind: str, config: Config) -> Reference:
    """Build headwise's book class of ``kind`` for ``config`` and record its steps.

    Example:
        >>> ref = reference("MultiHeadAttention", CONFIGS["MultiHeadAttention"][0])
        >>> list(ref.steps)[:4], tuple(ref.output.shape)
        (['queries', 'keys', 'values', 'queries.view'], (2, 6, 2))
    """
    with book_defaults():
        with torch.random.fork_rng():
            torch.manual_seed(123 if config.seed is None else config.seed)
            module = BOOK_CLASSES[kind](*config.args(kind), backend="math")
            if config.seed is None:
                x = book_batch()  # (2, 6, 3)
            else:
                _randomize(module)
                x = torch.randn(config.batch, config.num_tokens, config.d_in)  # (B, T, d_in)
        module = module.double().eval()
        x = x.double()
        with torch.no_grad():
            steps = _steps(module, kind, x)
    head_size = config.d_out // config.num_heads if kind == "MultiHeadAttention" else config.d_out
    state = {k: v.detach() for k, v in module.named_parameters()}
    return Reference(x, steps, state, 1 / math.sqrt(head_size))


def _randomize(module: nn.Module) -> None:
    """Weights of std 1/sqrt(fan_in) and biases of std 0.5: scores of order 1, so mistakes show."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            std = 0.5 if name.endswith("bias") else 1 / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape) * std)


def _steps(module: nn.Module, kind: str, x: Tensor) -> dict[str, Tensor]:
    if kind == "MultiHeadAttention":
        seen: dict[str, Tensor] = {}
        with observe(lambda name, t: seen.setdefault(name, t.clone())):
            seen["output"] = module(x)
        del seen["x"]
        return seen
    heads = module.heads if kind == "MultiHeadAttentionWrapper" else [module]
    steps: dict[str, Tensor] = {}
    for i, head in enumerate(heads):
        prefix = f"heads.{i}." if kind == "MultiHeadAttentionWrapper" else ""
        steps.update({prefix + name: t for name, t in _head_steps(head, x).items()})
    steps["output"] = module(x)  # (B, T, d_out) or (B, T, num_heads * d_out)
    return steps


def _head_steps(head: CausalAttention, x: Tensor) -> dict[str, Tensor]:
    """One CausalAttention's steps, (B, T, *): its projections, then what the math backend reports."""
    steps = {name: layer(x) for name, layer in (("queries", head.W_query), ("keys", head.W_key), ("values", head.W_value))}
    seen: dict[str, Tensor] = {}
    with observe(lambda name, t: seen.setdefault(name, t.squeeze(1).clone())):  # (B, 1, T, *) -> (B, T, *)
        head(x)
    return steps | {name: seen[name] for name in ("scores", "masked_scores", "weights", "context")}
