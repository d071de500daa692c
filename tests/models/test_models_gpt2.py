"""GPT2LMHeadModel: HuggingFace checkpoints in, transformers' logits and greedy tokens out."""

from __future__ import annotations

import helpers
import pytest
import torch
from helpers import ERROR_RATIO, hf_positions
from hf_checkpoints import GPT2_SIZES
from models_reference import gpt2_logits

from headwise.models import GPT2LMHeadModel

V = GPT2_SIZES["vocab_size"]


@pytest.fixture(scope="module")
def model(gpt2_dir) -> GPT2LMHeadModel:
    return GPT2LMHeadModel.from_pretrained(gpt2_dir)


@pytest.fixture(scope="module")
def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return helpers.padded_batch(V)


def test_logits_match_transformers_on_a_padded_batch(model, hf_gpt2, padded_batch):
    ids, mask = padded_batch
    real = mask.bool()
    with torch.no_grad():
        want = hf_gpt2(ids, attention_mask=mask, position_ids=hf_positions(real)).logits
    got = model(ids, attention_mask=mask)
    assert got.shape == (3, 9, V)
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)


def test_logits_match_transformers_without_a_mask(model, hf_gpt2, padded_batch):
    ids = padded_batch[0]
    with torch.no_grad():
        want = hf_gpt2(ids).logits
    torch.testing.assert_close(model(ids), want, atol=1e-4, rtol=0)


def test_logits_against_a_float64_reference(model, gpt2_dir, padded_batch):
    """Flash-attention rule: our float32 error vs float64 within a few times that of a plain float32 implementation."""
    from safetensors.torch import load_file

    ids, mask = padded_batch
    real = mask.bool()
    state = load_file(gpt2_dir / "model.safetensors")
    kw = {"n_head": GPT2_SIZES["n_head"], "eps": 1e-5}
    ref64 = gpt2_logits(state, ids, real, hf_positions(real), **kw)[real]
    ref32 = gpt2_logits(state, ids, real, hf_positions(real), dtype=torch.float32, **kw)[real].double()
    with torch.no_grad():
        ours = model(ids, attention_mask=real)[real].double()
    plain = (ref32 - ref64).abs().max().item()
    assert plain > 0
    assert (ours - ref64).abs().max().item() <= ERROR_RATIO * plain


def test_left_padding_gives_the_unpadded_logits(model):
    ids = torch.randint(2, V, (1, 6), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)  # (1, 10)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded, attention_mask=mask)[:, 4:], model(ids), atol=1e-5, rtol=0)


def test_greedy_generate_equals_transformers(model, hf_gpt2, padded_batch):
    ids, mask = padded_batch[0][:2], padded_batch[1][:2]  # generation pads on the left
    out = hf_gpt2.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(out.scores).topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3  # clear-cut choices: a token-for-token comparison means something
    got = model.generate(ids, attention_mask=mask, max_new_tokens=10)
    assert torch.equal(got, out.sequences)


def test_greedy_generate_with_eos_equals_transformers(model, hf_gpt2, padded_batch):
    ids, mask = padded_batch[0][:2], padded_batch[1][:2]
    free = model.generate(ids, attention_mask=mask, max_new_tokens=8)
    eos = int(free[0, ids.shape[1] + 2])  # row 0 emits it at its third new token
    want = hf_gpt2.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=eos, pad_token_id=eos)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos)
    assert torch.equal(got, want)


def test_on_token_streams_each_steps_tokens_before_the_next_step(model, padded_batch):
    """Each call holds the (B,) tokens that step appended, in order, the first right after the prompt pass (before any
    decode step); with an end-of-sequence token the calls stop where the generate does."""
    ids, mask = padded_batch[0][:2], padded_batch[1][:2]
    seen, steps = [], []
    step = model.flat_step()
    model.flat_step = lambda: lambda *a: steps.append(len(seen)) or step(*a)  # how many tokens were streamed before each step
    try:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=5, on_token=lambda t: seen.append(t.clone()))
    finally:
        del model.flat_step
    assert torch.equal(torch.stack(seen, dim=1), got[:, ids.shape[1]:]) and steps == [1, 2, 3, 4]
    eos = int(got[0, ids.shape[1] + 1])  # row 0's second token
    seen.clear()
    ended = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=5, eos_token_id=eos, on_token=seen.append)
    assert torch.equal(torch.stack(seen, dim=1), ended[:, ids.shape[1]:]) and len(seen) == 2
    with pytest.raises(TypeError, match=r"on_token must be a callable taking each step's \(B,\) tokens, or None, got list"):
        model.generate(ids, max_new_tokens=2, on_token=[])
    for temperature in (0.0, 1.0):  # checked before the prompt pass, greedy or not
        with pytest.raises(TypeError, match=r"generator must be a torch.Generator \(sampling's random numbers\) or None, got int"):
            model.generate(ids, max_new_tokens=2, temperature=temperature, generator=123)


