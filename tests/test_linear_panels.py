"""headwise.linear.panels: the GEMM over panels of the weight (float32, bfloat16, int8), against the float64 reference at
every row count, width and depth its loops branch on (a prompt's rows a chunk at a time), its packing, what it takes,
and its place in a graph whose weights inductor freezes (the packing folded into a constant, done once)."""

import itertools
import sys
from pathlib import Path

import pytest
import torch
from helpers import outputs_under_avx2
from reference import linear as ref_linear

from headwise import linear as hl
from headwise.linear import onednn, panels, projection

needs_panels = pytest.mark.skipif(not panels.available(), reason="the panels GEMM runs where torch's kernels are AVX-512 or AVX2 and the library builds")
needs_compiled_panels = pytest.mark.skipif((torch.float32,) * 2 not in panels.operands(), reason="a compiled step's panels run where torch's kernels are AVX-512 and the library builds")
DTYPES = [pytest.param(torch.float32, id="fp32"),
          pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif((torch.bfloat16,) * 2 not in panels.operands(compiled=False),
                                                                            reason="bfloat16 panels need AVX512-BF16 or AVX2 kernels"))]


def case(rows: int, n: int, k: int, bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)  # (M, K)
    w = torch.randn(n, k, generator=gen) / k**0.5  # (N, K)
    b = torch.randn(n, generator=gen) if bias else None  # (N,)
    return x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)


def within_float32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Each output within the float32 bound of a sum of K products (and the bias) of the reference's, plus one
    rounding to the output's dtype (bfloat16: the sum rounded once)."""
    want = ref_linear(x, w, b)  # float64 of the operands' values
    k = x.shape[-1]
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())  # (..., N)
    last = 0 if x.dtype == torch.float32 else 2**-8  # bfloat16's unit roundoff
    assert got.dtype == x.dtype and got.shape == want.shape
    assert bool(((got.double() - want).abs() <= (k + 2) * 2**-24 * scale + last * want.abs() + 1e-30).all())


