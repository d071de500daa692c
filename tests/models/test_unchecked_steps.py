"""generate's unchecked forwards (``forward(..., check=False)``, down to every attention layer and
its cache) give the checked path's numbers bit for bit, and generate checks every forward where it
cannot trust them; a model's forward refuses caches it cannot run."""

import functools

import pytest
import torch
from torch import nn

from headwise import GPT2Config
from headwise.models import GPT2LMHeadModel, LlamaForCausalLM
from headwise.models.generate import trusts
from headwise.models.llama_config import LlamaConfig
from headwise.observe import observe
from headwise.quantize import int8_weights


def gpt2(**kw):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4, **kw)).eval()


def llama(**kw):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, **kw)
    return LlamaForCausalLM(config).eval()


MODELS = {
    "gpt2": gpt2,
    "llama": llama,
    "llama-tied": lambda: llama(tie_word_embeddings=True),
    "mistral-window": lambda: llama(windows=(4, None)),  # layer 0 on a ring cache of 4 slots
    "qwen3-qk-norm": lambda: llama(qk_norm=True, head_dim=16),
    "gpt2-bf16": lambda: gpt2().to(torch.bfloat16),
    "llama-bf16": lambda: llama().to(torch.bfloat16),
    "gpt2-int8": lambda: int8_weights(gpt2()),
    "llama-int8": lambda: int8_weights(llama()),
}
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])  # (B, T): row 1 left-padded


@pytest.fixture(params=[True, False], ids=["walk-in-C", "walk-in-python"])
def library(request, monkeypatch):
    """The modules walked by the C library's call (``generate.Walk``), or by Python's ``walked`` (the library taken away)."""
    from headwise import native

    if request.param:
        if not native.built():
            pytest.skip("headwise's C++ library is not built here")
    else:
        monkeypatch.setattr(native, "loaded", lambda: False)
    return request.param
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mask", [None, MASK], ids=["no-padding", "left-padding"])
@torch.no_grad()
def test_unchecked_steps_equal_the_checked_steps_bit_for_bit(name, mask):
    model = MODELS[name]()
    assert trusts(model)
    is_token = None if mask is None else mask.bool()
    positions = None if is_token is None else (is_token.long().cumsum(-1) - 1).masked_fill(~is_token, 0)  # (B, T)
    checked, unchecked = (model.new_caches(2, 6 + 12) for _ in range(2))
    first = model(IDS, is_token, positions=positions, cache=checked, logits_to_keep=1)  # (B, 1, vocab)
    assert torch.equal(first, model(IDS, is_token, positions=positions, cache=unchecked, logits_to_keep=1, check=False))
    token, position = first[:, 0].argmax(-1)[:, None], None if positions is None else positions[:, -1:]  # (B, 1)
    for _ in range(12):
        position = None if position is None else position + 1
        want = model(token, positions=position, cache=checked)  # (B, 1, vocab)
        got = model(token, positions=position, cache=unchecked, check=False)
        assert torch.equal(got, want)
        token = want[:, 0].argmax(-1)[:, None]  # (B, 1)
    for a, b in zip(checked, unchecked, strict=True):
        assert len(a) == len(b) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral-window"])
def test_generate_is_the_same_with_checked_steps(name):
    """A no-op forward hook sends every step through the checked path: the tokens do not change."""
    model = MODELS[name]()
    fast = model.generate(IDS, attention_mask=MASK, max_new_tokens=10)
    handle = model.register_forward_pre_hook(lambda module, args: None)
    assert not trusts(model)
    slow = model.generate(IDS, attention_mask=MASK, max_new_tokens=10)
    handle.remove()
    assert torch.equal(fast, slow)


def test_generate_checks_every_step_when_it_cannot_trust_them(library):
    model = gpt2()
    assert trusts(model)
    model.train()
    assert not trusts(model)  # dropout: the unchecked core runs none
    model.eval()
    handle = model.transformer.h[1].attn.register_forward_hook(lambda module, args, out: None)
    assert not trusts(model)  # a hook may change what the next layer is given
    handle.remove()
    with observe(lambda name, tensor: None):
        assert not trusts(model)  # an observer reads the checked core's steps
    assert not trusts(object())
    model.forward = torch.compile(model.forward)  # the caller's own forward (not compiled until called)
    assert not trusts(model)


