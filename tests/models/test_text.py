"""generate_text: a real tokenizer (a byte-level BPE trained here on the Zen of Python) around a tiny
random GPT-2's generate. The text is checked against the model's own token ids, decoded by the tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from headwise import GPT2Config
from headwise.models import GPT2LMHeadModel, generate_text

pytest.importorskip("tokenizers", reason="the [models] extra brings tokenizers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "generate_text.py"


def _example():
    spec = importlib.util.spec_from_file_location("generate_text_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer():
    example = _example()
    return example.train_tokenizer(example.zen(), vocab_size=300)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=64, n_embd=32, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # GPT-2's initialisation of the tied embedding: with nn.Embedding's N(0, 1) one logit takes all
        model.transformer.wte.weight.normal_(std=0.02)
    return model


@pytest.mark.parametrize("text", ["Beautiful is better than ugly.", "naïve café ☕ 東京", "  spaces\tand\nlines  ", "Zzyzx qwfp"])
def test_text_round_trips_through_the_tokenizer(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert ids and tokenizer.decode(ids) == text  # byte level: any text, nothing unknown


def test_the_continuation_is_the_models_greedy_tokens_decoded(model, tokenizer):
    prompt = "Errors should never"
    ids = tokenizer.encode(prompt).ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=10)  # (1, T + 10)
    assert out.shape == (1, len(ids) + 10) and out[0, : len(ids)].tolist() == ids
    text = generate_text(model, tokenizer, prompt, max_new_tokens=10)
    assert isinstance(text, str) and prompt + text == tokenizer.decode(out[0].tolist())
    assert generate_text(model, tokenizer, prompt, max_new_tokens=10) == text  # greedy: the same every time


def test_sampling_follows_the_generator(model, tokenizer):
    def sample(seed: int) -> str:
        return generate_text(model, tokenizer, "Now is", max_new_tokens=12, temperature=1.0, generator=torch.Generator().manual_seed(seed))

    assert sample(1) == sample(1)
    assert len({sample(s) for s in range(4)}) > 1


def test_a_batch_of_prompts_continues_each_as_alone(model, tokenizer):
    prompts = ["Special cases", "Flat is better than nested. Sparse is", "If"]
    lengths = {len(tokenizer.encode(p).ids) for p in prompts}
    assert len(lengths) == 3  # different lengths: the batch is padded on the left
    batch = generate_text(model, tokenizer, prompts, max_new_tokens=6)
    assert batch == [generate_text(model, tokenizer, p, max_new_tokens=6) for p in prompts]


def test_eos_token_ends_the_continuation(model, tokenizer):
    prompt = "Readability counts."
    ids = tokenizer.encode(prompt).ids
    sampled = {"temperature": 1.0, "max_new_tokens": 12}  # the same draws twice
    new = model.generate(torch.tensor([ids]), generator=torch.Generator().manual_seed(0), **sampled)[0, len(ids):].tolist()
    k = next(i for i in range(1, len(new)) if new[i] not in new[:i])  # the first token not seen before it
    text = generate_text(model, tokenizer, prompt, eos_token=tokenizer.id_to_token(new[k]), generator=torch.Generator().manual_seed(0), **sampled)
    assert prompt + text == tokenizer.decode(ids + new[:k])


def test_bad_arguments_say_what_was_expected(model, tokenizer):
    with pytest.raises(ValueError, match="prompt must be a non-empty str or a non-empty list of non-empty str, got ''"):
        generate_text(model, tokenizer, "")
    with pytest.raises(ValueError, match=r"prompt must be .*, got \['a', ''\]"):
        generate_text(model, tokenizer, ["a", ""])
    with pytest.raises(TypeError, match="prompt must be a non-empty str or a non-empty list of non-empty str, got 5"):
        generate_text(model, tokenizer, 5)
    with pytest.raises(TypeError, match=r"prompt must be .*, got \['a', 3\]"):
        generate_text(model, tokenizer, ["a", 3])
    with pytest.raises(TypeError, match=r"tokenizer must have encode\(text\).ids and decode\(ids\), such as tokenizers.Tokenizer, got str"):
        generate_text(model, "gpt2", "hello")
    with pytest.raises(TypeError, match=r"model must be a causal language model of headwise.models \(with generate\), got Linear"):
        generate_text(torch.nn.Linear(2, 2), tokenizer, "hello")
    with pytest.raises(ValueError, match="eos_token '<nope>' is not a token of this tokenizer"):
        generate_text(model, tokenizer, "hello", eos_token="<nope>")
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_text(model, tokenizer, "hello", max_new_tokens=0)


def test_a_tokenizer_too_big_for_the_model_is_refused(tokenizer):
    small = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match=r"the tokenizer gives id \d+ for \['Beautiful is better'\], but the model's vocab_size is 256: are they a pair\?"):
        generate_text(small, tokenizer, "Beautiful is better")
