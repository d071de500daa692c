"""Pathology guard: no headwise module is ever much slower than the same layer written plainly.

Every headwise attention module runs forward, and forward + backward with three kinds of
loss (``out.sum()`` and ``out.mean()``, whose gradients reach the backward expanded, stride 0,
and a dense random gradient), in fp32 and bf16, with each ``headwise.linear`` path forced in
turn, interleaved with a plain reference *of its own shape* in the same process: the same
Linears (fused or separate, with or without bias), ``F.scaled_dot_product_attention`` with
``is_causal`` and the same heads run the same way. The book's wrapper runs its heads one after
another, so its reference is H single-head layers run one after another (against one fused
layer it is slower for honest reasons). The only differences left are headwise's own: the
linear path, the checks and the attention function's bookkeeping, which stay well below ``LIMIT``.

The test fails when the median over rounds of the per-round ratio (module time / its
reference's time) is above ``LIMIT``, twice (a ratio above the limit is measured again). The
pathologies it is for are far above the limit (oneDNN handed a stride-0 gradient:
``test_the_guard_fails_the_stride_0_gradient_pathology``); ``test_the_guard_fails_a_10x_slower_module``
shows the measurement flags a module that does ten times the work of its reference.

Time is the CPU time of the calling thread (``time.thread_time``) with torch on one thread,
the least of several runs: a busy machine takes the CPU away between runs, which wall-clock
time counts and thread time does not. Both sides run in the same rounds, in alternating order.
Shapes are small (B=2, T=128, C=256: 256 rows, enough for the oneDNN path) so that it takes seconds, but the batch
is doubled (``batch_for``) until the widest reference's forward takes ``FLOOR`` seconds: where a CPU's matrix units
(AMX) finish such a layer in a fraction of a millisecond, the fixed cost of a call (checks, the plan) would be what is
timed, not the paths (the per-call cost is the benchmarks' to show). How far the batch grows depends on the machine; the
ratios do not.
"""

import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import headwise as hw
from headwise import linear as hl
from headwise.linear import onednn

LIMIT = 2.5
B, T, C, H = 2, 128, 256, 2
ROUNDS = 7
FLOOR = 0.002  # seconds of thread time the widest reference's forward takes at least (batch_for)
MAX_B = 32


@pytest.fixture(autouse=True)
def one_thread():
    """torch on the calling thread only, so that its thread time is all the work done."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Plain(nn.Module):
    """The plain layer anyone would write: Q/K/V Linear(s), SDPA(is_causal), maybe an output Linear.

    (B, T, d_in) -> (B, T, heads * head_dim); ``fused``: one Linear for Q/K/V, else three.
    """

    def __init__(self, d_in: int, head_dim: int, heads: int, *, bias: bool, fused: bool, out: bool) -> None:
        super().__init__()
        self.heads, self.width = heads, heads * head_dim
        if fused:
            self.qkv = nn.Linear(d_in, 3 * self.width, bias=bias)
        else:
            self.q, self.k, self.v = (nn.Linear(d_in, self.width, bias=bias) for _ in range(3))
        self.out = nn.Linear(self.width, self.width) if out else None

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).split(self.width, dim=-1) if hasattr(self, "qkv") else (self.q(x), self.k(x), self.v(x))  # (B, T, W) each
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in qkv)  # (B, H, T, D) each
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        ctx = ctx.transpose(1, 2).reshape(b, t, self.width)  # (B, T, W)
        return self.out(ctx) if self.out is not None else ctx


class OneAfterAnother(nn.Module):
    """H single-head plain layers run one after another, outputs concatenated (the wrapper's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(Plain(C, C // H, 1, bias=False, fused=False, out=False) for _ in range(H))

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)  # (B, T, C)