def frozen_run(fn, x: torch.Tensor) -> tuple[object, str]:
    """``fn(x)`` under ``torch.compile`` with the weights frozen into the graph: its output and the generated code."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    run = torch.compile(fn, fullgraph=True, dynamic=True)
    with torch.no_grad(), projection.freezing():
        got, code = run_and_get_code(run, x)
    return got, "\n".join(code)


@needs_panels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 13, 14, 15, 16, 17, 29, 32, 33])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 100])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_count_and_width_matches_the_reference(rows, n, bias, dtype):
    x, w, b = case(rows, n, 70, bias, dtype)
    within_float32(panels.linear(x, w, b), x, w, b)


@needs_panels
@pytest.mark.parametrize("k", [1, 2, 5, 64, 3071, 3072])
@pytest.mark.parametrize("rows", [1, 9, 15])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_depth_matches_the_reference(k, rows, dtype):
    """Depths on and off the blocks of k the passes take, in one pass of rows and in several."""
    x, w, b = case(rows, 65, k, True, dtype)
    within_float32(panels.linear(x, w, b), x, w, b)


@needs_panels
@pytest.mark.parametrize("k, rows", [(3072, 1), (3072, 41), (3072, 97), (1000, 700), (4096, 129)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompts_rows_in_chunks_match_the_reference(k, rows, dtype):
    """Many rows run a chunk at a time (about half a megabyte of x each, a multiple of the rows a pass takes): counts that end a chunk
    part-way, a chunk of one block, and one row, all against float64; int8 by int8 gives the exact sums."""
    x, w, b = case(rows, 70, k, True, dtype)
    within_float32(panels.linear(x, w, b), x, w, b)
    if (torch.int8, torch.int8) in panels.operands(compiled=False) and dtype == torch.float32:
        xi, wi = a8_case(rows, 70, k)
        assert torch.equal(panels.linear(xi, wi), xi.int() @ wi.int().T)


@needs_panels
@needs_panels
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_packing_and_the_gemm_pass_torchs_opcheck(dtype):
    """``pack_panels`` and ``panels_linear`` against ``torch.library.opcheck``: schemas, fakes (the shapes a compiled
    step is traced with), autograd registration, AOT dispatch."""
    x, w, b = case(3, 100, 64, True, dtype)
    assert set(torch.library.opcheck(torch.ops.headwise.pack_panels, (w, dtype)).values()) == {"SUCCESS"}
    packed = torch.ops.headwise.pack_panels(w, dtype)
    assert set(torch.library.opcheck(torch.ops.headwise.panels_linear, (x[:, None], packed, b, 100)).values()) == {"SUCCESS"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dimensions_and_a_strided_input(dtype):
    x, w, b = case(12, 40, 95, True, dtype)
    x3 = x.view(3, 4, 95)  # (B, T, K)
    out = panels.linear(x3, w, b)
    assert out.shape == (3, 4, 40)
    within_float32(out, x3, w, b)
    wide = torch.randn(12, 200).to(dtype)
    strided = wide[:, 50:145]  # (M, K) rows 200 apart
    within_float32(panels.linear(strided, w, b), strided, w, b)
    empty = panels.linear(torch.randn(0, 95).to(dtype), w, b)  # no rows
    assert empty.shape == (0, 40)


@needs_panels
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_panels_and_onednn_take_turns_in_one_thread(dtype):
    """On a CPU with AMX the bfloat16 panels load their own tile configuration (4 rows or more) and release it; oneDNN's
    AMX kernels, run before and after in the same threads, configure theirs again: every call stays exact."""
    x, w, b = case(40, 96, 3072, True, dtype)
    packed = onednn.packed(w) if onednn.ops_error(dtype) is None else None  # (oneDNN refuses bfloat16 without AVX-512)
    for rows in (1, 8, 40, 8):
        within_float32(panels.linear(x[:rows], w, b), x[:rows], w, b)
        if packed is not None:
            within_float32(onednn.inner_product(x[:rows], packed, b), x[:rows], w, b)


@needs_panels
def test_the_packing_puts_32_columns_k_major_and_pads_with_zeros():
    w = torch.randn(70, 9)  # (N, K)
    packed = torch.ops.headwise.pack_panels(w)
    assert packed.shape == (3, 9, 32)
    assert torch.equal(packed.transpose(1, 2).reshape(96, 9)[:70], w)  # panel p, k, j = w[32 p + j, k]
    assert not packed[2, :, 6:].any()  # 70 = 2 * 32 + 6: the rest of the last panel is zero
    packed = torch.ops.headwise.pack_panels(w.bfloat16())  # bfloat16: k in pairs, K = 9 padded to 10
    assert packed.shape == (3, 10, 32) and packed.dtype == torch.bfloat16
    pairs = packed.view(3, 5, 32, 2)  # panel p, pair i, column j, e = w[32 p + j, 2 i + e]
    assert torch.equal(pairs.permute(0, 2, 1, 3).reshape(96, 10)[:70, :9], w.bfloat16())
    assert not pairs[:, 4, :, 1].any() and not pairs[2, :, 6:].any()  # the padding k and columns are zero


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"])
def test_a_packed_weight_of_2_mib_or_more_starts_a_huge_page_and_is_unmapped_when_freed(dtype):
    """From 2 MiB the panels are a mapping of their own at a 2 MiB boundary (asked in transparent huge pages); smaller
    ones are torch's; either way the layout is the packing's (the int8 case in quads where the CPU has AVX512-VNNI);
    freeing the tensor gives its memory back at once."""
    w = torch.randint(-127, 128, (2048, 1100), dtype=torch.int8) if dtype == torch.int8 else torch.randn(1030, 1100).to(dtype)
    small = w[:64, :64].contiguous()
    for weight, x_dtype in ((w, None), (small, None), *(((w, torch.int8),) if dtype == torch.int8 else ())):
        packed = torch.ops.headwise.pack_panels(weight, x_dtype)
        group = 1 if packed.dtype == torch.float32 else 4 if packed.dtype == torch.uint8 else 2  # k side by side a step
        if packed.nbytes >= 2 << 20:
            assert packed.data_ptr() % (2 << 20) == 0
        unpacked = packed.view(packed.shape[0], -1, 32, group).permute(0, 2, 1, 3).reshape(packed.shape[0] * 32, -1)  # (N', K')
        values = unpacked.view(torch.int8) ^ -128 if packed.dtype == torch.uint8 else unpacked  # w + 128 back to w
        assert torch.equal(values[: weight.shape[0], : weight.shape[1]], weight)

    def mapped(address: int) -> bool:
        spans = (line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines())
        return any(int(lo, 16) <= address < int(hi, 16) for lo, hi in spans)

    kept = [torch.ops.headwise.pack_panels(w) for _ in range(4)]
    addresses = [p.data_ptr() for p in kept]
    assert all(map(mapped, addresses))
    del kept, packed
    assert not any(map(mapped, addresses))  # unmapped when freed, not kept by an allocator


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_packed_weights_from_256_kib_to_2_mib_share_slabs_that_go_when_their_weights_do():
    """Weights of 256 KiB to 2 MiB packed one after another at 4 KiB boundaries in 32 MiB slabs of huge pages (each
    weight's values the packing's); a slab is unmapped once every weight in it is freed and a newer slab took its place."""
    w = torch.randn(512, 512)  # 1 MiB packed
    first = [torch.ops.headwise.pack_panels(w) for _ in range(40)]  # more than a slab holds
    addresses = [p.data_ptr() for p in first]
    assert all(a % 4096 == 0 for a in addresses)
    steps = [b - a for a, b in itertools.pairwise(addresses)]
    assert steps.count(1 << 20) >= 30  # side by side within a slab
    assert all(torch.equal(p.transpose(1, 2).reshape(512, 512), w) for p in first)
    old = addresses[0]
    del first
    later = [torch.ops.headwise.pack_panels(w) for _ in range(40)]  # the slab in use now is a later one
    spans = (line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines())
    assert not any(int(lo, 16) <= old < int(hi, 16) for lo, hi in spans) or any(p.data_ptr() <= old < p.data_ptr() + p.nbytes for p in later)
    del later


@needs_panels
@pytest.mark.parametrize(
    "make",
    [
        lambda x, w, b: (x.bfloat16(), w, b),
        lambda x, w, b: (x, w.double(), b),
        lambda x, w, b: (x, w, b[:-1]),
        lambda x, w, b: (x, w, b.double()),
        lambda x, w, b: (x, w[None], b),
        lambda x, w, b: (x[:, :0], w[:, :0], b),
        lambda x, w, b: (x[:, :-1], w, b),
    ],
    ids=["mixed", "float64 weight", "short bias", "float64 bias", "3-D weight", "K = 0", "K apart"],
)
def test_it_takes_operands_of_one_dtype_and_shape_only(make):
    x, w, b = case(4, 40, 16, True)
    assert panels.takes(x, w, b) and panels.takes(x, w, None)
    assert not panels.takes(*make(x, w, b))


@needs_compiled_panels
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_frozen_graph_packs_each_weight_once_and_runs_the_panels(rows, dtype):
    """Under ``projection.freezing()`` a projection traces as ``pack_panels`` + ``panels_linear``; inductor's freezing
    folds the packing of the frozen weight into a constant, so the compiled code only runs the GEMM."""
    from torch._inductor.utils import run_and_get_code

    layer = torch.nn.Linear(95, 80).to(dtype).eval()
    x = torch.randn(rows, 1, 95).to(dtype)  # (B, T=1, K): a decode step's input
    torch._dynamo.reset()
    run = torch.compile(lambda x: hl.linear(x, layer.weight, layer.bias), fullgraph=True, dynamic=True)
    with torch.no_grad(), projection.freezing():
        got, code = run_and_get_code(run, x)
    within_float32(got, x, layer.weight.detach(), layer.bias.detach())
    assert "panels_linear" in "\n".join(code) and "pack_panels" not in "\n".join(code)



@pytest.mark.parametrize("capability, flags, fp32, bf16, a8", [
    ("AVX512", ["avx512f", "avx512_bf16", "avx512_vnni"], "panels", "panels", "panels"),
    ("AVX512", ["avx512f", "avx512_vnni"], "panels", "inductor", "panels"),
    ("AVX512", ["avx512f"], "panels", "inductor", "panels"),  # int8 x int8: AVX2's word products
    ("AVX512", ["amx_bf16", "amx_int8", "amx_tile", "avx512f", "avx512_bf16", "avx512_vnni"], "panels", "panels", "inductor"),  # AMX
    ("AVX2", ["avx2"], "inductor", "inductor", "panels"),
    ("DEFAULT", [], "inductor", "inductor", "int_mm")])
def test_describe_names_the_compiled_steps_gemm(machine, capability, flags, fp32, bf16, a8):
    machine("GenuineIntel", capability, flags)
    step = hl.describe()["compiled_step"]
    assert set(step) == {"float32", "bfloat16", "int8", "int8, int8 activations"}
    assert step["float32"]["path"] == fp32 and step["bfloat16"]["path"] == bf16 and step["int8"]["path"] == bf16
    assert step["int8, int8 activations"]["path"] == a8
    assert {"AVX512": "AVX-512", "AVX2": "AVX2", "DEFAULT": "DEFAULT"}[capability] in step["float32"]["reason"]
    for dtype in ("bfloat16", "int8"):
        assert (bf16 == "inductor" and capability == "AVX512") == ("no avx512_bf16" in step[dtype]["reason"])
        assert ("AMX tiles from" in step[dtype]["reason"]) == ("amx_bf16" in flags)
    a8_reason = step["int8, int8 activations"]["reason"]
    assert ("AMX tiles" in a8_reason) == ("amx_int8" in flags)  # never "no avx512_vnni" where the CPU has it
    assert ("no avx512_vnni" in a8_reason) == (capability == "AVX512" and "avx512_vnni" not in flags)
    assert ("word products" in a8_reason) == (capability in ("AVX512", "AVX2") and "avx512_vnni" not in flags)


@pytest.mark.parametrize("capability, flags, compiled", [
    ("AVX512", ["avx512f", "avx512_bf16", "avx512_vnni"], True),
    ("AVX512", ["avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8"], False),  # compiled: inductor's AMX int8 GEMM
    ("AVX512", ["avx512f", "avx512_bf16"], True),  # AVX2's word products
    ("AVX2", ["avx2"], True)])
def test_int8_rows_take_the_panels_on_every_x86_cpu_they_build_for(capability, flags, compiled):
    """int8 x int8 panels run wherever the panels do (AVX512-VNNI's byte dot products, else AVX2's word ones: torch's
    _int_mm is a scalar loop there), but a compiled step on a CPU with AMX's int8 tiles leaves them to inductor's AMX
    GEMM (eager decode calls keep them: torch's _int_mm took 1.7-2x their step time there)."""
    facts = {"capability": capability, "flags": flags}
    assert (torch.int8, torch.int8) in panels.operands_on(facts, compiled=False)
    assert ((torch.int8, torch.int8) in panels.operands_on(facts)) is compiled
    assert (torch.float32, torch.float32) in panels.operands_on(facts, compiled=False)
    assert ((torch.float32, torch.float32) in panels.operands_on(facts)) is (capability == "AVX512")


@needs_panels
def test_the_ops_refuse_what_they_cannot_read():
    x, w, b = case(2, 40, 16, True)
    packed = torch.ops.headwise.pack_panels(w)
    int8 = torch.ops.headwise.pack_panels(w.to(torch.int8))
    for bad, match in [(lambda: torch.ops.headwise.pack_panels(w.double()), "2-D float32, bfloat16 or int8"),
                       (lambda: torch.ops.headwise.pack_panels(w, torch.int8), "x_dtype must be the weight's dtype"),
                       (lambda: torch.ops.headwise.pack_panels(w.to(torch.int8), torch.float32), "Char and x_dtype Float"),
                       (lambda: torch.ops.headwise.panels_linear(x, int8, None, 40), "int8 for bfloat16 x"),
                       (lambda: torch.ops.headwise.panels_linear(x.to(torch.int8), packed, None, 40), "uint8 or int8 for int8 x"),
                       (lambda: torch.ops.headwise.panels_linear(x.bfloat16(), int8, b.bfloat16(), 40), "int8 panels take no bias"),
                       (lambda: torch.ops.headwise.panels_linear(x.double(), packed, None, 40), "float32, bfloat16 or int8"),
                       (lambda: torch.ops.headwise.panels_linear(x.bfloat16(), packed, None, 40), "output for it"),
                       (lambda: torch.ops.headwise.panels_linear(x, packed, None, 70), "do not hold a weight of 70"),
                       (lambda: torch.ops.headwise.panels_linear(x[:, :15], packed, None, 40), "by 15"),
                       (lambda: torch.ops.headwise.panels_linear(x, packed, b[:3], 40), "bias must hold 40")]:
        with pytest.raises(RuntimeError, match=match):
            bad()


needs_int8 = pytest.mark.skipif((torch.bfloat16, torch.int8) not in panels.operands(compiled=False),
                                reason="int8 panels need AVX512-BF16 or AVX2 kernels, and the library built")
needs_frozen_int8 = pytest.mark.skipif((torch.bfloat16, torch.int8) not in panels.operands(),
                                       reason="a compiled step's int8 panels need AVX512-BF16 and the library built")


def int8_case(rows: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).bfloat16()  # (M, K)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)  # (N, K)
    return x, w


@needs_int8
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 17, 32, 33])  # from 2 rows in AMX tiles where the CPU has them
@pytest.mark.parametrize("n, k", [(1, 1), (33, 5), (100, 70), (65, 3071), (32, 3072)])
def test_int8_panels_sum_like_the_reference_and_torchs_kernel(rows, n, k):
    """int8 weights with bfloat16 x: the exact products' float32 sums rounded to bfloat16 once, within the float32
    bound of the float64 reference, and (where torch's int8 kernel reads K) nearly always its very bits."""
    x, w = int8_case(rows, n, k)
    got = panels.linear(x, w)
    within_float32(got, x, w, None)
    if k % 16 == 0:
        theirs = torch._weight_int8pack_mm(x, w, torch.ones(n, dtype=torch.bfloat16))  # (M, N), sums in another order
        assert (got != theirs).float().mean() < 0.01


