"""Copies made from weights (stacked Q/K/V, oneDNN's packed layout, a compiled step's frozen constants) follow a write
through ``.data``, which a weight's ``_version`` does not see: the model's numbers are a fresh copy's, bit for bit.

Oracle: ``copy.deepcopy`` of the model after the write (a copy starts with no kept copies of its own).
"""

from __future__ import annotations

import copy

import pytest
import torch

import headwise as hw
from headwise import native
from headwise.linear import weight_cache
from headwise.models import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(hw.GPT2Config(vocab_size=100, n_positions=64, n_embd=256, n_layer=1, n_head=4)).eval()  # 2^17+ weights


WRITES = {
    "mul_": lambda p: p.data.mul_(2),
    "copy_": lambda p: p.data.copy_(torch.randn_like(p)),
    "ema": lambda p: p.data.mul_(0.9).add_(torch.randn_like(p), alpha=0.1),
}
WEIGHTS = {
    "llama q_proj (stacked)": (llama, lambda m: m.model["layers"][0].self_attn.q_proj.weight),
    "llama up_proj (stacked)": (llama, lambda m: m.model["layers"][1].mlp.up_proj.weight),
    "gpt2 c_attn (packed)": (gpt2, lambda m: m.transformer.h[0].attn.c_attn.weight),
    "gpt2 tied head": (gpt2, lambda m: m.transformer.wte.weight),
}


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("weight", WEIGHTS)
def test_a_write_through_data_reaches_every_forward_and_generate(weight, write):
    make, pick = WEIGHTS[weight]
    model = make()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        before = model(ids), model.generate(ids, max_new_tokens=4)  # the kept copies made
        WRITES[write](pick(model))
        fresh = copy.deepcopy(model)
        assert torch.equal(model(ids), fresh(ids))
        assert not torch.equal(model(ids), before[0])
        assert torch.equal(model.generate(ids, max_new_tokens=4), fresh.generate(ids, max_new_tokens=4))


def test_a_standalone_layer_follows_a_write_through_data():
    torch.manual_seed(0)
    mha = hw.MultiHeadAttention(512, 512, 64, 0.0, num_heads=8).eval()  # 2^18 weights a projection
    x = torch.randn(1, 1, 512)
    with torch.no_grad():
        mha(x)
        mha.out_proj.weight.data.mul_(2)
        assert torch.equal(mha(x), copy.deepcopy(mha)(x))


BOOK_CLASSES = {
    "CausalAttention": (lambda: hw.CausalAttention(512, 512, 64, 0.0), lambda m: m.W_query.weight),
    "MultiHeadAttentionWrapper": (lambda: hw.MultiHeadAttentionWrapper(512, 256, 64, 0.0, num_heads=2), lambda m: m.heads[1].W_value.weight),
}


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("book", BOOK_CLASSES)
def test_the_book_classes_follow_a_write_through_data(book, rows):
    torch.manual_seed(0)
    make, pick = BOOK_CLASSES[book]
    module = make().eval()  # 2^17+ weights a projection
    x = torch.randn(1, rows, 512)
    with torch.no_grad():
        module(x)
        pick(module).data.mul_(2)
        assert torch.equal(module(x), copy.deepcopy(module)(x))


def test_a_non_contiguous_weight_is_watched_and_followed():
    """A transposed weight (a view, no contiguous bytes to read in place) is sampled by its elements: the next forward's
    look at the watched weights ran that sample through a name the loop had rebound (a TypeError every call)."""
    torch.manual_seed(0)
    mha = hw.MultiHeadAttention(512, 512, 64, 0.0, num_heads=8).eval()
    mha.out_proj.weight = torch.nn.Parameter(torch.randn(512, 512).t())  # (512, 512), column-major
    x = torch.randn(1, 1, 512)
    with torch.no_grad():
        mha(x), mha(x)
        mha.out_proj.weight.data.mul_(2)
        assert torch.equal(mha(x), copy.deepcopy(mha)(x))