# each module with its reference of the same shape
MODULES = {
    "CausalAttention": (lambda: hw.CausalAttention(C, C, T, 0.0), lambda: Plain(C, C, 1, bias=False, fused=False, out=False)),
    "MultiHeadAttentionWrapper": (lambda: hw.MultiHeadAttentionWrapper(C, C // H, T, 0.0, num_heads=H), OneAfterAnother),
    "MultiHeadAttention": (
        lambda: hw.MultiHeadAttention(C, C, T, 0.0, num_heads=H, qkv_bias=True),
        lambda: Plain(C, C // H, H, bias=True, fused=False, out=True),
    ),
    "GPT2MultiHeadAttention": (
        lambda: hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=C, n_head=H, n_positions=T, attn_pdrop=0.0, resid_pdrop=0.0)),
        lambda: Plain(C, C // H, H, bias=True, fused=True, out=True),
    ),
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


def ratio(run, reference, rounds: int = ROUNDS) -> float:
    """run's least thread time over rounds / reference's least, the two alternating in order."""
    run(), reference()  # warm up
    times: dict = {run: [], reference: []}
    for r in range(rounds):
        for f in (run, reference) if r % 2 == 0 else (reference, run):
            start = time.thread_time()
            f()
            times[f].append(time.thread_time() - start)
    return min(times[run]) / min(times[reference])


def batch_for(dtype: torch.dtype) -> int:
    """B from 2, doubled until the widest reference's (the GPT-2 layer's) forward takes ``FLOOR`` seconds of thread time
    (at most ``MAX_B``)."""
    reference = MODULES["GPT2MultiHeadAttention"][1]().to(dtype).eval()
    b = B
    while b < MAX_B:
        x = torch.randn(b, T, C).to(dtype)  # (b, T, C)
        run = step(reference, x, "forward", x)
        run()
        least = float("inf")
        for _ in range(3):
            start = time.thread_time()
            run()
            least = min(least, time.thread_time() - start)
        if least >= FLOOR:
            break
        b *= 2
    return b


def guarded(run, reference) -> float:
    """The ratio, measured again (up to three times in all, the least kept) while it is above the limit: a slow path stays
    slow, a burst of load on a shared host (a second of it was seen to cover two measurements) does not."""
    r = ratio(run, reference)
    for _ in range(2):
        if r <= LIMIT:
            break
        r = min(r, ratio(run, reference))
    return r


@pytest.mark.slow
@pytest.mark.parametrize("path", ["torch", "onednn"])
def test_no_module_path_loss_or_dtype_is_over_the_limit_against_its_plain_twin(path):
    if path == "onednn" and onednn.ops_error(torch.float32) is not None:
        pytest.skip("oneDNN's private ops do not work here")
    torch.manual_seed(0)
    over, seen = [], {}
    with hl.use_path(path):
        for dtype in (torch.float32, torch.bfloat16):
            b = batch_for(dtype)
            x = torch.randn(b, T, C).to(dtype)  # (b, T, C)
            grad = torch.randn(b, T, C).to(dtype)  # (b, T, C)
            for name, (make, make_reference) in MODULES.items():
                module, reference = make().to(dtype).eval(), make_reference().to(dtype).eval()
                for mode in ("forward", *LOSSES):
                    r = guarded(step(module, x, mode, grad), step(reference, x, mode, grad))
                    seen[name, str(dtype), mode] = r
                    if r > LIMIT:
                        over.append(f"{name} {dtype} {mode}: {r:.2f}x")
    assert len(seen) == len(MODULES) * 2 * (1 + len(LOSSES))
    assert not over, f"path {path}: over {LIMIT}x the plain layer of the same shape, twice: {over}"


def test_references_compute_what_their_modules_compute():
    """Each reference is the same layer: with the module's weights copied in, the same output (so the shapes match)."""
    torch.manual_seed(0)
    x = torch.randn(B, T, C)  # (B, T, C)
    ca, plain = MODULES["CausalAttention"][0](), MODULES["CausalAttention"][1]()
    for mine, theirs in ((ca.W_query, plain.q), (ca.W_key, plain.k), (ca.W_value, plain.v)):
        theirs.weight.data.copy_(mine.weight)
    torch.testing.assert_close(ca(x), plain(x))
    wrapper, twin = MODULES["MultiHeadAttentionWrapper"][0](), MODULES["MultiHeadAttentionWrapper"][1]()
    for head, ref in zip(wrapper.heads, twin.heads, strict=True):
        for mine, theirs in ((head.W_query, ref.q), (head.W_key, ref.k), (head.W_value, ref.v)):
            theirs.weight.data.copy_(mine.weight)
    torch.testing.assert_close(wrapper(x), twin(x))
    mha, plain = MODULES["MultiHeadAttention"][0](), MODULES["MultiHeadAttention"][1]()
    for mine, theirs in ((mha.W_query, plain.q), (mha.W_key, plain.k), (mha.W_value, plain.v), (mha.out_proj, plain.out)):
        theirs.load_state_dict(mine.state_dict())
    torch.testing.assert_close(mha(x), plain(x))


def test_the_guard_fails_a_10x_slower_module():
    """A module doing ten times its reference's work is over the limit: the guard can fail."""
    torch.manual_seed(0)
    x, grad = torch.randn(B, T, C), torch.randn(B, T, C)  # (B, T, C) each
    reference = MODULES["MultiHeadAttention"][1]().eval()

    class Pathological(nn.Module):
        def forward(self, x):
            for _ in range(9):
                reference(x)
            return reference(x)

    for mode in ("forward", "sum"):
        assert guarded(step(Pathological(), x, mode, grad), step(reference, x, mode, grad)) > LIMIT


def test_the_guard_fails_the_stride_0_gradient_pathology(monkeypatch):
    """oneDNN's backward handed ``out.sum()``'s expanded gradient as it is (no ``.contiguous()``): over the limit.

    Smaller shapes than the guard's: at the guard's the unmended backward takes too long to time.
    """
    if onednn.ops_error(torch.float32) is not None:
        pytest.skip("oneDNN's private ops do not work here")

    def unmended(ctx, grad):
        x, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, weight.shape[0])  # (M, N), stride 0 under out.sum()
        return onednn.inner_product(grad2d, weight.t(), None).view(x.shape), onednn.inner_product(x.reshape(-1, x.shape[-1]).t(), grad2d.t(), None).t(), None

    torch.manual_seed(0)
    c = 128
    x = torch.randn(1, 128, c)  # (B, T, C)
    module = hw.MultiHeadAttention(c, c, 128, 0.0, num_heads=2)  # out_proj last: the expanded gradient reaches it
    reference = Plain(c, c // 2, 2, bias=False, fused=False, out=True)
    with hl.use_path("onednn"):
        assert guarded(step(module, x, "sum", x), step(reference, x, "sum", x)) < LIMIT  # (measured again above it, as the guard does)
        monkeypatch.setattr(onednn.OneDNNLinear, "backward", staticmethod(unmended))
        assert ratio(step(module, x, "sum", x), step(reference, x, "sum", x), rounds=3) > LIMIT


def test_the_batch_grows_until_the_reference_takes_the_floor(monkeypatch):
    """``batch_for`` keeps B where the reference already takes ``FLOOR``, and doubles it up to ``MAX_B`` where it does not."""
    monkeypatch.setattr(sys.modules[__name__], "FLOOR", 0.0)
    assert batch_for(torch.float32) == B
    monkeypatch.setattr(sys.modules[__name__], "FLOOR", 3600.0)
    assert batch_for(torch.float32) == MAX_B