def test_trusts_looks_at_every_submodule(library):
    """A hook or training mode anywhere in the tree, the deepest and a shared module's second place included."""
    model = gpt2()
    for m in model.modules():
        handle = m.register_forward_pre_hook(lambda module, args: None)
        assert not trusts(model), type(m).__name__
        handle.remove()
        m.training = True
        assert not trusts(model), type(m).__name__
        m.training = False
    assert trusts(model)
    shared = model.transformer.h[0].mlp
    model.transformer.h[1].extra = shared  # one module in two places: still looked at, once
    shared.c_fc.register_forward_hook(lambda module, args, out: None)
    assert not trusts(model)


def test_a_hooked_attention_layer_sees_every_step():
    model = gpt2()
    calls = []
    model.transformer.h[0].attn.register_forward_hook(lambda module, args, out: calls.append(tuple(out.shape)))
    model.generate(IDS[:1], max_new_tokens=5)
    assert calls == [(1, 6, 32)] + [(1, 1, 32)] * 4  # the prompt, then 4 steps (the 5th token needs no step)


@pytest.mark.parametrize("terms", [
    {"softcap": 5.0}, {"sinks": True}, {"alibi": True}, {"window": 3}, {"num_kv_heads": 2, "window": 3, "sinks": True},
    {"alibi": True, "window": 3},
], ids=str)
@pytest.mark.parametrize("sliding", [False, True])
@torch.no_grad()
def test_decode_equals_forward_with_every_score_term(terms, sliding):
    """``forward(..., check=False)`` (generate's unchecked step) and ``forward`` through twin caches, bit for bit."""
    from headwise import KVCache, MultiHeadAttention

    if sliding and "window" not in terms:
        pytest.skip("a ring cache goes with a window")
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 16, 32, 0.0, num_heads=4, **terms).eval()
    if "sinks" in terms:
        nn.init.normal_(mha.sinks)
    hkv = terms.get("num_kv_heads", 4)
    make = (lambda: KVCache.sliding(2, hkv, terms["window"], 4)) if sliding else (lambda: KVCache(2, hkv, 32, 4))
    checked, unchecked = make(), make()
    x = torch.randn(2, 5, 16)  # (B, T, C): the prompt, checked
    torch.testing.assert_close(mha(x, cache=checked), mha(x, cache=unchecked), rtol=0, atol=0)
    for _ in range(8):
        x = torch.randn(2, 1, 16)  # (B, 1, C): one step
        assert torch.equal(mha(x, cache=unchecked, check=False), mha(x, cache=checked))
    assert len(checked) == len(unchecked) == 13 and torch.equal(checked.k, unchecked.k) and torch.equal(checked.v, unchecked.v)