@needs_int8
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])  # one pass, ROWS, more than a pass, AMX's blocks where the CPU has them
def test_every_int8_value_at_every_place_of_a_panel_step_reads_as_itself(rows):
    """A weight holding each of the 256 int8 values (-128 too: a loaded state dict may hold it) at each place of a
    panel's step, read back whole by one-hot rows of x: each output is one weight exactly, through the widening to
    bfloat16 (and, with int8 x, the integer dot products)."""
    n, k = 64, 256  # two panels; a step holds 32 columns' pairs of k
    w = ((torch.arange(n * k) * 37) % 256 - 128).to(torch.int8).view(n, k)  # (N, K): 37 is odd, so every value in each 256
    for place in range(0, k, rows):
        picked = torch.arange(place, min(place + rows, k))  # (m,) the k's read back
        one_hot = torch.zeros(len(picked), k)
        one_hot[torch.arange(len(picked)), picked] = 1.0  # (m, K)
        want = w.T[picked]  # (m, N)
        assert torch.equal(panels.linear(one_hot.bfloat16(), w).float(), want.float())
        if (torch.int8, torch.int8) in panels.operands(compiled=False):
            assert torch.equal(panels.linear(one_hot.to(torch.int8), w), want.int())


@needs_int8
def test_int8_packing_is_the_bfloat16_layout():
    w = torch.randint(-127, 128, (70, 9), dtype=torch.int8)  # (N, K)
    packed = torch.ops.headwise.pack_panels(w)
    assert packed.dtype == torch.int8
    assert torch.equal(packed.float(), torch.ops.headwise.pack_panels(w.bfloat16()).float())  # int8 values are exact in bfloat16


