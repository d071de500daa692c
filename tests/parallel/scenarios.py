"""What each of the 2 gloo ranks runs (see ranks.py): tensor-parallel modules against their single-process copies.

Every check builds a module from a fixed seed (the same on every rank), keeps a deepcopy as
the single-process reference, shards the original with ``headwise.parallel.parallelize``
and returns the largest differences, token lists and collective counts; the tests in
test_shard.py assert on them.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, suppress

import pytest
import torch
import torch.distributed as dist
from ranks import pieces
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode

import headwise.linear
from headwise import GPT2Config, GPT2MultiHeadAttention, KVCache, MultiHeadAttention
from headwise.models import BertConfig, BertModel, GPT2LMHeadModel, LlamaConfig, Qwen3ForCausalLM
from headwise.parallel import parallelize

TINY_GPT2 = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
TINY_BERT = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=32)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.detach().double() - b.detach().double()).abs().max().item()


def mesh(world: int):
    return init_device_mesh("cpu", (world,))


def fused_rows_of_rank(num_heads: int, num_kv_heads: int, head_dim: int, world: int, rank: int) -> torch.Tensor:
    """Rows of a [q | k | v] c_attn holding rank's heads, listed head by head (written apart from qkv_rows)."""
    D, per_q, per_kv = head_dim, num_heads // world, num_kv_heads // world
    q = [h * D + i for h in range(rank * per_q, (rank + 1) * per_q) for i in range(D)]
    k = [(num_heads + j) * D + i for j in range(rank * per_kv, (rank + 1) * per_kv) for i in range(D)]
    v = [(num_heads + num_kv_heads + j) * D + i for j in range(rank * per_kv, (rank + 1) * per_kv) for i in range(D)]
    return torch.tensor(q + k + v)


def grad_diffs(tp: torch.nn.Module, ref: torch.nn.Module, fused: dict[str, tuple[int, int, int]] | None = None, world: int = 2) -> dict[str, float]:
    """Each parameter's gradient, reassembled from the ranks' shards, against the single-process one
    (the largest difference over the largest gradient, or over 1 where every gradient is smaller)."""
    out = {}
    ref_params = dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        g, want = full(p.grad), ref_params[name].grad
        if fused and name.rsplit(".", 1)[0] in fused:  # sharded in head order: rank 0's q|k|v, rank 1's q|k|v
            want = torch.cat([want[fused_rows_of_rank(*fused[name.rsplit(".", 1)[0]], world, r)] for r in range(world)])
        out[name] = max_diff(g, want) / max(want.abs().max().item(), 1.0)  # relative to the largest gradient: a sum of squares grows them past 100, where 1e-5 is 1 ulp
    return out


class Collectives(TorchDispatchMode):
    """Record (collective, bytes of its input) for every c10d collective that runs, DTensor's included."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor turn the op into local ops and collectives, which come back here
        if func.namespace in ("_c10d_functional", "c10d", "_c10d_functional_autograd"):
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.calls.append((func.__name__.split(".")[0], sum(t.numel() * t.element_size() for t in tensors)))
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_onednn_calls():
    """Count calls into oneDNN's inner product through headwise.linear."""
    calls = []
    original = headwise.linear.onednn.inner_product

    def counted(x, weight, bias):
        calls.append(type(weight).__name__)
        return original(x, weight, bias)

    headwise.linear.onednn.inner_product = counted
    try:
        yield calls
    finally:
        headwise.linear.onednn.inner_product = original


# ----------------------------------------------------------------------------- checks