def test_an_unchanged_weight_keeps_its_copies():
    model = llama()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        model(ids)
        q = model.model["layers"][0].self_attn.q_proj.weight
        q.data[0, 0] = torch.nan  # a NaN compares equal by its bits: no copy made again every call
        model(ids)
        epochs = dict(weight_cache.EPOCH)
        model(ids), model.generate(ids, max_new_tokens=2)
        assert epochs == weight_cache.EPOCH


def test_the_compiled_step_follows_a_write_through_data():
    model = llama()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, compile=True)
        for p in model.parameters():
            p.data.copy_(torch.randn_like(p) * 0.5)
        want = copy.deepcopy(model).generate(ids, max_new_tokens=3)
        assert torch.equal(model.generate(ids, max_new_tokens=3, compile=True), want)


def test_a_batcher_follows_a_write_through_data_between_steps():
    from headwise.models import Batcher

    model = llama()
    prompt = torch.tensor([5, 6, 7])
    with torch.no_grad():
        batcher = Batcher(model, num_blocks=8, block_size=4)
        batcher.submit(prompt, 4)
        (_, first), = batcher.step()  # the prompt: the stacked copies made
        up = model.model["layers"][-1].mlp.up_proj.weight  # the last layer's MLP: no cached key or value depends on it
        up.data.copy_(torch.randn_like(up) * 3)
        rest = [token for _ in range(3) for _, token in batcher.step()]
        assert rest == _continued(copy.deepcopy(model), [*prompt.tolist(), first], 3)
        up.data.copy_(torch.randn_like(up) * 3)  # and the test can tell: the old weights' tokens were others
        assert rest != _continued(copy.deepcopy(model), [*prompt.tolist(), first], 3)


def _continued(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ids, one full forward each (no cache)."""
    out = []
    for _ in range(n):
        token = int(model(torch.tensor([ids]))[0, -1].argmax())
        ids, out = [*ids, token], [*out, token]
    return out


def test_a_tensor_freed_while_verify_reads_the_samples_does_not_stop_it(monkeypatch):
    """A collection started by ``verify``'s own copy of the watched entries can free a watched tensor, whose finalizer
    drops its entry mid-copy ("dictionary changed size during iteration", seen once in a forward): the copy is taken
    again. Here the entries' view drops one the first time it is read, as such a finalizer would; a write through
    ``.data`` to a live tensor is still seen. (Python's table: the samples it keeps where the library is not loaded.)"""
    monkeypatch.setattr(weight_cache.native, "loaded", lambda: False)
    kept, dropped = torch.zeros(16), torch.zeros(16)
    weight_cache.watch([kept, dropped])

    class Dropping(dict):
        reads = 0

        def items(self):
            Dropping.reads += 1
            if Dropping.reads == 1:
                def dropping():
                    for i, item in enumerate(dict.items(self)):
                        if i == 0:
                            self.pop(id(dropped))  # as _forget would, from a finalizer
                        yield item
                return dropping()
            return dict.items(self)

    monkeypatch.setattr(weight_cache, "WATCHED", Dropping(weight_cache.WATCHED))
    before = weight_cache.EPOCH.get(id(kept), 0)
    kept.data[0] = 1.0  # a write autograd's version does not see
    weight_cache.verify()
    assert Dropping.reads == 2 and weight_cache.EPOCH.get(id(kept), 0) != before


def test_another_tensor_at_the_same_address_has_another_state():
    """``state`` tells two tensors apart even where everything else it reads is the same (address, version, shape,
    strides, dtype): the second shares the first's storage here, as a new weight can land at a freed one's address."""
    a = torch.nn.Parameter(torch.randn(4, 6))
    b = torch.nn.Parameter(torch.empty(0).set_(a.untyped_storage(), 0, (4, 6), (6, 1)))
    with torch.no_grad():
        while a._version < b._version:
            a.add_(0.0)  # (a version of b's: in-place writes count)
    assert (a.data_ptr(), a._version, a.shape, a.stride()) == (b.data_ptr(), b._version, b.shape, b.stride())
    assert weight_cache.state([a]) != weight_cache.state([b])
    assert weight_cache.state([a]) == weight_cache.state([a])


@pytest.mark.parametrize("int8", [False, True])
def test_a_weight_replaced_twice_is_seen_where_the_new_one_lands_at_the_old_address(int8):
    """Replacing a weight twice frees the first replacement, and the allocator often puts the second where the original
    lay, with the same version, shape and dtype: the decode steps' kept calls must still read the new weight (each
    time it lands there, the logits equal a fresh copy's)."""
    from headwise.quantize import int8_weights

    torch.manual_seed(0)
    model = GPT2LMHeadModel(hw.GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)).eval()
    model = int8_weights(model) if int8 else model
    ids, reused = torch.tensor([[1, 2, 3]]), 0
    for _ in range(30):
        model.generate(ids, max_new_tokens=2)  # the LM head's decode call kept
        old = model.lm_head.weight.data_ptr() if int8 else model.transformer.wte.weight.data_ptr()
        for _ in range(2):
            if int8:
                model.lm_head.weight = torch.randint(-127, 128, (300, 64), dtype=torch.int8)
            else:
                model.transformer.wte.weight = torch.nn.Parameter(torch.randn(300, 64))
        new = model.lm_head.weight.data_ptr() if int8 else model.transformer.wte.weight.data_ptr()
        if new != old:
            continue
        reused += 1
        fresh = copy.deepcopy(model)
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=4)
        assert torch.equal(got, fresh.generate(ids, max_new_tokens=4))
        caches, fresh_caches = model.new_caches(1, 8), fresh.new_caches(1, 8)
        with torch.no_grad():
            model(ids, cache=caches), fresh(ids, cache=fresh_caches)
            assert torch.equal(model(ids[:, :1], cache=caches), fresh(ids[:, :1], cache=fresh_caches))
    if not reused:
        pytest.skip("the allocator never put the new weight at the old one's address (nothing to tell apart)")