@needs_frozen_int8
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("k", [96, 90, 95])
def test_a_frozen_int8_layer_runs_the_panels_with_its_own_arithmetic(rows, k):
    """``Int8Linear`` in a graph whose weights inductor freezes: the panels' GEMM over the int8 weight packed at compile
    (also at a K torch's int8 kernel cannot read), then the scales and the bias; the layer's numbers to the bound of
    its arithmetic (``reference.int8_linear``)."""
    from reference import int8_linear

    from headwise.quantize import Int8Linear

    gen = torch.Generator().manual_seed(3)
    layer = Int8Linear(torch.randn(80, k, generator=gen), torch.randn(80, generator=gen))
    x = torch.randn(rows, 1, k, generator=gen)  # (B, T=1, K)
    got, code = frozen_run(layer, x)
    assert "panels_linear" in code and "pack_panels" not in code and "int8pack" not in code
    want, bound = int8_linear(x, layer.weight, layer.scales, layer.bias)
    assert got.dtype == x.dtype and bool(((got.double() - want).abs() <= bound).all())


@needs_panels
@pytest.mark.parametrize("make", [lambda x, w, b: (x, w.double(), b), lambda x, w, b: (x[:, :15], w, b),
                                  lambda x, w, b: (x.bfloat16(), w.to(torch.int8), b.bfloat16())],
                         ids=["float64 weight", "K apart", "int8 with a bias"])