def mha(rank: int, world: int) -> dict:
    """The book's MultiHeadAttention (bidirectional, padding mask): forward, input and weight gradients."""
    torch.manual_seed(0)
    ref = MultiHeadAttention(32, 48, 16, 0.0, num_heads=4, qkv_bias=True, causal=False)
    tp = parallelize(copy.deepcopy(ref), mesh(world))
    x = torch.randn(2, 10, 32)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    weight = torch.randn(2, 10, 48)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(xi, attention_mask=mask) for m, xi in zip((tp, ref), xs, strict=True)]
    for out in outs:
        (out * weight).sum().backward()
    return {
        "out": max_diff(*outs), "x_grad": max_diff(xs[0].grad, xs[1].grad), "grads": grad_diffs(tp, ref),
        "local_heads": (tp.num_heads, tp.num_kv_heads), "local_W_key": tuple(tp.W_key.weight.to_local().shape),
    }


def per_head_terms(rank: int, world: int) -> dict:
    """Sinks (a learned logit per query head) and ALiBi slopes: each rank its heads' slice, the numbers and the
    sinks' gradient the single process's; the state dict whole, and a single-process one loads."""
    out = {}
    for terms in ({"sinks": True}, {"alibi": True}, {"sinks": True, "alibi": True}):
        torch.manual_seed(0)
        ref = MultiHeadAttention(32, 48, 16, 0.0, num_heads=4, **terms)
        if "sinks" in terms:
            with torch.no_grad():
                ref.sinks.copy_(torch.randn(4))  # a share the heads differ in
        tp = parallelize(copy.deepcopy(ref), mesh(world))
        x = torch.randn(2, 10, 32)
        weight = torch.randn(2, 10, 48)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        outs = [m(xi) for m, xi in zip((tp, ref), xs, strict=True)]
        for o in outs:
            (o * weight).sum().backward()
        name = "+".join(terms)
        out[name] = {"out": max_diff(*outs), "x_grad": max_diff(xs[0].grad, xs[1].grad), "grads": grad_diffs(tp, ref)}
        if "sinks" in terms:
            state = {k: v.clone() for k, v in ref.state_dict().items()}
            state["sinks"] = torch.randn(4)
            tp.load_state_dict(state)
            ref.load_state_dict(state)
            out[name]["loaded"] = max_diff(full(tp.sinks), ref.sinks) + max_diff(tp(x), ref(x))
            out[name]["local_sinks"] = tuple(tp.sinks.to_local().shape)
        if "alibi" in terms:
            out[name]["local_slopes"] = tp.alibi_slopes.tolist() == ref.alibi_slopes[rank * 2 : rank * 2 + 2].tolist()
            slopes = tp.alibi_slopes  # a move that leaves them uninitialised (as ``to_empty`` does) refills the rank's own
            tp._apply(lambda t, slopes=slopes: torch.full_like(t, float("nan")) if t is slopes else t)
            out[name]["refilled"] = tp.alibi_slopes.tolist() == ref.alibi_slopes[rank * 2 : rank * 2 + 2].tolist()
    return out


def gqa(rank: int, world: int) -> dict:
    """12 query / 4 key-value heads on 2 ranks: forward, gradients, cached decoding with a local-Hkv cache."""
    torch.manual_seed(1)
    ref = MultiHeadAttention(48, 96, 16, 0.0, num_heads=12, num_kv_heads=4)
    tp = parallelize(copy.deepcopy(ref), mesh(world))
    x = torch.randn(2, 9, 48)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(xi) for m, xi in zip((tp, ref), xs, strict=True)]
    for out in outs:
        out.square().sum().backward()
    with torch.no_grad():
        cache = KVCache(2, tp.num_kv_heads, 16, tp.head_dim)
        steps = [tp(x[:, :5], cache=cache)] + [tp(x[:, t : t + 1], cache=cache) for t in range(5, 9)]
        decoded = max_diff(torch.cat(steps, dim=1), ref(x))
    return {
        "out": max_diff(*outs), "x_grad": max_diff(xs[0].grad, xs[1].grad), "grads": grad_diffs(tp, ref), "decoded": decoded,
        "cache_heads": cache.k.shape[1], "local_heads": (tp.num_heads, tp.num_kv_heads),
    }