def test_release_drops_every_weak_reference_so_torch_can_swap_the_tensors():
    """``torch.utils.swap_tensors`` (``Module.to`` and ``load_state_dict`` under
    ``torch.__future__.set_swap_module_params_on_conversion(True)``) refuses a tensor that has a weak reference, which
    what headwise keeps holds on every weight it read: ``headwise.linear.release(module)`` drops them; the copies are
    made again at the next call, from the converted weights."""
    import weakref

    from headwise import GPT2Config
    from headwise.linear import release

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4)).eval()
    mha = hw.MultiHeadAttention(64, 64, 8, 0.0, 4).eval()
    ids, x = torch.randint(0, 97, (1, 5)), torch.randn(1, 1, 64)
    tokens = model.generate(ids, max_new_tokens=5)
    with torch.no_grad():
        mha(x)
    assert any(weakref.getweakrefcount(p) for p in (*model.parameters(), *mha.parameters()))
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for module in (model, mha):
            release(module)
            assert not any(weakref.getweakrefcount(t) for t in (*module.parameters(), *module.buffers()))
            module.double()
        with torch.no_grad():
            before = mha(x.double())
            mha.out_proj.weight.mul_(2)  # written after the conversion: the next call reads it
            wide = mha(x.double())
            fresh = copy.deepcopy(mha)(x.double())  # (a copy starts with nothing kept)
        assert torch.equal(wide, fresh) and not torch.equal(wide, before)
        assert torch.equal(model.generate(ids, max_new_tokens=5), tokens)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    with pytest.raises(TypeError, match=r"module must be a torch.nn.Module, got Tensor"):
        release(torch.zeros(1))