def test_linear_names_operands_it_cannot_run(make):
    x, w, b = case(2, 40, 16, True)
    with pytest.raises(ValueError, match=r"panels.linear runs .* got x"):
        panels.linear(*make(x, w, b))


@needs_frozen_int8
def test_int8_layers_read_by_one_input_run_as_one_frozen_gemm():
    """``project_many`` over ``Int8Linear`` layers in a graph whose weights inductor freezes: one ``panels_linear`` over
    their weights concatenated (folded at compile with the packing), each layer's outputs bit for bit its own call's
    in the same graph setting."""
    from torch._inductor.utils import run_and_get_code

    from headwise.quantize import Int8Linear

    gen = torch.Generator().manual_seed(4)
    layers = [Int8Linear(torch.randn(n, 96, generator=gen), torch.randn(n, generator=gen)) for n in (64, 32, 32)]
    x = torch.randn(3, 1, 96, generator=gen)  # (B, T=1, K)
    torch._dynamo.reset()
    together = torch.compile(lambda x: hl.project_many(layers, x), fullgraph=True, dynamic=True)
    alone = torch.compile(lambda x: [layer(x) for layer in layers], fullgraph=True, dynamic=True)
    with torch.no_grad(), projection.freezing():
        got, code = run_and_get_code(together, x)
        want = alone(x)
    code = "\n".join(code)
    assert code.count("torch.ops.headwise.panels_linear.default(") == 1 and "pack_panels" not in code
    assert [tuple(y.shape) for y in got] == [(3, 1, 64), (3, 1, 32), (3, 1, 32)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


needs_a8 = pytest.mark.skipif((torch.int8, torch.int8) not in panels.operands(compiled=False),
                              reason="int8 x int8 panels need AVX2 or AVX-512 kernels and the library built")
VNNI = "avx512_vnni" in hl.cpu()["flags"]  # int8 x: uint8 quads for vpdpbusd, else int8 pairs for vpmaddwd
needs_a8_compiled = pytest.mark.skipif((torch.int8, torch.int8) not in panels.operands(),
                                       reason="a compiled step's int8 x int8 panels need AVX512-VNNI, no AMX int8 tiles, the library built")


def a8_case(rows: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-128, 128, (rows, k), generator=gen, dtype=torch.int8)  # (M, K): -128 too, which rows never hold
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)  # (N, K)
    return x, w