@torch.no_grad()
def test_caches_that_disagree_are_refused_before_any_layer_writes():
    """Each layer checks its own cache as it writes: the model checks them all first, so that a later layer's refusal
    leaves no earlier layer's cache written, and caches of different contents never attend apart."""
    from headwise import KVCache, PagedKVCache

    model = llama()
    ids = torch.randint(0, 97, (2, 5))

    def state(caches):
        return [(len(c), c.k.clone()) for c in caches] if isinstance(caches[0], KVCache) else \
            [(c.length(0), c.free_blocks, c.k.clone()) for c in caches]

    def refused(caches, match, make=lambda c: c, tokens=ids, error=ValueError):
        before = state(caches)
        with pytest.raises(error, match=match):
            model(tokens, cache=[make(c) for c in caches])
        after = state(caches)
        assert all(a[:-1] == b[:-1] and torch.equal(a[-1], b[-1]) for a, b in zip(after, before, strict=True))

    short = [KVCache(2, 2, 10, 8), KVCache(2, 2, 6, 8)]  # layer 1 has less room
    model(ids, cache=short)
    refused(short, r"cache\[1\] is full: it holds 5 of max_len=6 tokens and cannot take 5 more")
    apart = model.new_caches(2, 16)
    model(ids, cache=apart)
    apart[1].crop(3)
    refused(apart, r"cache\[1\] holds 3 tokens \(torch.float32, padded: False\), cache\[0\] 5 .*each given the same tokens")
    refused([KVCache(2, 2, 10, 8), KVCache(1, 2, 10, 8)], r"cache\[1\] holds \(B, Hkv, D\) = \(1, 2, 8\); layer 1 writes \(2, 2, 8\)")
    pools = [model.new_paged_caches(8, 4)[0], model.new_paged_caches(2, 4)[1]]  # layer 1's pool too small
    for pool in pools:
        pool.add(0)
    refused(pools, r"the PagedKVCache pool is exhausted: writing 12 tokens needs 3 free blocks, 2 of 2 are free",
            lambda p: p.batch([0], [12]), torch.randint(0, 97, (1, 12)))
    one = model.new_caches(2, 16)[0]  # one cache given to both layers: layer 0 wrote it before layer 1 refused it
    refused([one, one], r"cache\[1\] is cache\[0\]: give every layer a cache of its own")
    pool = model.new_paged_caches(8, 4)[0]
    pool.add(0)
    refused([pool, pool], r"cache\[1\] is cache\[0\]", lambda p: p.batch([0], [5]), torch.randint(0, 97, (1, 5)))
    # what only layer 1's own call would refuse, checked before layer 0 writes: a window, a head size, a dtype, a device,
    # a batch used already
    refused([KVCache(2, 2, 10, 8), KVCache.sliding(2, 2, 4, 8)], r"cache\[1\] \(layer 1\): a sliding cache of window=4 needs .* got window=None")
    elsewhere = [KVCache(2, 2, 10, 8), KVCache(2, 2, 10, 8, device="meta")]
    with pytest.raises(ValueError, match=r"cache\[1\] \(layer 1\): .*meta"):
        model(ids, cache=elsewhere)
    assert len(elsewhere[0]) == 0 and elsewhere[0]._owner is None and not elsewhere[0].k.any()
    one_token = torch.randint(0, 97, (1, 5))
    for second, match, error in (
        (PagedKVCache(8, 4, 2, 16), r"cache\[1\] \(layer 1\): a paged batch of 5 new tokens takes k of shape", ValueError),
        (PagedKVCache(8, 4, 2, 8, dtype=torch.float64), r"cache\[1\] \(layer 1\): the cache is torch.float64", TypeError),
        (PagedKVCache(8, 4, 2, 8, window=4), r"cache\[1\] \(layer 1\): a sliding cache of window=4", ValueError),
    ):
        pools = [model.new_paged_caches(8, 4)[0], second]
        for pool in pools:
            pool.add(0)
        refused(pools, match, lambda p: p.batch([0], [5]), one_token, error)
    pools = model.new_paged_caches(8, 4)
    for pool in pools:
        pool.add(0)
    used = pools[1].batch([0], [5])
    used.check_append(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))  # (checks only: the batch stays unused)
    model(one_token, cache=[pools[0].batch([0], [5]), used])
    pools[0].crop(0, 0)
    pools[1].crop(0, 0)
    refused(pools, r"cache\[1\] \(layer 1\): this PagedBatch was used already", lambda p: used if p is pools[1] else p.batch([0], [5]),
            one_token)
    theirs = llama().new_caches(2, 16)
    llama_other = llama()
    llama_other(ids, cache=theirs)  # bound to another model's layers
    refused(theirs, r"this KVCache belongs to LlamaAttention at 0x[0-9a-f]+, not to LlamaAttention")


