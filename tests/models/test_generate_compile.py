"""``generate(..., compile=True)``: the decode steps under ``torch.compile`` give the eager steps'
tokens, one graph serves every step, prompt length and batch size > 1, and bad values are refused."""

import pytest
import torch
from torch._dynamo.utils import counters

from headwise import GPT2Config
from headwise.models import GPT2LMHeadModel, LlamaForCausalLM
from headwise.models.llama_config import LlamaConfig
from headwise.quantize import int8_weights


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
    ``step_logits``' cache, which Dynamo bounds (``torch._dynamo.config.recompile_limit``)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


MODELS = {
    "gpt2": gpt2,
    "llama": llama,
    "mistral-window": lambda: llama(windows=(4, None)),  # layer 0 on a ring cache of 4 slots
    "llama-int8": lambda: int8_weights(llama()),
}
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])  # (B, T): row 1 left-padded
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


@pytest.mark.parametrize("name", MODELS)
def test_compiled_steps_give_the_eager_tokens(name):
    model = MODELS[name]()
    for ids, mask in ((IDS[:1], None), (IDS, MASK)):
        want = model.generate(ids, attention_mask=mask, max_new_tokens=16)  # (B, T + 16)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=16, compile=True)
        assert torch.equal(got, want)


def test_bf16_compiled_step_logits_stay_within_bf16_rounding_of_eager():
    model = llama().to(torch.bfloat16)
    eager, compiled = (model.new_caches(2, 6 + 8) for _ in range(2))
    first = model.next_logits(IDS, None, None, eager)  # (B, vocab)
    model.next_logits(IDS, None, None, compiled)
    step = torch.compile(model.step_logits, fullgraph=True, dynamic=True)
    token = first.argmax(-1)[:, None]  # (B, 1)
    with torch.no_grad():
        for _ in range(8):
            want, got = model.step_logits(token, None, eager).float(), step(token, None, compiled).float()  # (B, vocab)
            assert (got - want).abs().max() <= 0.02 * want.abs().max()
            token = want.argmax(-1)[:, None]  # teacher-forced: both continue from the eager token


def test_one_graph_serves_every_step_prompt_length_and_batch():
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


def test_a_hooked_model_compiles_its_checked_step():
    model = gpt2()
    seen = []
    model.transformer.h[0].register_forward_hook(lambda module, args, out: seen.append(out.shape[1]))
    want = model.generate(IDS, attention_mask=MASK, max_new_tokens=6)
    del seen[:]
    assert torch.equal(model.generate(IDS, attention_mask=MASK, max_new_tokens=6, compile=True), want)
    assert seen[0] == 6 and len(seen) == 6  # the hook saw the prompt and every compiled step


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_compile_must_be_a_bool(bad):
    with pytest.raises(TypeError, match=r"compile must be True or False, got"):
        gpt2().generate(IDS[:1], max_new_tokens=2, compile=bad)