def test_a_write_while_a_call_is_prepared_is_seen_by_the_next_call(monkeypatch):
    """A write (another thread's, under ``torch.no_grad()``) landing after a decode call's stacked copy was read but
    before the call was kept: the kept call holds the state from before the write, so the next call makes it again
    (it held the state from after the write and used the old copy for good)."""
    from torch import nn

    from headwise.linear import project_many, projection

    torch.manual_seed(0)
    layers = [nn.Linear(64, 48) for _ in range(3)]
    x = torch.randn(1, 64)
    stacked, wrote = projection._stacked, []

    def stacked_then_written(weights, biases):
        out = stacked(weights, biases)
        if not wrote:
            with torch.no_grad():
                layers[0].weight.mul_(2)  # lands after the copy was read
            wrote.append(True)
        return out

    monkeypatch.setattr(projection, "_stacked", stacked_then_written)
    with torch.no_grad():
        project_many(layers, x)  # prepares the kept call (the write lands inside)
        got = project_many(layers, x)
        want = [nn.functional.linear(x, layer.weight, layer.bias) for layer in layers]
    assert wrote
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_decode_call_after_the_weights_became_inference_tensors_computes_with_them():
    # a kept decode projection compared its state with the new weights': inference tensors have no version to read
    import headwise as hw

    torch.manual_seed(0)
    x = torch.randn(1, 1, 32)
    with torch.inference_mode():
        source = hw.MultiHeadAttention(32, 32, 64, 0.0, 4, True).eval()
        state, want = source.state_dict(), source(x)
    m = hw.MultiHeadAttention(32, 32, 64, 0.0, 4, True).eval()
    with torch.no_grad():
        m(x)  # keeps a prepared projection for one row
    with torch.inference_mode():
        m.load_state_dict(state, assign=True)
        torch.testing.assert_close(m(x), want, rtol=0, atol=0)
        m.W_query.weight.mul_(0.5)  # a write no version counter sees: the next call reads it
        source.W_query.weight.mul_(0.5)
        torch.testing.assert_close(m(x), source(x), rtol=0, atol=0)


def _library() -> None:
    if not native.built():
        pytest.skip("headwise's C++ library is not built here")


def test_the_library_keeps_the_samples_of_contiguous_cpu_tensors():
    """Where the library is loaded a contiguous CPU tensor's ends are kept there and compared in one call: a write
    through ``.data`` at either end moves the tensor's epoch, nothing else does; a non-contiguous one stays Python's."""
    _library()
    a, b, strided, empty = torch.randn(64, 32), torch.randn(7), torch.randn(16, 8).t(), torch.empty(0, 8)
    weight_cache.watch([a, b, strided, empty])
    assert {id(a), id(b)} <= set(weight_cache.NATIVE) and {id(strided), id(empty)} <= set(weight_cache.WATCHED)
    assert not {id(a), id(b)} & set(weight_cache.WATCHED)
    epochs = lambda: [weight_cache.EPOCH.get(id(t), 0) for t in (a, b, strided)]  # noqa: E731
    start = epochs()
    weight_cache.verify()
    assert epochs() == start, "nothing written: no epoch moved"
    a.data[-1, -1] += 1.0  # the last byte's line
    weight_cache.verify()
    moved = epochs()
    assert moved[0] != start[0] and moved[1:] == start[1:]
    weight_cache.verify()
    assert epochs() == moved, "a change is told once"
    b.data[0] = 42.0
    strided.data[0, 0] = 42.0
    weight_cache.verify()
    last = epochs()
    assert last[0] == moved[0] and last[1] != moved[1] and last[2] != moved[2]


def test_a_tensor_the_library_watches_leaves_it_when_it_dies_or_moves():
    """A watched tensor that dies leaves the library's table (its entry dropped with it, by its finalizer or by
    ``release``); one whose storage was replaced is passed by (``state`` sees the new pointer) until watched again."""
    _library()
    gone, released, moved = torch.randn(1000), torch.randn(1000), torch.randn(1000)
    weight_cache.watch([gone, released, moved])
    keys = [id(gone), id(released), id(moved)]
    assert set(keys) <= set(weight_cache.NATIVE)
    del gone
    weight_cache.release([released])
    assert keys[0] not in weight_cache.NATIVE and keys[1] not in weight_cache.NATIVE
    before, epoch = weight_cache.state([moved]), weight_cache.EPOCH.get(keys[2], 0)
    moved.data = torch.randn(1000)  # its old storage freed: never read again
    weight_cache.verify()
    assert weight_cache.EPOCH.get(keys[2], 0) == epoch and weight_cache.state([moved]) != before
    weight_cache.watch([moved])  # as the copy made again watches it
    assert weight_cache.NATIVE[keys[2]] == moved.data_ptr()
    moved.data[0] = 1e3
    weight_cache.verify()
    assert weight_cache.EPOCH.get(keys[2], 0) != epoch