def test_a_models_forward_refuses_caches_it_cannot_run():
    model, paged = gpt2(), gpt2().new_paged_caches(4, 4)
    for pool in paged:
        pool.add(0)
    with pytest.raises(TypeError, match=r"cache must be a list of one cache per layer \(2\): model.new_caches\(batch_size, max_len\).*got KVCache"):
        model(IDS, cache=model.new_caches(2, 8)[0])
    with pytest.raises(TypeError, match=r"cache must be a list of one cache per layer \(2\).*got a list of 1"):
        model(IDS, cache=model.new_caches(2, 8)[:1])
    with pytest.raises(TypeError, match=r"cache must hold KVCaches or paged batches, one kind, got \['KVCache', 'PagedBatch'\]"):
        model(IDS[:1, :1], cache=[model.new_caches(1, 8)[0], paged[1].batch([0], [1])])
    with pytest.raises(ValueError, match=r"a paged batch packs its sequences' real tokens in one row: input_ids \(1, T\) and no attention_mask, got B=2"):
        model(IDS, cache=[c.batch([0], [6]) for c in paged])
    with pytest.raises(ValueError, match=r"input_ids has 6 tokens after 60 cached, more than n_positions=64"):
        caches = model.new_caches(2, 70)
        model(torch.ones(2, 60, dtype=torch.long), cache=caches)
        model(IDS, cache=caches)
    with pytest.raises(TypeError, match=r"positions must be an integer tensor of shape \(batch, tokens\) = \(2, 6\), got dtype torch.float32"):
        model(IDS, positions=torch.zeros(2, 6))
    pools = model.new_paged_caches(40, 4)  # room for more than n_positions
    for pool in pools:
        pool.add(0)
        pool.add(1)
    with torch.no_grad():
        model(torch.ones(1, 62, dtype=torch.long), cache=[p.batch([0, 1], [60, 2]) for p in pools])
    with pytest.raises(ValueError, match=r"sequence 0 would hold 66 tokens \(6 new after 60\), more than n_positions=64"), torch.no_grad():
        model(torch.ones(1, 9, dtype=torch.long), cache=[p.batch([1, 0], [3, 6]) for p in pools])  # no IndexError from the embedding
    with pytest.raises(ValueError, match=r"cache\[0\] \(layer 0\): k requires grad, but a PagedKVCache serves inference only"):
        model(torch.ones(1, 9, dtype=torch.long), cache=[p.batch([1, 0], [3, 6]) for p in pools])  # grad on: refused first
    assert [p.length(s) for p in pools for s in (0, 1)] == [60, 2, 60, 2]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@torch.no_grad()
def test_padding_takes_no_position_on_the_checked_path_either(name):
    """A left-padded batch whose slots pass the model's limit but whose rows' real tokens do not: ``generate`` with a
    hook (every forward checked) gives the unchecked run's tokens, and each checked decode step's logits are those of the
    row run alone without its padding; a row whose real tokens pass the limit is refused by the forward and the layers."""
    model = MODELS[name]()  # a limit of 64 positions
    ids = torch.randint(1, 97, (2, 50), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[0, -30:], mask[1, -5:] = True, True  # 50 slots, 30 and 5 real tokens
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=30)  # 80 slots: 59 and 34 positions
    hook = model.blocks[0].register_forward_hook(lambda *args: None)
    assert not trusts(model)
    streamed = []
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=30, on_token=streamed.append), plain)
    assert len(streamed) == 30
    hook.remove()
    caches = model.new_caches(2, 90)
    model(ids, mask, cache=caches)
    alone = model.new_caches(1, 90)
    model(ids[:1, -30:], cache=alone)
    for token in plain[:, 50:80].T:  # (B,) a step
        got = model(token[:, None], cache=caches)  # (B, 1, vocab): checked, 51 .. 80 slots
        assert torch.allclose(got[:1], model(token[:1, None], cache=alone), atol=1e-5)
    assert len(caches[0]) == 80 and len(alone[0]) == 60
    full = torch.ones(2, 70, dtype=torch.bool)
    full[1, :40] = False  # row 0: 70 real tokens
    with pytest.raises(ValueError, match=r"more than (n_positions|max_position_embeddings)=64"):
        model(torch.ones(2, 70, dtype=torch.long), full, cache=model.new_caches(2, 90))
    layer, cache = model.attention_layers()[0], caches[0]
    cache.crop(60)
    with pytest.raises(ValueError, match=r"got 70 tokens in a row, padding not counted \(60 cached \+ 30 new slots\), more than context_length=64"):
        layer(torch.randn(2, 30, 32), cache=cache)  # row 0: 40 + 30 real
    assert len(cache) == 60


