"""``generate(..., compile=True)``: the compiled decode step gives the eager step's logits, one graph serves
every step, prompt length and batch size > 1, a hooked model compiles its checked step, a CPU model's frozen
step is compiled anew when a weight changes, bad values are refused.

Logits are compared teacher-forced (both steps fed the eager step's greedy token, so a near-tie cannot
send them down different continuations) against a float64 copy of the model: the compiled step may be
at most twice as far from it as the eager step is. Dynamo's graphs are run by ``aot_eager`` (the graph
inductor would get, on eager kernels: seconds, not a cold inductor compile) except in two tests, where
inductor compiles the int8 model's step (its opaque int8 op inside inductor's code) and GPT-2's step with its
weights frozen, before and after a weight changes.
"""

import copy
import gc
import warnings
from functools import partial

import pytest
import torch
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

from headwise import GPT2Config
from headwise.models import GPT2LMHeadModel, LlamaForCausalLM
from headwise.models.generate import decode_step, positions
from headwise.models.llama_config import LlamaConfig
from headwise.quantize import Int8Linear, int8_weights

pytestmark = pytest.mark.slow  # left out by make test-fast (pyproject's markers)


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4)).eval()


def llama(**kw):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, **kw)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with an empty compile cache: every architecture, dtype and batch kind adds a graph to
    the decode step's cache, which Dynamo bounds (``torch._dynamo.config.recompile_limit``)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def aot_eager(monkeypatch):
    """``torch.compile`` (as ``generate`` calls it) with the ``aot_eager`` backend (inductor's options left out, Dynamo's
    ``guard_filter_fn`` kept)."""
    compile = torch.compile

    def aot(*args, options=None, **kwargs):
        kept = {k: v for k, v in (options or {}).items() if k == "guard_filter_fn"}
        return compile(*args, **{**kwargs, "backend": "aot_eager", "options": kept or None})

    monkeypatch.setattr(torch, "compile", aot)


MODELS = {
    "gpt2": gpt2,
    "llama": llama,
    "mistral-window": lambda: llama(windows=(4, None)),  # layer 0 on a ring cache of 4 slots
    "llama-int8": lambda: int8_weights(llama()),
    "llama-bf16": lambda: llama().to(torch.bfloat16),
}
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])  # (B, T): row 1 left-padded
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


