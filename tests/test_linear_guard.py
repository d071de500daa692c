"""Pathology guard: no headwise module is ever much slower than the plain fused layer.

Every headwise attention module runs forward, and forward + backward with three kinds of
loss (``out.sum()`` and ``out.mean()``, whose gradients reach the backward expanded, stride 0,
and a dense random gradient), in fp32 and bf16, with each ``headwise.linear`` path forced in
turn, interleaved with the plain fused ``Linear`` + SDPA(``is_causal``) + ``Linear`` layer in
the same process. The test fails when the median time of any of them is above ``LIMIT`` times
the reference's (the median over rounds of the per-round ratio; a ratio above the limit is
measured a second time and must be above it again). A slow kernel path (oneDNN handed a stride-0 gradient ran 85x slower) shows up
as a ratio far above that; ordinary differences between implementations stay below it.

This test depends on the machine it runs on and checks a ratio, not a time: both sides run in
the same rounds (A B C ... A B C ...), so a busy machine slows them alike. Shapes are small
(B=2, T=128, C=256: 256 rows, enough for the oneDNN path) so that it takes seconds.
"""

import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import headwise as hw
from headwise import linear as hl

LIMIT = 1.5
B, T, C, H = 2, 128, 256, 2
ROUNDS = 7


class Fused(nn.Module):
    """The plain layer anyone would write: one Q/K/V Linear, SDPA, an output Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))  # (B, H, T, D) each
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.out(ctx.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


MODULES = {
    "CausalAttention": lambda: hw.CausalAttention(C, C, T, 0.0),
    "MultiHeadAttentionWrapper": lambda: hw.MultiHeadAttentionWrapper(C, C // H, T, 0.0, num_heads=H),
    "MultiHeadAttention": lambda: hw.MultiHeadAttention(C, C, T, 0.0, num_heads=H, qkv_bias=True),
    "GPT2MultiHeadAttention": lambda: hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=C, n_head=H, n_positions=T, attn_pdrop=0.0, resid_pdrop=0.0)),
}
LOSSES = {"sum": lambda y, g: y.sum(), "mean": lambda y, g: y.mean(), "dense": lambda y, g: (y * g).sum()}


def step(module: nn.Module, x: torch.Tensor, mode: str, grad: torch.Tensor):
    if mode == "forward":

        def run():
            with torch.no_grad():
                module(x)

        return run
    xg = x.detach().requires_grad_(True)

    def run():
        for p in module.parameters():
            p.grad = None
        LOSSES[mode](module(xg), grad).backward()

    return run


def ratios(steps: dict, rounds: int = ROUNDS) -> dict[str, float]:
    """Each step's median over rounds of (its time / the reference's time in the same round).

    Steps run interleaved, in reversed order every other round, so that a burst of load from
    other jobs falls on a round's pair rather than on one side of the ratio.
    """
    for run in steps.values():
        run()  # warm up
    per_round: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        times = {}
        for name, run in (list(steps.items()) if r % 2 == 0 else list(steps.items())[::-1]):
            start = time.perf_counter()
            run()
            times[name] = time.perf_counter() - start
        for name in steps:
            per_round[name].append(times[name] / times["fused reference"])
    return {name: statistics.median(rs) for name, rs in per_round.items() if name != "fused reference"}


@pytest.mark.parametrize("path", ["torch", "onednn"])
def test_no_module_path_loss_or_dtype_is_over_1_5x_the_fused_layer(path):
    if path == "onednn" and hl._ops_error(torch.float32) is not None:
        pytest.skip("oneDNN's private ops do not work here")
    torch.manual_seed(0)
    over, seen = [], {}
    with hl.use_path(path):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(B, T, C).to(dtype)  # (B, T, C)
            grad = torch.randn(B, T, C).to(dtype)  # (B, T, C)
            impls = {"fused reference": Fused()} | {name: make() for name, make in MODULES.items()}
            impls = {name: m.to(dtype).eval() for name, m in impls.items()}
            for mode in ("forward", *LOSSES):
                steps = {name: step(m, x, mode, grad) for name, m in impls.items()}
                for name, ratio in ratios(steps).items():
                    if ratio > LIMIT:  # measured again with the reference alone: a slow path stays slow, a burst of load does not
                        ratio = ratios({"fused reference": steps["fused reference"], name: steps[name]})[name]
                    seen[name, str(dtype), mode] = ratio
                    if ratio > LIMIT:
                        over.append(f"{name} {dtype} {mode}: {ratio:.2f}x")
    assert len(seen) == len(MODULES) * 2 * (1 + len(LOSSES))
    assert not over, f"path {path}: over {LIMIT}x the fused reference, twice: {over}"