@pytest.mark.parametrize("max_len", [5.5, 5.0, float("inf"), 0, "8", True])
def test_new_caches_checks_max_len_when_every_layer_slides(max_len):
    """A model whose every layer has a window (every cache a ring) checks ``max_len`` as any other model does."""
    for model in (llama(windows=(4, 4)), llama()):
        with pytest.raises((TypeError, ValueError), match=r"max_len must be a positive int"):
            model.new_caches(2, max_len)
    assert [c.max_len for c in llama(windows=(4, 4)).new_caches(2, 9)] == [4, 4]


def _varied(model):
    """The model with weights large enough that a change to any part changes its greedy tokens."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 if ("wte" in name or "embed" in name or "lm_head" in name) else 0.6)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.5, 1.5)
    return model


def _scaled_forward(module):
    """Set a forward on the instance, as accelerate's hooks do: the module's output times 1.5."""
    base = module.forward
    module.forward = lambda *args, **kwargs: base(*args, **kwargs) * 1.5


def _parts(model, name):
    blocks = model.blocks if hasattr(model, "blocks") else model.model.layers
    if name == "norm":
        return [b.ln_1 if hasattr(b, "ln_1") else b.input_layernorm for b in blocks]
    return [b.mlp.c_proj if hasattr(b.mlp, "c_proj") else b.mlp.down_proj for b in blocks]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("part", ["norm", "projection"])
@torch.no_grad()
def test_a_forward_set_on_a_part_is_run_by_generate_and_the_batcher(name, part, library):
    """A norm's or a projection's ``forward`` set on the instance: ``generate``'s steps and the ``Batcher``'s (whose
    unchecked step runs a layer's parts in one op) run it, set before the call or between steps (inside ``on_token``,
    or between two of the Batcher's steps): the tokens of the model's own forward over the whole sequence each step."""
    from headwise.models import Batcher

    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2))

    def made(patched):
        model = _varied(MODELS[name]())
        for module in _parts(model, part) if patched else ():
            _scaled_forward(module)
        return model

    def full_forward(model):  # greedy through the whole sequence each step: no cache, no kept step
        ids = prompt
        for _ in range(12):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
        return ids[0, 7:].tolist()

    want = full_forward(made(True))
    assert want != full_forward(made(False))  # the forward set changes the tokens
    model = made(True)
    assert not trusts(model)
    assert model.generate(prompt, max_new_tokens=12)[0, 7:].tolist() == want
    model = made(True)
    batcher = Batcher(model, num_blocks=10, block_size=4)
    batcher.submit(prompt[0], 12)
    assert [t for _, t in batcher.stream()] == want

    def patched_mid_run(checked):  # the forward set after the fourth token: the checked steps' tokens (the cache keeps
        model, count = made(False), [0]  # the earlier keys, made before it)
        if checked:
            model.register_forward_hook(lambda *args: None)  # every step a checked forward

        def on_token(token):
            count[0] += 1
            if count[0] == 4:
                for module in _parts(model, part):
                    _scaled_forward(module)

        return model.generate(prompt, max_new_tokens=12, on_token=on_token)[0, 7:].tolist()

    want = patched_mid_run(True)
    assert want != made(False).generate(prompt, max_new_tokens=12)[0, 7:].tolist()
    assert patched_mid_run(False) == want
    model = made(False)
    batcher, got = Batcher(model, num_blocks=10, block_size=4), []
    batcher.submit(prompt[0], 12)
    while batcher.pending:
        got += [t for _, t in batcher.step()]
        if len(got) == 4:
            for module in _parts(model, part):
                _scaled_forward(module)
    assert got == want


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@torch.no_grad()
def test_a_weight_on_token_writes_through_data_is_read_from_the_next_step(name):
    """``on_token`` scaling every matrix through ``.data`` (an EMA's write) after the third and sixth tokens: the
    eager unchecked steps (which keep packed copies of the weights) give the checked steps' tokens."""

    def run(checked, writes=True):
        model = _varied(MODELS[name]())
        if checked:
            model.register_forward_hook(lambda *args: None)  # every step a checked forward
        count = [0]

        def on_token(token):
            count[0] += 1
            if count[0] in (3, 6):
                for pname, p in model.named_parameters():
                    if p.ndim == 2 and "wte" not in pname and "embed" not in pname:
                        p.data.mul_(1.3)

        prompt = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(3))
        return model.generate(prompt, max_new_tokens=10, on_token=on_token if writes else None)[0, 6:].tolist()

    want = run(True)
    assert want != run(True, writes=False)  # the writes change the tokens
    assert run(False) == want


def _replaced(model, part):
    """Every block's MLP (or first norm) replaced by a copy of it with its weights scaled by 1.5."""
    import copy

    blocks = model.blocks if hasattr(model, "blocks") else model.model.layers
    for block in blocks:
        name = "mlp" if part == "mlp" else ("ln_1" if hasattr(block, "ln_1") else "input_layernorm")
        new = copy.deepcopy(getattr(block, name))
        for p in new.parameters():
            p.mul_(1.5)
        setattr(block, name, new)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("part", ["mlp", "norm"])
@torch.no_grad()
def test_a_part_on_token_replaces_is_run_from_the_next_step(name, part, library):
    """``on_token`` replacing every block's MLP (or first norm) after the fourth token: the eager unchecked steps, whose
    flat step was made from the model's parts, give the checked steps' tokens (they ran the old parts: the replacement
    was ignored)."""
    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(4))
    change = functools.partial(_replaced, part=part)
    want = _changed_mid_run(name, prompt, change, checked=True)
    assert want != _changed_mid_run(name, prompt, None, checked=True)  # the new parts change the tokens
    assert _changed_mid_run(name, prompt, change, checked=False) == want