def float64_copy(model: nn.Module) -> nn.Module:
    """The model in float64, an int8 layer as the float64 ``nn.Linear`` of its dequantized weight."""
    ref = copy.deepcopy(model)
    for parent in list(ref.modules()):
        for name, child in parent.named_children():
            if isinstance(child, Int8Linear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin.weight.data = child.dequantized(torch.float64)
                if child.bias is not None:
                    lin.bias.data = child.bias.double()
                setattr(parent, name, lin)
    return ref.double()


@torch.no_grad()
def compiled_step_errors(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, steps: int = 8, cache_dtype: torch.dtype | None = None
) -> list[tuple[float, float]]:
    """Per decode step, (eager, compiled) logits' relative error against the float64 copy's, all three fed
    the eager step's greedy token after the same prompt pass, as ``generate`` feeds its steps (the eager and
    compiled steps over caches of ``cache_dtype``)."""
    ref = float64_copy(model)
    b, t = ids.shape
    is_token = None if mask is None else mask.bool()  # (B, T)
    position = None if is_token is None else positions(is_token, b, t, ids.device)  # (B, T)
    runs = {"eager": (model, decode_step(model, False)), "compiled": (model, decode_step(model, True)), "float64": (ref, decode_step(ref, False))}
    caches = {name: m.new_caches(b, t + steps + 1, None if name == "float64" else cache_dtype) for name, (m, _) in runs.items()}  # as generate makes them
    logits = {name: m(ids, is_token, positions=position, cache=caches[name], logits_to_keep=1)[:, 0] for name, (m, _) in runs.items()}
    errors = []
    for _ in range(steps):
        token = logits["eager"].argmax(-1, keepdim=True)  # (B, 1)
        position = None if position is None else position[:, -1:] + 1  # (B, 1)
        logits = {name: step(token, position, caches[name]) for name, (_, step) in runs.items()}  # (B, vocab) each
        want = logits["float64"]
        errors.append(tuple(((logits[name].double() - want).norm() / want.norm()).item() for name in ("eager", "compiled")))
    return errors


def assert_as_close_as_eager(errors: list[tuple[float, float]], dtype: torch.dtype) -> None:
    for step, (eager, compiled) in enumerate(errors):
        assert compiled <= 2 * eager + torch.finfo(dtype).eps, (step, eager, compiled)


@pytest.mark.parametrize("name, padded", [(name, True) for name in MODELS] + [("llama", False)])
def test_compiled_steps_give_the_eager_logits(aot_eager, name, padded):
    """A padded batch (B = 2, position ids) for every model; B = 1, a graph of its own, for Llama here and for
    GPT-2 in the graph count's test."""
    model = MODELS[name]()
    ids, mask = (IDS, MASK) if padded else (IDS[:1], None)
    assert_as_close_as_eager(compiled_step_errors(model, ids, mask), next(model.parameters()).dtype)


@pytest.mark.parametrize("name", ["gpt2", "mistral-window"])
def test_compiled_steps_over_bfloat16_caches_give_the_eager_logits(aot_eager, name):
    assert_as_close_as_eager(compiled_step_errors(MODELS[name](), IDS, MASK, cache_dtype=torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-int8", "llama-bf16"])
def test_compiled_steps_over_8bit_caches_read_the_rows_in_place(monkeypatch, name):
    """The compiled step writes the token's 8-bit rows in torch's ops and hands the C++ kernel the rows as stored: its
    graph's attention takes the int8 buffers, not a float32 copy of them a step; its logits as close as the eager
    step's (whose op writes and reads the rows in place) to the float64 model's over the unquantized keys."""
    graphs = []
    compile = torch.compile

    def capturing(*args, options=None, **kwargs):
        kept = {k: v for k, v in (options or {}).items() if k == "guard_filter_fn"}

        def backend(gm, example_inputs):
            graphs.append(gm)
            return lookup_backend("aot_eager")(gm, example_inputs)

        return compile(*args, **{**kwargs, "backend": backend, "options": kept or None})

    monkeypatch.setattr(torch, "compile", capturing)
    errors = compiled_step_errors(MODELS[name](), IDS, MASK, cache_dtype=torch.int8)
    calls = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and "decode_attention" in str(n.target)]
    assert calls and all(n.args[1].meta["example_value"].dtype == torch.int8 for n in calls)  # the keys' rows as stored
    for eager, compiled in errors:  # both over the same 8-bit rows: the 8-bit rounding dominates both errors
        assert compiled <= 1.5 * eager + 1e-6, (eager, compiled)


def test_inductor_compiled_int8_steps_give_the_eager_logits():
    """The one cold inductor compile: the int8 model's step (its opaque int8 op in inductor's code), a padded batch."""
    assert_as_close_as_eager(compiled_step_errors(MODELS["llama-int8"](), IDS, MASK), torch.float32)


def test_inductor_frozen_steps_follow_a_weight_change():
    """On the CPU inductor freezes the weights into the graph (its own packed copies): after an in-place write
    to a weight, the next step is compiled anew and gives the changed model's logits, not the old ones."""
    model = gpt2()
    assert_as_close_as_eager(compiled_step_errors(model, IDS, MASK), torch.float32)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(-3.0)  # in place: the same tensor, a new _version
        model.transformer.wte.weight[:, :8].zero_()  # the tied LM head too
    assert_as_close_as_eager(compiled_step_errors(model, IDS, MASK), torch.float32)


def test_the_compiled_step_is_kept_until_a_weight_or_buffer_changes():
    model = gpt2()
    step = decode_step(model, True)  # torch.compile is lazy: nothing compiles here
    assert decode_step(model, True) is step
    assert decode_step(model, True, check=True) is not step  # the checked step is another graph
    model.generate(IDS[:1], max_new_tokens=3)  # an eager generate packs and stacks weights: it writes none
    assert decode_step(model, True) is step
    with torch.no_grad():
        model.transformer.ln_f.bias.add_(1.0)
    changed = decode_step(model, True)
    assert changed is not step and decode_step(model, True) is changed
    model.load_state_dict(gpt2().state_dict())  # copies in place: new versions
    assert decode_step(model, True) is not changed


def test_config_per_thread_says_whether_another_thread_sees_a_setting():
    """``config_per_thread`` against what inductor does: a setting made in one thread, read in another."""
    import threading

    import torch._inductor.config as inductor

    from headwise.models.compiled_step import config_per_thread

    made, read, seen = threading.Event(), threading.Event(), []

    def setter():
        before = inductor.freezing
        inductor.freezing = not before
        made.set()
        read.wait(timeout=10)
        inductor.freezing = before
        seen.append(before)

    t = threading.Thread(target=setter)
    t.start()
    made.wait(timeout=10)
    here = inductor.freezing
    read.set()
    t.join(timeout=10)
    assert (here == seen[0]) == config_per_thread()  # unchanged here: each thread has its own


@pytest.mark.parametrize("turns", ["as this torch needs", "one lock"])
def test_a_frozen_step_freezes_its_own_threads_compiles_only(turns, monkeypatch):
    """Inductor's ``freezing`` and ``projection.frozen()`` are on while a frozen step runs, for its thread's compiles
    alone: a second thread's unfrozen step meanwhile sees both off (its weights may change), and its frozen step,
    still running after the first one ended, sees both on; afterwards both are off everywhere. Where inductor's
    settings are one value for the process (torch before 2.12), the steps take turns (``TURNS`` is a lock): the
    second thread's steps run after the first's. "one lock" runs the turns on any torch."""
    import contextlib
    import threading

    import torch._inductor.config as inductor

    from headwise.linear import projection
    from headwise.models import compiled_step

    if turns == "one lock":
        monkeypatch.setattr(compiled_step, "TURNS", threading.RLock())
    taking_turns = not isinstance(compiled_step.TURNS, contextlib.nullcontext)
    flags = lambda: (inductor.freezing, projection.frozen())  # noqa: E731
    first_running, second_ran, first_done, seen, order = threading.Event(), threading.Event(), threading.Event(), {}, []

    def first_graph(*args):  # stands in for the compiled graph: records the flags its tracing would see
        seen["first"] = flags()
        first_running.set()
        # beside it, the second thread's unfrozen step runs; taking turns, it waits for this one (the wait times out)
        second_ran.wait(timeout=0.5 if taking_turns else 10)
        order.append("first")
        return torch.zeros(1)

    def unfrozen_graph(*args):
        seen["second, unfrozen"] = flags()
        order.append("second")
        second_ran.set()
        return torch.zeros(1)

    def frozen_graph(*args):
        first_done.wait(timeout=10)
        seen["second, frozen, after the first ended"] = flags()
        return torch.zeros(1)

    steps = [compiled_step.CompiledStep(partial(lambda model, *args: None, gpt2()), freeze=f) for f in (True, False, True)]
    for step, graph in zip(steps, (first_graph, unfrozen_graph, frozen_graph), strict=True):
        step.compiled = graph

    def first():
        steps[0](None)
        first_done.set()

    def second():
        first_running.wait(timeout=10)
        steps[1](None)
        steps[2](None)

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert seen == {"first": (True, True), "second, unfrozen": (False, False), "second, frozen, after the first ended": (True, True)}
    assert order == (["first", "second"] if taking_turns else ["second", "first"])
    assert flags() == (False, False)


def test_a_model_made_in_inference_mode_compiles_unfrozen(aot_eager):
    """Inference tensors have no version counter, so a frozen graph could not see them change: such a model's
    step is compiled with its projections as opaque ops, says so once with a warning (how to get the frozen step),
    and gives the eager step's logits."""
    with torch.inference_mode():
        model = gpt2()
    with pytest.warns(UserWarning, match=r"inference tensors .* cannot freeze them .* outside inference mode") as seen:
        assert decode_step(model, True).freeze is False
    assert len(seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once a model: the step kept on it is reused without a word
        assert decode_step(model, True).freeze is False and decode_step(gpt2(), True).freeze is True
        with torch.inference_mode():
            assert_as_close_as_eager(compiled_step_errors(model, IDS, MASK, steps=3), torch.float32)


def test_a_frozen_step_checks_the_modules_once_a_call_not_every_step(aot_eager):
    """A frozen step's graph keeps Dynamo's checks of its arguments (the ids, the caches) but none of the model's
    modules: ``compiled_step`` compares the modules' ``structure`` once a call instead, and compiles the step anew
    when it changed (then with Dynamo's checks of the modules, once for all), so a changed attribute gives the
    changed model's logits, not the old graph's."""
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    model = gpt2()
    assert_as_close_as_eager(compiled_step_errors(model, IDS, MASK, steps=2), torch.float32)
    first = decode_step(model, True)
    guards = str(entries(first.func.__code__)[0].guard_manager)
    assert "L['caches']" in guards and "L['ids']" in guards
    on_model = [line for line in guards.splitlines() if "L['model']" in line]
    assert on_model and all("LAMBDA_GUARD" in line and "==" in line for line in on_model)  # only the floats it specialised (eps, p)
    assert first.known
    model.transformer.h[0].attn.softcap = 1.0  # read by the traced attention: a step compiled before never saw it
    changed = compiled_step_errors(model, IDS, MASK, steps=2)
    second = decode_step(model, True)
    assert second is not first and not second.known  # compiled anew, with Dynamo's checks of the modules from now on
    assert "L['model']._modules" in str(entries(second.func.__code__)[0].guard_manager)
    assert_as_close_as_eager(changed, torch.float32)
    model.transformer.h[0].attn.softcap = None  # Dynamo's own checks see it: no step compiled anew for it
    assert_as_close_as_eager(compiled_step_errors(model, IDS, MASK, steps=2), torch.float32)
    assert decode_step(model, True) is second


def test_a_checked_step_keeps_dynamos_checks_of_the_modules(aot_eager):
    """A hooked model's step runs checked, its hooks traced: what a hook reads (its closure, its object) is only seen
    by Dynamo's own checks, so they stay."""
    model = gpt2()
    model.transformer.h[0].register_forward_hook(lambda module, args, out: out)
    assert decode_step(model, True).known is False and decode_step(gpt2(), True).known is True


def test_a_step_compiled_anew_drops_the_old_graphs(aot_eager):
    """Each compiled step runs a code object of its own, on which Dynamo keeps its graphs (and, compiled by
    inductor, the frozen copies of the weights): when the step is compiled anew, the old code's graphs go."""
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list  # a code object's graphs
    model = gpt2()
    compiled_step_errors(model, IDS, MASK, steps=2)  # compiles the step
    code = decode_step(model, True).func.__code__
    assert code is not decode_step.__globals__["_next_logits"].__code__ and len(entries(code)) == 1
    with torch.no_grad():
        model.transformer.ln_f.weight.mul_(2.0)
    assert_as_close_as_eager(compiled_step_errors(model, IDS, MASK, steps=2), torch.float32)  # compiled anew
    gc.collect()
    assert entries(code) == [] and len(entries(decode_step(model, True).func.__code__)) == 1


def test_each_model_compiles_against_its_own_recompile_limit(aot_eager):
    """Every model's step has graphs of its own (a code object of its own, its weights frozen in): more models
    than Dynamo's recompile limit compile in one process, each once."""
    limit = torch._dynamo.config.recompile_limit
    for seed in range(limit + 2):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=1, n_head=4)).eval()
        graphs = counters["stats"]["unique_graphs"]
        model.generate(IDS[:1], max_new_tokens=3, compile=True)
        assert counters["stats"]["unique_graphs"] == graphs + 1


def test_one_graph_serves_every_step_prompt_length_and_batch(aot_eager):
    model = gpt2()
    graphs = counters["stats"]["unique_graphs"]
    model.generate(IDS[:1], max_new_tokens=5, compile=True)
    after_first = counters["stats"]["unique_graphs"]
    assert after_first == graphs + 1  # B = 1 has its own graph (Dynamo specialises sizes of 1)
    model.generate(torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11]]), max_new_tokens=9, compile=True)  # another prompt length, more steps
    assert counters["stats"]["unique_graphs"] == after_first
    model.generate(IDS, attention_mask=MASK, max_new_tokens=4, compile=True)  # B = 2: the batched graph
    batched = counters["stats"]["unique_graphs"]
    ids, mask = torch.randint(1, 97, (3, 4)), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1]])
    model.generate(ids, attention_mask=mask, max_new_tokens=6, compile=True)  # B = 3, another length: no new graph
    assert counters["stats"]["unique_graphs"] == batched  # (a batch without padding has a graph of its own: no position ids)
    assert_as_close_as_eager(compiled_step_errors(model, IDS[:1], None), torch.float32)  # B = 1 again: its graph's logits
    assert counters["stats"]["unique_graphs"] == batched