@needs_a8
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17])
@pytest.mark.parametrize("n, k", [(1, 1), (33, 5), (100, 70), (65, 3071), (32, 3072), (45, 766)])
def test_int8_by_int8_panels_give_the_exact_integer_sums(rows, n, k):
    """int8 x and weights: int32 sums equal to the integers' (int64 reference), so to ``torch._int_mm``'s bits, at
    every K (a multiple of 4 or not: the last quad padded with zeros)."""
    x, w = a8_case(rows, n, k)
    got = panels.linear(x, w)
    assert got.dtype == torch.int32 and torch.equal(got.long(), x.long() @ w.long().T)
    if rows > 16 and k % 8 == 0:  # where torch's int8 GEMM takes the operands
        assert torch.equal(got, torch._int_mm(x, w.T))


@needs_a8
def test_int8_by_int8_sums_at_the_extremes():
    """Rows of -128 against weights of -127 and 127 at K = 8192: the sums of w + 128 wrap past int32 before 128 times
    the row's sum is taken off, and the result is still the exact one."""
    x = torch.full((3, 8192), -128, dtype=torch.int8)  # (M, K)
    w = torch.stack([torch.full((8192,), -127), torch.full((8192,), 127), torch.arange(8192) % 255 - 127]).to(torch.int8)
    assert torch.equal(panels.linear(x, w).long(), x.long() @ w.long().T)