def _changed_mid_run(name: str, prompt: torch.Tensor, change, *, checked: bool, at: int = 4, new: int = 12, **kw) -> list[int]:
    """The new tokens of ``generate`` on MODELS[name] (``_varied``) whose ``on_token`` calls ``change(model)`` after the
    ``at``-th token (None: nothing changes); with ``checked``, a hook makes every step a checked forward."""
    model, count = _varied(MODELS[name]()), [0]
    if checked:
        model.register_forward_hook(lambda *args: None)  # every step a checked forward

    def on_token(token):
        count[0] += 1
        if count[0] == at and change is not None:
            change(model)

    return model.generate(prompt, max_new_tokens=new, on_token=on_token, **kw)[0, prompt.shape[1]:].tolist()


def test_a_walk_tells_modules_replaced_added_or_moved_once(library):
    """``Walk``: (trusts, changed) where changed is True at the first call and after a module was replaced, added, removed
    or moved to another place in the tree, False while the same modules stand in the same order."""
    from headwise.models.generate import Walk

    model = gpt2()
    walk = Walk(model)
    assert (walk.native is not None) == library
    assert walk() == (True, True) and walk() == (True, False)
    block = model.transformer.h[1]
    changes = {
        "replaced": lambda: setattr(block, "mlp", type(block.mlp)(model.config).eval()),
        "added": lambda: block.add_module("extra", nn.Identity().eval()),
        "removed": lambda: delattr(block, "extra"),
        "moved": lambda: swap(model.transformer.h),
    }

    def swap(blocks: nn.ModuleList) -> None:
        blocks[0], blocks[1] = blocks[1], blocks[0]

    for name, change in changes.items():
        change()
        assert walk() == (True, True), name
        assert walk() == (True, False), name
    block.mlp.train()
    assert walk()[0] is False
    block.mlp.eval()
    assert walk()[0] is True


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("term", ["window", "softcap"])
@torch.no_grad()
def test_an_attention_term_on_token_sets_is_computed_from_the_next_step(name, term, library):
    """``on_token`` setting every layer's window (or softcap) after the fourth token: the unchecked steps give the
    checked steps' tokens (the kept step decided each layer's attention under the old terms)."""
    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(5))

    def change(model):
        for attn in model.attention_layers():
            setattr(attn, term, 3 if term == "window" else 0.5)

    want = _changed_mid_run(name, prompt, change, checked=True)
    assert want != _changed_mid_run(name, prompt, None, checked=True)  # the new term changes the tokens
    assert _changed_mid_run(name, prompt, change, checked=False) == want