def test_one_graph_when_the_first_sizes_equal_the_models_own_or_an_eager_loop_ran_between(aot_eager):
    """head_dim is 8 and n_head 4: a first call whose cache length (3 + 5) or batch (4) equals one of them had Dynamo tie
    the two into one symbol (duck sizing), fixed as a constant, and the next length or batch compiled again; an eager
    generate between two compiled ones left a thread-local attribute behind that the graph's guard had seen absent."""
    model = gpt2()

    def prompts(b, t):  # (B, T) ids, the last row left-padded
        ids, mask = torch.randint(1, 97, (b, t), generator=torch.Generator().manual_seed(b * 100 + t)), torch.ones(b, t, dtype=torch.long)
        mask[-1, : t - 1] = 0
        return ids * mask, mask

    graphs = counters["stats"]["unique_graphs"]
    for b, t, n in [(2, 3, 5), (2, 12, 7), (4, 5, 3), (3, 6, 3)]:
        ids, mask = prompts(b, t)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=n)  # eager, between the compiled calls
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=n, compile=True), want)
    assert counters["stats"]["unique_graphs"] == graphs + 1


def test_a_hooked_model_compiles_its_checked_step(aot_eager):
    model = gpt2()
    rows = torch.zeros((), dtype=torch.long)  # a tensor, not a list: a list's length would be a guard, recompiling every step

    def count(module, args, out):  # returns None: the layer's output stays its own
        rows.add_(out.shape[1])

    model.transformer.h[0].register_forward_hook(count)
    assert_as_close_as_eager(compiled_step_errors(model, IDS, MASK), torch.float32)  # the checked step, hook and all
    graphs = counters["stats"]["unique_graphs"]
    rows.zero_()
    assert model.generate(IDS, attention_mask=MASK, max_new_tokens=6, compile=True).shape == (2, 12)
    assert counters["stats"]["unique_graphs"] == graphs  # generate runs the step compiled above
    assert int(rows) == 6 + 5  # the hook saw the prompt's 6 rows and each of the 5 compiled steps' one


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_compile_must_be_a_bool(bad):
    with pytest.raises(TypeError, match=r"compile must be True or False, got"):
        gpt2().generate(IDS[:1], max_new_tokens=2, compile=bad)