def gpt2_attention(rank: int, world: int) -> dict:
    """GPT-2's fused c_attn with GQA (12/4 heads): head-ordered shards, gradients, state dict round trip."""
    torch.manual_seed(2)
    config = GPT2Config(n_embd=96, n_head=12, n_kv_head=4, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0)
    ref = GPT2MultiHeadAttention(config)
    tp = parallelize(copy.deepcopy(ref), mesh(world))
    x = torch.randn(2, 7, 96)
    outs = [m(x) for m in (tp, ref)]
    for out in outs:
        out.square().sum().backward()
    mine = fused_rows_of_rank(12, 4, 8, world, rank)
    state = {k: full(v) for k, v in tp.state_dict().items()}
    fresh = copy.deepcopy(ref)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh = parallelize(fresh, mesh(world))
    fresh.load_state_dict(ref.state_dict())  # a single-process checkpoint into the sharded module
    return {
        "out": max_diff(*outs),
        "grads": grad_diffs(tp, ref, fused={"c_attn": (12, 4, 8)}, world=world),
        "local_c_attn": max_diff(tp.c_attn.weight.to_local(), ref.c_attn.weight[mine]),
        "state_keys": sorted(state) == sorted(ref.state_dict()),
        "state": max(max_diff(state[k], v) for k, v in ref.state_dict().items()),
        "loaded": max_diff(fresh(x), ref(x)),
    }


def gpt2_model(rank: int, world: int) -> dict:
    """GPT2LMHeadModel: logits with left padding, gradients, greedy and seeded sampled generate."""
    torch.manual_seed(3)
    ref = GPT2LMHeadModel(TINY_GPT2)
    with torch.no_grad():  # GPT-2's own embedding scale, so that sampling has more than one likely token
        ref.transformer.wte.weight.mul_(0.02)
        ref.transformer.wpe.weight.mul_(0.02)
    tp = parallelize(copy.deepcopy(ref), mesh(world))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    logits = [m(ids, attention_mask=mask) for m in (tp, ref)]
    for out in logits:
        out.logsumexp(-1).sum().backward()
    prompt = ids[:, :5]
    greedy = [m.generate(prompt, max_new_tokens=8).tolist() for m in (tp, ref)]
    sampled = [m.generate(prompt, max_new_tokens=8, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(5)).tolist()
               for m in (tp, ref)]
    every_rank = [None] * world
    dist.all_gather_object(every_rank, (greedy[0], sampled[0]))
    replicated = [p.grad for p in tp.parameters() if not isinstance(p, DTensor)]  # embeddings, LayerNorms
    grads_every_rank = [None] * world
    dist.all_gather_object(grads_every_rank, replicated)
    return {
        "logits": max_diff(*logits), "grads": grad_diffs(tp, ref, fused={f"transformer.h.{i}.attn.c_attn": (4, 4, 16) for i in range(2)}),
        "greedy": greedy, "sampled": sampled, "every_rank": every_rank,
        "replicated_grads_agree": all(torch.equal(a, b) for g in grads_every_rank for a, b in zip(g, replicated, strict=True)),
    }