@needs_a8
def test_int8_x_packing_is_quads_of_the_weight_plus_128_with_vnni_else_pairs():
    w = torch.randint(-128, 128, (70, 9), dtype=torch.int8)  # (N, K)
    packed = torch.ops.headwise.pack_panels(w, torch.int8)  # (3, 12, 32) quads, (3, 10, 32) pairs
    group, kp = (4, 12) if VNNI else (2, 10)
    assert packed.dtype == (torch.uint8 if VNNI else torch.int8) and tuple(packed.shape) == (3, kp, 32)
    assert packed.shape == torch.ops.headwise.pack_panels(w.to("meta"), torch.int8).shape  # the fake's shape
    unpacked = packed.view(3, kp // group, 32, group).permute(0, 2, 1, 3).reshape(96, kp).long() - (128 if VNNI else 0)  # (P * 32, K')
    assert torch.equal(unpacked[:70, :9], w.long()) and not unpacked[70:].any() and not unpacked[:, 9:].any()


@needs_a8_compiled
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("k", [96, 90])
def test_a_frozen_int8_activation_layer_runs_the_panels_bit_for_bit(rows, k):
    """``Int8Linear(activations="int8")`` in a graph whose weights inductor freezes: the rows rounded to int8, the panels'
    integer GEMM over the weight packed at compile, then the scales and bias: the eager layer's numbers bit for bit
    (integer sums have no order), with no ``int_mm`` left in the graph."""
    from headwise.quantize import Int8Linear

    gen = torch.Generator().manual_seed(6)
    layer = Int8Linear(torch.randn(80, k, generator=gen), torch.randn(80, generator=gen), activations="int8")
    x = torch.randn(rows, 1, k, generator=gen)  # (B, T=1, K)
    got, code = frozen_run(layer, x)
    assert "panels_linear" in code and "pack_panels" not in code and "int_mm" not in code
    assert torch.equal(got, layer(x))


@needs_a8_compiled
def test_int8_activation_layers_read_by_one_input_run_as_one_frozen_gemm():
    """``project_many`` over int8-activation layers under freezing: x rounded to int8 once, one ``panels_linear`` over the
    weights concatenated, each layer's outputs bit for bit its eager call's."""
    from headwise.quantize import Int8Linear

    gen = torch.Generator().manual_seed(7)
    layers = [Int8Linear(torch.randn(n, 96, generator=gen), torch.randn(n, generator=gen), activations="int8") for n in (64, 32)]
    x = torch.randn(3, 1, 96, generator=gen)  # (B, T=1, K)
    got, code = frozen_run(lambda x: hl.project_many(layers, x), x)
    assert code.count("torch.ops.headwise.panels_linear.default(") == 1 and "pack_panels" not in code
    assert all(torch.equal(a, layer(x)) for a, layer in zip(got, layers, strict=True))


def _takes_cases(make_case, needs, cases):
    return [pytest.param(make_case, make, takes, id=name, marks=needs) for name, make, takes in cases]


@pytest.mark.parametrize("make_case, make, takes", [
    *_takes_cases(int8_case, needs_int8, [
        ("bfloat16 x", lambda x, w: (x, w, None), True), ("float32 x", lambda x, w: (x.float(), w, None), False),
        ("bfloat16 x, a bias", lambda x, w: (x, w, torch.zeros(40, dtype=torch.bfloat16)), False),
        ("K = 8", lambda x, w: (x[:, :8], w[:, :8], None), True)]),
    *_takes_cases(a8_case, needs_a8, [
        ("int8 x", lambda x, w: (x, w, None), True), ("int8 x, float weight", lambda x, w: (x, w.float(), None), False),
        ("int8 x, a bias", lambda x, w: (x, w, torch.zeros(40, dtype=torch.int8)), False),
        ("uint8 x", lambda x, w: (x.to(torch.uint8), w, None), False)]),
])
def test_int8_weights_take_bfloat16_or_int8_x_and_no_bias(make_case, make, takes):
    x, w = make_case(4, 40, 16)
    assert panels.takes(*make(x, w)) == takes


@needs_panels
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
def test_a_rows_sums_do_not_depend_on_the_rows_beside_it(weights):
    """Each row's outputs are the bits a call of that row alone gives, at every row count the blocks of sums branch on
    (the rows of sums a pass, 4 rows as 2 + 2 and a panel widened once for many rows of bfloat16 x by int8 weights on
    AVX2), where more than one pass takes the panel's k's a block at a time (770 k: blocks of 64, 128 or 256 and a
    short last one) and one pass takes them all at once: each sum over k is the same additions in the same order. (Not where AMX tiles run bfloat16 x: they add 32 k a step.)"""
    operands = (torch.bfloat16, torch.int8 if weights == "int8" else torch.bfloat16)
    if weights != "fp32" and (operands not in panels.operands(compiled=False) or "amx_bf16" in hl.cpu()["flags"]):
        pytest.skip("bfloat16 x runs vdpbf16ps or its widening here only where torch's kernels are AVX2 or AVX512-BF16 without AMX")
    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    n, k = 100, 770
    x, w, b = case(129, n, k, weights != "int8", dtype)
    if weights == "int8":
        w = torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.int8)  # (N, K)
    packed = torch.ops.headwise.pack_panels(w)
    alone = torch.cat([torch.ops.headwise.panels_linear(x[i:i + 1], packed, b, n) for i in range(len(x))])  # (129, N)
    for rows in (2, 3, 4, 5, 6, 7, 15, 16, 17, 35, 48, 129):
        assert torch.equal(torch.ops.headwise.panels_linear(x[:rows], packed, b, n), alone[:rows]), rows