def test_a_model_that_compiled_its_steps_pickles_and_copies_without_them(aot_eager):
    """``torch.save(model)`` and ``pickle`` failed on the kept compiled steps; a copy compiles its own."""
    import copy
    import io
    import pickle

    model = gpt2()
    want = model.generate(IDS[:1], max_new_tokens=4, compile=True)
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert "_compiled_steps" not in vars(copied)
        assert torch.equal(copied.generate(IDS[:1], max_new_tokens=4, compile=True), want)
    torch.save(model, io.BytesIO())
    assert "_compiled_steps" in vars(model)  # the model keeps its own


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@torch.no_grad()
def test_an_attention_term_on_token_sets_reaches_the_compiled_steps(aot_eager, name):
    """``on_token`` setting every layer's window after the third token: the compiled steps (whose graph skips Dynamo's
    checks of the modules, their ``structure`` compared once a step is made) give the checked steps' tokens."""
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])

    def run(compile, hooked=False, change=True):
        model, count = MODELS[name](), [0]
        with torch.no_grad():
            for p in model.parameters():  # weights large enough that the window changes the greedy tokens
                p.normal_(0.0, 0.8)
        if hooked:
            model.register_forward_hook(lambda *args: None)  # every step a checked forward

        def on_token(token):
            count[0] += 1
            if count[0] == 3 and change:
                for attn in model.attention_layers():
                    attn.window = 2

        return model.generate(prompt, max_new_tokens=10, on_token=on_token, compile=compile)[0, 7:].tolist()

    want = run(False, hooked=True)
    assert want != run(False, hooked=True, change=False)  # the window changes the tokens
    assert run(True) == want


def test_a_first_compiled_call_with_on_token_makes_its_step_once(aot_eager, monkeypatch):
    """The compiled step's table, set on the model when its first step is made, is no change ``on_token`` made: the
    step is made once a call and no step runs checked (the walk after ``on_token`` is taken again after the set-up)."""
    from headwise.models import generate as gen

    made, checked = [], []
    real_decode_step, real_next = gen.decode_step, gen._next_logits
    monkeypatch.setattr(gen, "decode_step", lambda *args, **kw: made.append(args) or real_decode_step(*args, **kw))
    monkeypatch.setattr(gen, "_next_logits", lambda model, check, *args: checked.append(check) or real_next(model, check, *args))
    model = gpt2()
    with torch.no_grad():
        want = model.generate(IDS[:1], max_new_tokens=5, compile=True)
        made.clear(), checked.clear()
        assert torch.equal(gpt2().generate(IDS[:1], max_new_tokens=5, compile=True, on_token=lambda t: None), want)
    assert len(made) == 1 and True not in checked