def llama(rank: int, world: int) -> dict:
    """A Qwen3-style model (QK-norm, GQA 4/2 heads, rotary positions, one windowed layer): logits with
    left padding, gradients, greedy generate through per-rank caches of Hkv/n heads."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, qk_norm=True, windows=(3, None))
    torch.manual_seed(8)
    ref = Qwen3ForCausalLM(config)
    tp = parallelize(copy.deepcopy(ref), mesh(world))
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(9))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :2] = 0
    logits = [m(ids, attention_mask=mask) for m in (tp, ref)]
    for out in logits:
        out.logsumexp(-1).sum().backward()
    greedy = [m.generate(ids[:, :5], max_new_tokens=6).tolist() for m in (tp, ref)]
    local_heads = [(m.self_attn.num_heads, m.self_attn.num_kv_heads) for m in tp.model.layers]
    return {"logits": max_diff(*logits), "grads": grad_diffs(tp, ref), "greedy": greedy, "local_heads": local_heads}


def bert(rank: int, world: int) -> dict:
    """BertModel (bidirectional MultiHeadAttention, post-LN, padding): hidden states and gradients."""
    torch.manual_seed(6)
    ref = BertModel(TINY_BERT)
    tp = parallelize(copy.deepcopy(ref), mesh(world))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0
    outs = [m(ids, attention_mask=mask) for m in (tp, ref)]
    for out in outs:
        out.square().sum().backward()
    return {"out": max_diff(*outs), "grads": grad_diffs(tp, ref)}


def communication(rank: int, world: int) -> dict:
    """Every collective of a forward, a backward and a decode step, with its size in bytes."""
    torch.manual_seed(8)
    gpt2 = parallelize(GPT2LMHeadModel(TINY_GPT2), mesh(world))
    encoder = parallelize(BertModel(TINY_BERT), mesh(world))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(9))
    out = {}
    with Collectives() as c:
        logits = gpt2(ids)
    out["gpt2_forward"] = c.calls
    with Collectives() as c:
        logits.logsumexp(-1).sum().backward()
    out["gpt2_backward"] = c.calls
    with Collectives() as c:
        hidden = encoder(ids)
    out["bert_forward"] = c.calls
    with Collectives() as c:
        hidden.square().sum().backward()
    out["bert_backward"] = c.calls
    with torch.no_grad():
        caches = [KVCache(2, b.attn.num_kv_heads, 9, 16) for b in gpt2.transformer.h]
        gpt2(ids, positions=torch.arange(8).expand(2, 8), cache=caches)
        with Collectives() as c:
            gpt2(ids[:, :1], positions=torch.full((2, 1), 8), cache=caches)
    out["gpt2_decode_step"] = c.calls
    return out


def fast_path(rank: int, world: int) -> dict:
    """oneDNN's fast path and its packed-weight cache never see a DTensor weight, with oneDNN forced
    (the rule picks F.linear on CPUs without AVX-512, where the guard would not be exercised)."""
    if headwise.linear.onednn.ops_error(torch.float32) is not None:
        return {"skipped": headwise.linear.onednn.ops_error(torch.float32)}
    with headwise.linear.use_path("onednn"):
        return _fast_path(world)


def _fast_path(world: int) -> dict:
    torch.manual_seed(10)
    ref = GPT2LMHeadModel(TINY_GPT2).eval()
    tp = parallelize(copy.deepcopy(ref), mesh(world))
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(11))  # B*T = 40 rows: enough for oneDNN
    with torch.no_grad(), counting_onednn_calls() as tp_calls:
        tp_logits = tp(ids)
    with torch.no_grad(), counting_onednn_calls() as ref_calls:
        ref_logits = ref(ids)
    c_fc = tp.transformer.h[0].mlp.c_fc
    x = torch.randn(40, 64)
    return {
        "tp_calls": tp_calls, "ref_calls": len(ref_calls), "logits": max_diff(tp_logits, ref_logits) / ref_logits.abs().max().item(),  # relative: |logits| reach ~55, where 1e-5 is < 2 ulp
        "uses_onednn_dtensor": headwise.linear.uses_onednn(x, c_fc.weight, c_fc.bias),
        "uses_onednn_plain": headwise.linear.uses_onednn(x, full(c_fc.weight), full(c_fc.bias)),
        "onednn_chosen": headwise.linear.choose(torch.float32)[0] == "onednn",
        "linear_dtensor": max_diff(
            headwise.linear.linear(DTensor.from_local(x, c_fc.weight.device_mesh, [Replicate()]), c_fc.weight, c_fc.bias).full_tensor(),
            torch.nn.functional.linear(x, full(c_fc.weight), full(c_fc.bias)),
        ),
    }


def indivisible(rank: int, world: int) -> dict:
    """Heads, KV heads and MLP widths that 2 ranks cannot split, and a mesh listing its ranks backwards, are ValueErrors
    naming them."""
    m = mesh(world)
    with pytest.raises(ValueError, match=r"num_heads \(3\) and num_kv_heads \(3\) must both be divisible by the mesh size \(2\)"):
        parallelize(MultiHeadAttention(12, 12, 8, 0.0, num_heads=3), m)
    with pytest.raises(ValueError, match=r"num_heads \(4\) and num_kv_heads \(1\) must both be divisible by the mesh size \(2\)"):
        parallelize(GPT2MultiHeadAttention(GPT2Config(n_embd=32, n_head=4, n_kv_head=1)), m)
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.intermediate: out_features \(37\) must be divisible by the mesh size \(2\)"):
        parallelize(BertModel(BertConfig(vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37)), m)
    from torch.distributed.device_mesh import DeviceMesh

    backwards = DeviceMesh("cpu", list(range(world))[::-1])  # valid, but torch scatters shards in the group's sorted order
    with pytest.raises(ValueError, match=r"device_mesh must list its ranks in ascending order, got \[1, 0\]"):
        parallelize(MultiHeadAttention(12, 12, 8, 0.0, num_heads=2), backwards)
    untouched = MultiHeadAttention(12, 12, 8, 0.0, num_heads=3)
    with suppress(ValueError):
        parallelize(untouched, m)
    return {"raised": True, "untouched": not any(isinstance(p, DTensor) for p in untouched.parameters())}


def fsdp2(rank: int, world: int) -> dict:
    """headwise models under FSDP2's fully_shard (data parallelism, gloo CPU): training steps equal one process."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(12)
    ref = GPT2LMHeadModel(TINY_GPT2)
    model = copy.deepcopy(ref)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh(world))
    fully_shard(model, mesh=mesh(world))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]  # before any forward (FSDP2 swaps parameters in it)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(13))
    losses = []
    for _ in range(3):
        step = []
        for m, opt in zip((model, ref), opts, strict=True):
            loss = torch.nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            step.append(loss.item())
        losses.append(step)
    params = max(max_diff(full(p), q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    with torch.no_grad():  # after optimizer steps: FSDP2 refilled its weights in place, no cached copy may be stale
        evaluated = max_diff(model(ids), ref(ids))
    return {"losses": losses, "params": params, "eval": evaluated}


def tp_fsdp(rank: int, world: int) -> dict:
    """Tensor parallelism under FSDP2 (a (1, world) mesh, as the 2-D recipe's): Qwen3's QK-norm weights (the same on every
    rank, their gradient summed over the ranks' heads) train as in one process, and GPT-2's state dict (c_attn in
    checkpoint order, on the 2-D mesh) is the single-process one's."""
    from torch.distributed.fsdp import fully_shard

    grid = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, qk_norm=True)
    out = {}
    for name, build in (("qwen3", lambda: Qwen3ForCausalLM(config)), ("gpt2", lambda: GPT2LMHeadModel(TINY_GPT2))):
        torch.manual_seed(12)
        ref = build()
        model = parallelize(copy.deepcopy(ref), grid["tp"])
        for block in model.model.layers if name == "qwen3" else model.transformer.h:
            fully_shard(block, mesh=grid["dp"])
        fully_shard(model, mesh=grid["dp"])
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(13))
        for _ in range(3):
            for m, opt in zip((model, ref), opts, strict=True):
                torch.nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
                opt.step()
                opt.zero_grad()
        mine = dict(model.named_parameters())
        out[name] = {n: max_diff(full(mine[n]), p) for n, p in ref.named_parameters() if "c_attn" not in n}  # (its rows reordered)
        state, want = model.state_dict(), ref.state_dict()
        out[name + "_state"] = max(max_diff(full(state[k]), v) for k, v in want.items()) if state.keys() == want.keys() else "keys"
    return out