def test_cached_generation_equals_recomputing_everything(model):
    ids = torch.randint(2, V, (2, 5), generator=torch.Generator().manual_seed(3))
    seq = ids
    with torch.no_grad():
        for _ in range(7):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(ids, max_new_tokens=7), seq)


def test_sampling_is_reproducible_and_stays_in_the_top_k(model):
    ids = torch.randint(2, V, (2, 4), generator=torch.Generator().manual_seed(4))
    a = model.generate(ids, max_new_tokens=6, temperature=1.5, top_k=3, generator=torch.Generator().manual_seed(5))
    b = model.generate(ids, max_new_tokens=6, temperature=1.5, top_k=3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    with torch.no_grad():
        logits = model(a[:, :-1])[:, ids.shape[1] - 1 :]  # (2, 6, V): the logits each new token was drawn from
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == a[:, ids.shape[1] :, None]).any(-1).all()
    assert torch.equal(model.generate(ids, max_new_tokens=6, temperature=0.7, top_k=1), model.generate(ids, max_new_tokens=6))


def test_loads_pytorch_bin_without_prefix_with_legacy_buffers_and_tied_head(hf_gpt2, tmp_path, padded_batch):
    """An old-style checkpoint: pytorch_model.bin, no ``transformer.`` prefix, attn.bias / masked_bias, lm_head.weight."""
    state = {k.removeprefix("transformer."): v.clone() for k, v in hf_gpt2.state_dict().items()}
    assert "lm_head.weight" in state
    for i in range(GPT2_SIZES["n_layer"]):
        n = GPT2_SIZES["n_positions"]
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, tmp_path / "pytorch_model.bin")
    hf_gpt2.config.to_json_file(tmp_path / "config.json")
    model = GPT2LMHeadModel.from_pretrained(str(tmp_path))
    ids, mask = padded_batch
    with torch.no_grad():
        want = hf_gpt2(ids, attention_mask=mask, position_ids=hf_positions(mask.bool())).logits
    torch.testing.assert_close(model(ids, mask)[mask.bool()], want[mask.bool()], atol=1e-4, rtol=0)
    assert not model.training


def test_loads_pytorch_bin_with_prefix(hf_gpt2, tmp_path, padded_batch):
    torch.save(hf_gpt2.state_dict(), tmp_path / "pytorch_model.bin")  # transformer.* keys and lm_head.weight
    hf_gpt2.config.to_json_file(tmp_path / "config.json")
    ids = padded_batch[0]
    with torch.no_grad():
        torch.testing.assert_close(GPT2LMHeadModel.from_pretrained(tmp_path)(ids), hf_gpt2(ids).logits, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- bad input


def test_bad_token_ids(model):
    with pytest.raises(TypeError, match=r"input_ids must hold integer token ids, got dtype torch.float32; convert with input_ids.long\(\)"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=rf"input_ids must hold ids in \[0, vocab_size={V}\), got ids from 0 to {V}"):
        model(torch.tensor([[0, V]]))
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, tokens\)"):
        model(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"more than n_positions=48"):
        model(torch.ones(1, 49, dtype=torch.long))