def test_a_walk_tells_an_attribute_set_to_another_value_once(library):
    """``Walk``: an attribute set to another plain value (a window, a softcap, an eps) is a change, told once; set
    again to an equal value (another float object) it is none."""
    from headwise.models.generate import Walk

    model = gpt2()
    walk = Walk(model)
    assert walk() == (True, True) and walk() == (True, False)
    attn, norm = model.transformer.h[1].attn, model.transformer.h[0].ln_1
    for change in (lambda: setattr(attn, "window", 3), lambda: setattr(attn, "softcap", 30.0), lambda: setattr(norm, "eps", 1e-3),
                   lambda: setattr(attn, "window", None)):
        change()
        assert walk() == (True, True)
        assert walk() == (True, False)
    attn.softcap = float("30.0")  # an equal value in another object
    assert walk() == (True, False)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("cache_dtype", [None, torch.bfloat16])
@torch.no_grad()
def test_a_model_on_token_moves_to_another_dtype_is_checked_from_the_next_step(name, cache_dtype):
    """``on_token`` moving the float32 model to bfloat16 after the third token: the unchecked steps do what the checked
    ones do, refuse float32 caches by name before the next step (they ran the bfloat16 layers over them, in mixed
    precision), or, over bfloat16 caches, give the checked steps' tokens."""
    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(6))

    def run(checked):
        return _changed_mid_run(name, prompt, lambda model: model.to(torch.bfloat16), checked=checked, at=3, new=8, cache_dtype=cache_dtype)

    if cache_dtype is None:
        for checked in (True, False):
            with pytest.raises(TypeError, match=r"cache\[0\] \(layer 0\): the cache is torch.float32, but the keys and values are torch.bfloat16"):
                run(checked)
    else:
        assert run(False) == run(True)


@pytest.mark.parametrize("window", [2, 6, None])
@torch.no_grad()
def test_a_window_on_token_sets_against_a_ring_cache_is_refused_as_the_checked_step_refuses_it(window, library):
    """``on_token`` setting the sliding layer's window to another than its ring cache's (4 slots) after the third token:
    the unchecked steps refuse it before the next step with the checked forward's error (they attended over the ring
    under the new window), and leave the tokens streamed so far."""
    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(1))

    def run(checked):
        model, count, seen = _varied(MODELS["mistral-window"]()), [0], []
        if checked:
            model.register_forward_hook(lambda *args: None)  # every step a checked forward

        def on_token(token):
            seen.append(token.item())
            count[0] += 1
            if count[0] == 3:
                model.attention_layers()[0].window = window

        with pytest.raises(ValueError, match=rf"cache\[0\] \(layer 0\): a sliding cache of window=4 needs attention with window=4, got window={window}"):
            model.generate(prompt, max_new_tokens=8, on_token=on_token)
        return seen

    assert run(False) == run(True) and len(run(True)) == 3


def _new_rotary(model):
    from headwise.rope import RotaryEmbedding

    rotary = RotaryEmbedding(model.attention_layers()[0].head_dim, theta=7.0)  # one object the layers share, as the model's
    for attn in model.attention_layers():
        attn.rotary = rotary