def pair_outputs() -> dict[str, torch.Tensor]:
    """The panels' bfloat16 x by bfloat16 and int8 weights (``panels_linear``, ``panels_int8_scaled``) on seeded cases:
    every row count a block of sums takes (1-8, 15-17, 35-48), widths and depths off the panel and pair boundaries."""
    out = {}
    for n, k in [(100, 70), (33, 1), (64, 2), (2304, 768)]:
        for rows in (1, 2, 3, 4, 5, 6, 8, 15, 16, 17, 35, 40, 48):  # (AVX2: an int8 panel widened once from 6 rows)
            x, w, b = case(rows, n, k, True, torch.bfloat16, seed=rows)
            wi = torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(rows), dtype=torch.int8)
            scales = torch.rand(n, generator=torch.Generator().manual_seed(n))
            bf16, int8 = torch.ops.headwise.pack_panels(w), torch.ops.headwise.pack_panels(wi)
            out[f"{n}x{k} {rows} rows, bfloat16"] = torch.ops.headwise.panels_linear(x, bf16, b, n)
            out[f"{n}x{k} {rows} rows, bfloat16, no bias"] = torch.ops.headwise.panels_linear(x, bf16, None, n)
            out[f"{n}x{k} {rows} rows, int8 sums"] = torch.ops.headwise.panels_linear(x, int8, None, n)
            out[f"{n}x{k} {rows} rows, int8 scaled"] = torch.ops.headwise.panels_int8_scaled(x.float(), int8, scales, b.float(), n)
    return out


@needs_panels
def test_the_widened_pairs_under_avx2_give_this_builds_bits(tmp_path):
    """Under torch's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``: the library built with AVX2's flags) bfloat16 and int8
    weights by bfloat16 x run each pair widened to float32 in registers, its two products added as vdpbf16ps adds them:
    the same bits as this process's build (vdpbf16ps where the CPU has AVX512-BF16), case by case."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2: torch runs its plain kernels whatever it is asked")
    theirs, ours = outputs_under_avx2("test_linear_panels", "pair_outputs", tmp_path), pair_outputs()
    assert list(theirs) == list(ours)
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []


@needs_panels
@pytest.mark.parametrize("rows", [1, 5, 16, 100])
def test_int8_scaled_rounds_float32_x_as_torch_rounds_it_to_bfloat16(rows):
    """``panels_int8_scaled`` rounds float32 x to bfloat16 itself: the same outputs as for x rounded by torch first, bit
    for bit, at odd K, at halfway values, and with infinities and a NaN."""
    n, k = 40, 701
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    x[0, :8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, 65504.0, float("inf"), -float("inf"), 3.0])  # ties, a subnormal
    x[-1, 5] = float("nan")
    wi = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales, bias = torch.rand(n, generator=gen), torch.randn(n, generator=gen)
    packed = torch.ops.headwise.pack_panels(wi)
    got = torch.ops.headwise.panels_int8_scaled(x, packed, scales, bias, n)  # (rows, n) float32
    want = torch.ops.headwise.panels_int8_scaled(x.to(torch.bfloat16).float(), packed, scales, bias, n)  # exact in bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got[-1].isnan().all()  # (row 0's infinities of both signs make its sums NaN too)
    assert not got[1:-1].isnan().any()