def test_bad_attention_mask(model):
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(batch, tokens\) of input_ids = \(2, 3\), got \(2, 4\)"):
        model(ids, torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask must hold only 0 \(padding\) and 1 \(real token\), got values \[1, 2\]"):
        model(ids, torch.tensor([[1, 1, 2], [1, 1, 1]]))
    with pytest.raises(TypeError, match=r"attention_mask must be a bool or 0/1 int tensor"):
        model(ids, torch.ones(2, 3))
    with pytest.raises(TypeError, match=r"attention_mask must be a bool or 0/1 int tensor"):
        model(ids, [[1, 1, 1], [1, 1, 1]])


def test_bad_generate_arguments(model):
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"max_new_tokens must be a positive int, got 0"):
        model.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"temperature \(0 = greedy\) must be a number in \[0, inf\), got -1"):
        model.generate(ids, max_new_tokens=2, temperature=-1)
    with pytest.raises(ValueError, match=r"top_k \(or None\) must be a positive int, got 0"):
        model.generate(ids, max_new_tokens=2, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match=rf"eos_token_id \(or None\) must be an int in \[0, {V - 1}\], got {V}"):
        model.generate(ids, max_new_tokens=2, eos_token_id=V)
    with pytest.raises(ValueError, match=r"prompt \(3 tokens\) \+ max_new_tokens \(47\) exceeds n_positions=48 by 1 \(the last new token takes no position"):
        model.generate(ids, max_new_tokens=47)


def test_generate_reaches_the_last_position(model):
    """The last new token is never fed back: a prompt of n_positions tokens still gets one, as from a full forward;
    left padding takes no position, so a short row in a wide batch gets as many as it would alone."""
    limit = model.config.n_positions
    ids = torch.randint(0, V, (1, limit), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids)[:, -1].argmax(-1)  # (1,): the full forward over every position
    torch.testing.assert_close(model.generate(ids, max_new_tokens=1)[:, -1], want, atol=0, rtol=0)
    short = ids[:, :2]
    padded = torch.cat([torch.zeros(1, 10, dtype=torch.long), short], dim=1)  # (1, 12), 2 real tokens
    mask = torch.cat([torch.zeros(1, 10, dtype=torch.long), torch.ones(1, 2, dtype=torch.long)], dim=1)
    alone = model.generate(short, max_new_tokens=limit - 1)  # 2 + 47 - 1 = 48 positions
    torch.testing.assert_close(model.generate(padded, attention_mask=mask, max_new_tokens=limit - 1)[:, 10:], alone, atol=0, rtol=0)


def test_generate_refuses_right_padded_prompts(model, padded_batch):
    ids, mask = padded_batch  # row 2 is padded on the right
    with pytest.raises(ValueError, match=r"attention_mask marks it as padding in rows \[2\]: pad prompts on the left"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2)
    holes = torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1, 1]] * 3)  # padding inside a prompt, none at its end: fine
    assert model.generate(ids, attention_mask=holes, max_new_tokens=2).shape == (3, 11)


def test_a_tiny_temperature_is_greedy_not_an_overflow(model):
    ids = torch.randint(2, V, (2, 4), generator=torch.Generator().manual_seed(6))
    greedy = model.generate(ids, max_new_tokens=4)
    for temperature in (1e-300, 5e-324):  # logits / temperature overflowed to inf, softmax gave NaN, multinomial raised
        assert torch.equal(model.generate(ids, max_new_tokens=4, temperature=temperature, generator=torch.Generator().manual_seed(0)), greedy)


@pytest.mark.parametrize(
    ("ids", "error", "match"),
    [
        (torch.zeros(0, 3, dtype=torch.long), ValueError, r"input_ids must have shape \(batch, tokens\) with at least one row and one token, got \(0, 3\)"),
        (torch.zeros(2, 0, dtype=torch.long), ValueError, r"with at least one row and one token, got \(2, 0\)"),
        (torch.ones(1, 3, dtype=torch.uint8), TypeError, r"input_ids must hold int64 or int32 token ids \(embeddings take no other\), got dtype torch.uint8; convert with input_ids.long\(\)"),
        (torch.ones(1, 3, dtype=torch.int16), TypeError, r"got dtype torch.int16"),
        (torch.ones(1, 3, dtype=torch.bool), TypeError, r"input_ids must hold integer token ids, got dtype torch.bool"),
    ],
)
def test_empty_or_oddly_typed_ids(model, ids, error, match):
    with pytest.raises(error, match=match):
        model(ids)
    with pytest.raises(error, match=match):
        model.generate(ids, max_new_tokens=1)


def test_on_each_device_logits_and_greedy_tokens_equal_transformers(device, gpt2_dir, padded_batch):
    """Both models loaded onto ``device`` (cuda too where torch sees a GPU): the same logits, the same tokens."""
    import transformers

    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).to(device).eval()
    model = GPT2LMHeadModel.from_pretrained(gpt2_dir).to(device)
    helpers.equals_transformers_on(device, model, hf, padded_batch)