def tp_edges(rank: int, world: int) -> dict:
    """A state dict kept as variables, x by keyword, NaN at padded tokens under autograd, a state dict of another mesh,
    attention maps refused on a sharded encoder, a rank outside the mesh refused before any change."""
    from headwise.models.heads import attention_maps

    out = {}
    torch.manual_seed(3)
    fused = GPT2MultiHeadAttention(GPT2Config(n_embd=32, n_head=4, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0))
    ref_fused = copy.deepcopy(fused)
    kept = parallelize(fused, mesh(world)).state_dict(keep_vars=True)
    out["keep_vars"] = max(max_diff(full(kept[k]), v) for k, v in ref_fused.state_dict().items())
    ref = MultiHeadAttention(16, 16, 8, 0.0, num_heads=4, causal=False)
    tp = parallelize(copy.deepcopy(ref), mesh(world))
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        out["keyword"] = max_diff(tp(x=x), ref(x))
    x[1, 4:] = float("nan")
    real = torch.ones(2, 6, dtype=torch.bool)
    real[1, 4:] = False
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for m, xi in zip((tp, ref), xs, strict=True):
        m(xi, attention_mask=real)[real].sum().backward()
    out["padding"] = (max_diff(xs[0].grad[real], xs[1].grad[real]), grad_diffs(tp, ref))
    torch.manual_seed(4)
    model = GPT2LMHeadModel(TINY_GPT2).eval()
    sharded = parallelize(copy.deepcopy(model), mesh(world))
    own = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))["tp"]  # one rank a mesh: another layout
    torch.manual_seed(5)
    other = parallelize(GPT2LMHeadModel(TINY_GPT2).eval(), own)
    other.load_state_dict(sharded.state_dict())
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        out["other_mesh"] = max_diff(other(ids), model(ids))
    encoder = parallelize(BertModel(TINY_BERT), mesh(world))
    try:
        attention_maps(encoder, torch.tensor([[1, 2, 3]]))
        out["maps"] = None
    except ValueError as e:
        out["maps"] = str(e)
    first = dist.new_group([0])  # (every rank makes the group; rank 1 is outside it)
    del first
    outside = MultiHeadAttention(16, 16, 8, 0.0, num_heads=4)
    try:
        from torch.distributed.device_mesh import DeviceMesh

        parallelize(outside, DeviceMesh("cpu", [0]))
        out["outside"] = None
    except ValueError as e:
        out["outside"] = str(e)
    out["outside_untouched"] = all(type(p) is torch.nn.Parameter for p in outside.parameters()) and outside.num_heads == 4
    return out