def _seen_with(library: bool, monkeypatch) -> None:
    """``Seen`` made with the C++ library's call, or with Python's ``state`` (the library taken away)."""
    if library:
        _library()
    else:
        monkeypatch.setattr(weight_cache.native, "loaded", lambda: False)


@pytest.mark.parametrize("library", [True, False])
def test_seen_tells_every_change_to_the_modules_tensors_once(library, monkeypatch):
    """``Seen.same()``: False at the first call and after each change to a tensor of the modules' own parameters and
    buffers (written in place, replaced, set to None, added, resized or moved through ``.data``, converted, a ``.data``
    write ``verify`` saw), True while nothing changed."""
    _seen_with(library, monkeypatch)
    lin, norm = torch.nn.Linear(8, 4), torch.nn.LayerNorm(8)
    norm.register_buffer("extra", torch.zeros(3))
    seen = weight_cache.Seen((lin, norm))
    assert (seen.native is not None) == library
    assert not seen.same() and seen.same() and seen.same()

    def data_write() -> None:
        weight_cache.watch([lin.weight])
        lin.weight.data.mul_(2)
        weight_cache.verify()

    changes = {
        "written in place": lambda: lin.weight.add_(1.0),
        "a buffer written": lambda: norm.extra.add_(1.0),
        "replaced": lambda: setattr(lin, "weight", torch.nn.Parameter(lin.weight.detach().clone())),
        "set to None": lambda: setattr(lin, "bias", None),
        "a buffer added": lambda: norm.register_buffer("more", torch.ones(2)),
        "resized through .data": lambda: setattr(norm.extra, "data", torch.zeros(4)),
        "strides through .data": lambda: setattr(lin.weight, "data", lin.weight.data.t().contiguous().t()),
        "converted": lambda: norm.to(torch.float64),
        "a .data write verify saw": data_write,
    }
    for name, change in changes.items():
        with torch.no_grad():
            change()
        assert not seen.same(), name
        assert seen.same(), name


@pytest.mark.parametrize("library", [True, False])
def test_seen_tells_a_new_weight_at_the_old_ones_address_and_version_apart(library, monkeypatch):
    """A weight replaced by another tensor with the same storage, address, version, shape and dtype (as a new weight can
    land where a freed one lay) is a change; an inference tensor is never the same (it keeps no version)."""
    _seen_with(library, monkeypatch)
    a = torch.nn.Parameter(torch.randn(4, 6))
    b = torch.nn.Parameter(torch.empty(0).set_(a.untyped_storage(), 0, (4, 6), (6, 1)))
    with torch.no_grad():
        while a._version < b._version:
            a.add_(0.0)
    lin = torch.nn.Linear(6, 4)
    lin.weight = a
    seen = weight_cache.Seen([lin])
    seen.same()
    assert seen.same()
    lin.weight = b
    assert not seen.same() and seen.same()
    with torch.inference_mode():
        lin.register_buffer("inference", torch.zeros(2))
    assert not seen.same() and not seen.same()


def test_seen_keeps_no_tensor_alive():
    """The library's table holds weak references: a weight replaced after ``same()`` is freed with its last owner."""
    import weakref

    _library()
    lin = torch.nn.Linear(8, 4)
    seen = weight_cache.Seen([lin])
    seen.same()
    old = weakref.ref(lin.weight)
    lin.weight = torch.nn.Parameter(torch.randn(4, 8))
    assert old() is None
    assert not seen.same()