def _interleaved(model):  # the model's shared tables changed in place: the layers' rotation is no plain turn of every dim now
    rotary = model.attention_layers()[0].rotary
    rotary.layout = "interleaved"
    rotary._tables.clear()


def _subclassed(module, **methods):
    module.__class__ = type("Sub" + type(module).__name__, (type(module),), methods)


MID_RUN = {  # changes the walk tells (another object, another class) or each layer's terms do (its rotation)
    "rotary tables replaced": _new_rotary,
    "rotary layout set in place": _interleaved,
    "an MLP's class set": lambda m: _subclassed(m.model.layers[0].mlp, forward=lambda self, x: 3 * type(self).__mro__[1].forward(self, x)),
    "an attention's class set": lambda m: _subclassed(m.model.layers[1].self_attn,
                                                      project_out=lambda self, c: -2 * type(self).__mro__[1].project_out(self, c)),
}


@pytest.mark.parametrize("change", MID_RUN)
@torch.no_grad()
def test_rotary_tables_or_a_class_changed_mid_run_are_computed_from_the_next_step(change, library):
    """``on_token`` replacing the rotary tables, changing their layout in place, or setting a module's class (a
    subclass with its own ``forward`` / ``project_out``) after the fourth token: ``generate``'s unchecked steps and a
    ``Batcher``'s (changed between two steps) give the checked steps' tokens (they ran the old tables or class)."""
    from headwise.models import Batcher

    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(7))
    want = _changed_mid_run("llama", prompt, MID_RUN[change], checked=True)
    assert want != _changed_mid_run("llama", prompt, None, checked=True)  # the change changes the tokens
    assert _changed_mid_run("llama", prompt, MID_RUN[change], checked=False) == want

    def batched(hooked: bool) -> list[int]:
        model, got = _varied(MODELS["llama"]()), []
        if hooked:
            model.register_forward_hook(lambda *args: None)  # every step a checked forward
        batcher = Batcher(model, num_blocks=10, block_size=4)
        batcher.submit(prompt[0], 12)
        while batcher.pending:
            got += [t for _, t in batcher.step()]
            if len(got) == 4:
                MID_RUN[change](model)
        return got

    assert batched(False) == batched(True)


@torch.no_grad()
def test_a_new_call_checks_its_layers_against_their_caches_whatever_its_steps():
    """``generate`` checks each layer against its new cache even where its prompt pass and steps run unchecked: a
    sliding layer made non-causal, or a layer's ``context_length`` set below the call's tokens, is refused by name
    before any token."""
    mistral = _varied(MODELS["mistral-window"]())
    mistral.attention_layers()[0].causal = False
    with pytest.raises(ValueError, match=r"window \(sliding-window attention\) needs causal=True, got causal=False"):
        mistral.generate(IDS[:1], max_new_tokens=3)
    model = _varied(MODELS["llama"]())
    model.attention_layers()[1].context_length = 6
    with pytest.raises(ValueError, match=r"prompt \(6 tokens\) \+ max_new_tokens \(3\) exceeds layer 1's context_length=6 by 2"):
        model.generate(IDS[:1], max_new_tokens=3)
    assert model.generate(IDS[:1], max_new_tokens=1).shape == (1, 7)


@pytest.mark.parametrize("checked", [True, False])
@torch.no_grad()
def test_two_blocks_swapped_mid_run_are_refused_as_the_checked_steps_refuse_them(checked, library):
    """``on_token`` swapping the first two blocks: each layer would write the other's cache. The unchecked steps (whose
    prompt pass bound no cache to its layer) refuse it as the checked ones do, naming the cache's owner."""
    def swap(model):
        layers = model.model.layers
        layers[0], layers[1] = layers[1], layers[0]

    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match=r"this KVCache belongs to LlamaAttention at .*, not to LlamaAttention at .*: give every attention layer a cache of its own"):
        _changed_mid_run("llama", prompt, swap, checked=checked)