def demo(rank: int, world: int) -> dict:
    """headwise.parallel.demo on a HuggingFace-layout GPT-2 directory: its printout and tokens."""
    import io
    import json
    import tempfile
    from contextlib import redirect_stdout
    from pathlib import Path

    from safetensors.torch import save_file

    from headwise.convert import HF_GPT2_TRANSPOSED
    from headwise.parallel import demo as tp_demo

    torch.manual_seed(14)
    single = GPT2LMHeadModel(TINY_GPT2).eval()
    with tempfile.TemporaryDirectory() as d:
        config = {"model_type": "gpt2", **{k: getattr(TINY_GPT2, k) for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")}}
        (Path(d) / "config.json").write_text(json.dumps(config))
        state = {k: v.t().contiguous() if k.endswith(HF_GPT2_TRANSPOSED) else v for k, v in single.state_dict().items()}
        save_file(state, str(Path(d) / "model.safetensors"))
        printed = io.StringIO()
        with redirect_stdout(printed):
            tokens = tp_demo.run(["--model", d, "--ids", "3,1,4,1,5", "--max-new-tokens", "6"])
    expected = single.generate(torch.tensor([[3, 1, 4, 1, 5]]), max_new_tokens=6)[0].tolist()
    return {"printed": printed.getvalue(), "tokens": tokens, "expected": expected}


def refused_load(rank: int, world: int) -> dict:
    """A strict load_state_dict of a state dict that does not fit a sharded model or layer: every problem named, no
    tensor changed (torch's own load copies the entries that fit first); then the right one loads."""
    from headwise.loadable import StateDictError

    out = {}
    torch.manual_seed(15)
    for name, ref in (("gpt2", GPT2LMHeadModel(TINY_GPT2)), ("mha", MultiHeadAttention(32, 48, 16, 0.0, num_heads=4))):
        tp = parallelize(copy.deepcopy(ref), mesh(world))
        before = {k: full(v).clone() for k, v in tp.state_dict().items()}
        state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in ref.state_dict().items()}  # new values
        keys = [k for k, _ in ref.named_parameters()]  # (not MultiHeadAttention's optional book mask)
        missing, misshaped, integer = keys[0], keys[1], keys[-1]
        del state[missing]
        state[misshaped] = torch.zeros(3, 3)
        state[integer] = torch.ones(state[integer].shape, dtype=torch.int64)
        try:
            tp.load_state_dict(state)
            message = None
        except StateDictError as e:
            message = str(e)
        after = {k: full(v) for k, v in tp.state_dict().items()}
        changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
        good = {k: torch.randn_like(v) if k in keys else v for k, v in ref.state_dict().items()}  # the book mask as it is
        tp.load_state_dict(good)
        loaded = max(max_diff(full(v), good[k]) for k, v in tp.state_dict().items())
        out[name] = {"message": message, "named": [missing, misshaped, integer], "changed": changed, "loaded": loaded}
    return out


def edges(rank: int, world: int) -> dict:
    """Cross-attention through a ContextCache (its weights watched by their local shards), a bare module's output as a
    plain tensor (pickled: the summed numbers), GPT-2's fused c_attn refusing cross-attention by name, and a plain
    model refusing a sharded model's state dict by name before any copy."""
    import pickle

    from headwise import ContextCache
    from headwise.loadable import StateDictError

    out = {}
    torch.manual_seed(16)
    ref = MultiHeadAttention(32, 48, 16, 0.0, num_heads=4, num_kv_heads=2, causal=False, kv_dim=24)
    tp = parallelize(copy.deepcopy(ref), mesh(world))
    x, context = torch.randn(2, 5, 32), torch.randn(2, 7, 24)
    cached, cached_ref = ContextCache(), ContextCache()
    with torch.no_grad():
        first = max_diff(tp(x, context=context, cache=cached), ref(x, context=context, cache=cached_ref))
        again = max_diff(tp(x[:, :2], cache=cached), ref(x[:, :2], cache=cached_ref))
    out["context_cache"] = (first, again)
    self_ref = MultiHeadAttention(32, 48, 16, 0.0, num_heads=4)
    self_tp = parallelize(copy.deepcopy(self_ref), mesh(world))
    y = self_tp(x)
    out["output_type"] = type(y).__name__
    out["pickled"] = max_diff(pickle.loads(pickle.dumps(y.detach())), self_ref(x).detach())
    fused = GPT2MultiHeadAttention(GPT2Config(n_embd=32, n_head=4, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0), causal=False)
    try:
        parallelize(fused, mesh(world))(x, context=torch.randn(2, 7, 32))
        out["fused_cross"] = None
    except ValueError as e:
        out["fused_cross"] = str(e)
    model = GPT2LMHeadModel(TINY_GPT2)
    plain = copy.deepcopy(model)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    try:
        plain.load_state_dict(parallelize(model, mesh(world)).state_dict())
        out["sharded_load"] = None
    except StateDictError as e:
        out["sharded_load"] = str(e)
    out["changed"] = sorted(k for k, v in plain.state_dict().items() if not torch.equal(v, before[k]))
    return out


CHECKS = {f.__name__: f for f in (demo, mha, per_head_terms, gqa, gpt2_attention, gpt2_model, llama, bert, communication, fast_path, indivisible, fsdp2,
                                  refused_load, edges, tp_fsdp, tp_edges)}


def run_all(rank: int, world: int) -> dict:
    return pieces(rank, world, CHECKS)
