"""Llama, Mistral and Qwen3: transformers-made directories in, transformers' logits and greedy tokens out."""

from __future__ import annotations

import copy
import json

import helpers
import pytest
import torch
import torch.nn.functional as F
from helpers import hf_positions
from hf_checkpoints import LLAMA_CONFIGS, LLAMA_SIZES, make_hf_llama, save_hf_llama
from llama_reference import llama_logits

import headwise.models as hm
from headwise import linear as hl
from headwise.cache import KVCache
from headwise.models import llama
from headwise.models.llama import LlamaAttention, RMSNorm
from headwise.rope import RotaryEmbedding

V = LLAMA_SIZES["vocab_size"]
CLASSES = {"llama": hm.LlamaForCausalLM, "mistral": hm.MistralForCausalLM, "qwen3": hm.Qwen3ForCausalLM}


@pytest.fixture(scope="module", params=list(LLAMA_CONFIGS))
def pair(request, tmp_path_factory):
    """(name, transformers model, its directory, headwise's model loaded with headwise.models.load)."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    hf = save_hf_llama(name, path)
    return name, hf, path, hm.load(path)


@pytest.fixture(scope="module")
def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return helpers.padded_batch(V)


def test_load_picks_the_family_class(pair):
    name, _, _, model = pair
    model_type = LLAMA_CONFIGS[name][0]
    assert type(model) is CLASSES[model_type]
    assert not model.training
    assert (model.lm_head is None) == bool(LLAMA_CONFIGS[name][1].get("tie_word_embeddings", False))
    assert (model.model["layers"][0].self_attn.q_norm is not None) == (model_type == "qwen3")


def test_logits_match_transformers_on_a_padded_batch(pair, padded_batch):
    _, hf, _, model = pair
    ids, mask = padded_batch
    real = mask.bool()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=hf_positions(real)).logits
        got = model(ids, attention_mask=mask)
    assert got.shape == (3, 9, V)
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:1]), hf(ids[:1]).logits, atol=1e-4, rtol=0)  # no mask at all


def test_logits_against_the_float64_reference(pair, padded_batch):
    """Our float32 error vs float64 within 4x that of a plain float32 implementation (llama_reference)."""
    from safetensors.torch import load_file

    _, _, path, model = pair
    ids, mask = padded_batch
    real = mask.bool()
    state, config = load_file(path / "model.safetensors"), json.loads((path / "config.json").read_text())
    ref64 = llama_logits(state, config, ids, real, hf_positions(real))[real]
    plain = (llama_logits(state, config, ids, real, hf_positions(real), dtype=torch.float32)[real].double() - ref64).abs().max().item()
    with torch.no_grad():
        ours = (model(ids, attention_mask=real)[real].double() - ref64).abs().max().item()
    assert plain > 0
    assert ours <= 4 * plain


def test_a_float64_model_equals_the_float64_reference(pair, padded_batch):
    """In float64 the model is the reference to float64's rounding over a padded batch, its rotation included (float32
    tables moved these logits by up to 7e-7)."""
    from safetensors.torch import load_file

    _, _, path, model = pair
    ids, mask = padded_batch
    real = mask.bool()
    state, config = load_file(path / "model.safetensors"), json.loads((path / "config.json").read_text())
    wide = copy.deepcopy(model).double()
    with torch.no_grad():
        got = wide(ids, attention_mask=real)[real]
    want = llama_logits(state, config, ids, real, hf_positions(real))[real]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_greedy_generate_equals_transformers(pair, padded_batch):
    _, hf, _, model = pair
    ids, mask = padded_batch[0][:2], padded_batch[1][:2]  # generation pads on the left
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(out.scores).topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3  # clear-cut choices: a token-for-token comparison means something
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=10), out.sequences)


def test_on_each_device_logits_and_greedy_tokens_equal_transformers(pair, padded_batch, device):
    """Both models loaded afresh onto ``device`` (cuda too where torch sees a GPU): the same logits, the same tokens."""
    import transformers

    _, _, path, _ = pair
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    model = hm.load(path).to(device)
    helpers.equals_transformers_on(device, model, hf, padded_batch)

def test_greedy_generate_with_eos_equals_transformers(pair, padded_batch):
    _, hf, _, model = pair
    ids, mask = padded_batch[0][:2], padded_batch[1][:2]
    free = model.generate(ids, attention_mask=mask, max_new_tokens=8)
    eos = int(free[0, ids.shape[1] + 2])  # row 0 emits it at its third new token
    want = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=eos, pad_token_id=eos)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos)
    assert torch.equal(got, want)
    assert (got[0, ids.shape[1] + 2 :] == eos).all()


def test_cached_decoding_equals_the_full_forward(pair):
    _, _, _, model = pair
    ids = torch.randint(2, V, (2, 7), generator=torch.Generator().manual_seed(3))
    seq = ids
    with torch.no_grad():
        for _ in range(9):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(ids, max_new_tokens=9), seq)
    caches = model.new_caches(2, 16)
    with torch.no_grad():
        step = [model(seq[:, :7], cache=caches, logits_to_keep=1)[:, 0]] + [model(seq[:, i : i + 1], cache=caches)[:, 0] for i in range(7, 16)]
        full = model(seq)[:, 6:]  # (2, 10, V): the logits after 7 .. 16 tokens
    torch.testing.assert_close(torch.stack(step, dim=1), full, atol=1e-4, rtol=0)  # float32, other GEMM shapes


def test_left_padding_gives_the_unpadded_logits(tmp_path):
    save_hf_llama("llama3-gqa4-scaled", tmp_path)
    model = hm.load(tmp_path)
    ids = torch.randint(2, V, (1, 6), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)  # (1, 10)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded, attention_mask=mask)[:, 4:], model(ids), atol=1e-5, rtol=0)
    assert torch.equal(model.generate(padded, attention_mask=mask, max_new_tokens=6)[:, 4:], model.generate(ids, max_new_tokens=6))


def test_mistral_window_is_shorter_than_the_prompt_and_decodes_through_a_ring_cache(tmp_path, padded_batch):
    from safetensors.torch import load_file

    hf = save_hf_llama("mistral-window", tmp_path)
    model = hm.load(tmp_path)
    assert [layer.self_attn.window for layer in model.model["layers"]] == [5, 5]
    assert all(c.window == 5 for c in model.new_caches(2, 30))  # ring buffers of 5 slots
    ids, mask = padded_batch  # 9 tokens > window 5
    real = mask.bool()
    state, config = load_file(tmp_path / "model.safetensors"), json.loads((tmp_path / "config.json").read_text())
    with torch.no_grad():
        got = model(ids, attention_mask=mask)
    windowless = llama_logits(state, {**config, "sliding_window": None}, ids, real, hf_positions(real))
    assert (got.double() - windowless)[real].abs().max() > 1e-2  # the window changes the answer
    prompt, pmask = ids[:2], mask[:2]
    want = hf.generate(prompt, attention_mask=pmask, do_sample=False, max_new_tokens=20, pad_token_id=0)
    assert torch.equal(model.generate(prompt, attention_mask=pmask, max_new_tokens=20), want)  # 29 tokens through 5 slots


def test_bf16_checkpoint_runs_in_bf16_within_twice_a_plain_bf16_error(tmp_path, padded_batch):
    """Flash-attention rule against float64: ours (bf16 weights, float32 rotary/norms) vs a plain bf16 forward."""
    from safetensors.torch import load_file

    save_hf_llama("qwen3-qknorm-tied", tmp_path, dtype=torch.bfloat16)
    model = hm.load(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids, mask = padded_batch
    real = mask.bool()
    state, config = load_file(tmp_path / "model.safetensors"), json.loads((tmp_path / "config.json").read_text())
    ref64 = llama_logits(state, config, ids, real, hf_positions(real))[real]
    plain = (llama_logits(state, config, ids, real, hf_positions(real), dtype=torch.bfloat16)[real].double() - ref64).abs().max().item()
    with torch.no_grad():
        got = model(ids, attention_mask=mask)
    assert got.dtype == torch.bfloat16
    ours = (got[real].double() - ref64).abs().max().item()
    assert plain > 0
    assert ours <= 2 * plain
    wide = hm.load(tmp_path, dtype=torch.float32)  # float32 on request: the bf16 weights exactly, computed in float32
    assert {p.dtype for p in wide.parameters()} == {torch.float32}
    with torch.no_grad():
        assert (wide(ids, attention_mask=mask)[real].double() - ref64).abs().max().item() < plain / 10


def test_sharded_checkpoint_loads_the_same(tmp_path, padded_batch):
    save_hf_llama("llama-gqa2-tied", tmp_path / "one")
    save_hf_llama("llama-gqa2-tied", tmp_path / "many", max_shard_size="40KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "many").glob("model-*.safetensors"))) > 1
    ids = padded_batch[0]
    with torch.no_grad():
        assert torch.equal(hm.load(tmp_path / "many")(ids), hm.load(tmp_path / "one")(ids))


def test_untied_checkpoint_keeps_its_head(tmp_path):
    hf = make_hf_llama("llama-mha-untied")
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    hf.save_pretrained(tmp_path)
    model = hm.load(tmp_path)
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)


# ----------------------------------------------------------------------------- load and bad input


def test_load_dispatches_gpt2_and_names_the_supported_types(gpt2_dir, tmp_path):
    assert type(hm.load(gpt2_dir)) is hm.GPT2LMHeadModel
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    with pytest.raises(ValueError, match=r"config.json: model_type 'falcon' is not supported; supported: gpt2, bert, llama, mistral, qwen3"):
        hm.load(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model_type None is not supported; supported: gpt2, bert, llama, mistral, qwen3"):
        hm.load(tmp_path)
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 is not supported for gpt2; it loads in float32"):
        hm.load(gpt2_dir, dtype=torch.bfloat16)
    for text in ("float32", "auto"):  # one TypeError for every model type (it said float32 is not supported: it loads in float32)
        with pytest.raises(TypeError, match=rf"dtype must be a torch.dtype or None, got str '{text}' \(e.g. torch.bfloat16, not a string\)"):
            hm.load(gpt2_dir, dtype=text)


def test_config_this_model_cannot_run(tmp_path):
    save_hf_llama("llama-mha-untied", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}))
    with pytest.raises(ValueError, match=r"config.json: unsupported llama settings: hidden_act='gelu' \(supported: 'silu'\); rope_scaling's rope_type must be one of"):
        hm.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match=r"config.json: invalid llama config: num_attention_heads \(8\) must be divisible by num_key_value_heads \(3\)"):
        hm.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: describes model_type 'llama', expected 'qwen3'"):
        hm.Qwen3ForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(TypeError, match=r"dtype must be a floating torch.dtype or None \(the checkpoint's\), got torch.int64"):
        hm.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.int64)


@pytest.mark.parametrize(("model_type", "left_out"), [
    ("mistral", "sliding_window"), ("mistral", "num_key_value_heads"), ("mistral", "max_position_embeddings"),
    ("mistral", "intermediate_size"), ("qwen3", "head_dim"), ("qwen3", "max_position_embeddings"), ("qwen3", "vocab_size"),
    ("qwen3", "num_key_value_heads"), ("llama", "max_position_embeddings"), ("llama", "num_key_value_heads"),
])
def test_a_key_config_json_leaves_out_takes_the_model_types_default(model_type, left_out):
    """As transformers' config class of that model type fills it (Mistral's window 4096, Qwen3's head_dim 128, ...)."""
    import transformers

    from headwise.models.llama_config import llama_config

    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config}[model_type]
    d = {**LLAMA_SIZES, "num_attention_heads": 32, "hidden_size": 4096, "num_key_value_heads": 8, "head_dim": 128,
         "sliding_window": 7 if model_type == "mistral" else None, "model_type": model_type}
    del d[left_out]
    theirs, ours = config_class.from_dict(d), llama_config(d, model_type, "config.json")
    assert (ours.vocab_size, ours.intermediate_size, ours.kv_heads, ours.head_size, ours.max_position_embeddings) == (
        theirs.vocab_size, theirs.intermediate_size, theirs.num_key_value_heads, theirs.head_dim, theirs.max_position_embeddings)
    assert ours.window(0) == (theirs.sliding_window if model_type == "mistral" else None)


@pytest.mark.parametrize(("name", "keys"), [("mistral-window", {"attention_bias": True, "mlp_bias": True}), ("qwen3-qknorm-tied", {"mlp_bias": True})])
def test_bias_switches_the_model_type_never_reads_are_ignored_as_in_transformers(name, keys, tmp_path, padded_batch):
    """Mistral's projections and Qwen3's MLP have no bias whatever config.json says: the checkpoint loads, the same logits."""
    import transformers

    save_hf_llama(name, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **keys}))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = hm.load(tmp_path)
    ids, mask = padded_batch
    real = mask.bool()
    with torch.no_grad():
        want = theirs(ids, attention_mask=mask, position_ids=hf_positions(real)).logits
        got = ours(ids, attention_mask=mask)
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)


def test_tied_config_with_a_different_head_is_refused(tmp_path):
    hf = make_hf_llama("llama-mha-untied")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match=r"nothing was loaded:\n  lm_head.weight differs from model.embed_tokens.weight; config.json says "
                                         r"tie_word_embeddings$"):
        hm.load(tmp_path)


def test_a_tied_head_is_checked_with_every_other_key_and_named_as_the_file_names_it(tmp_path):
    """A head that is no copy of its embedding is one of the file's problems, listed with the others (it stopped the
    check before them); a tied file that kept the head alone names the head where its shape is wrong (not the
    embedding's key, which the file does not hold)."""
    from safetensors.torch import load_file, save_file

    save_hf_llama("qwen3-qknorm-tied", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    embed = state["model.embed_tokens.weight"]
    bad = {k: v for k, v in state.items() if k != "model.norm.weight"} | {"lm_head.weight": embed[:-1].clone(), "extra.weight": embed.clone()}
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"nothing was loaded:\n  lm_head.weight has shape \({embed.shape[0] - 1}, {embed.shape[1]}\), "
                                         rf"model.embed_tokens.weight \({embed.shape[0]}, {embed.shape[1]}\); config.json says "
                                         r"tie_word_embeddings\n  missing: model.norm.weight\n  unexpected: extra.weight$"):
        hm.load(tmp_path)
    head_only = {k: v for k, v in state.items() if k != "model.embed_tokens.weight"} | {"lm_head.weight": embed[:-1].clone()}
    save_file(head_only, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"nothing was loaded:\n  wrong shape: lm_head.weight: expected \({embed.shape[0]}, {embed.shape[1]}\), "
                                         rf"got \({embed.shape[0] - 1}, {embed.shape[1]}\)$"):
        hm.load(tmp_path)
    save_file({k: v for k, v in state.items() if k not in ("model.embed_tokens.weight", "model.norm.weight")}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"nothing was loaded:\n  missing: model.embed_tokens.weight\n  missing: model.norm.weight$"):
        hm.load(tmp_path)


def test_a_tied_head_that_holds_a_nan_is_still_the_embeddings_copy(tmp_path):
    """A NaN equals no number, itself included: the tied check compares NaN to NaN as the same value (it said the head
    differs)."""
    hf = make_hf_llama("llama-mha-untied")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "model.safetensors")
    embed = state["model.embed_tokens.weight"].clone()
    embed[3, 5] = float("nan")
    save_file({**state, "model.embed_tokens.weight": embed, "lm_head.weight": embed.clone()}, tmp_path / "model.safetensors")
    assert hm.load(tmp_path).model["embed_tokens"].weight[3, 5].isnan()


def test_a_mistral_file_whose_layer_types_name_full_layers_is_refused(tmp_path):
    """transformers' Mistral slides every layer; its Auto classes ran such a file as another model, with layer 0 full:
    which layers slide is not one reading, so the file is refused by name."""
    hf = make_hf_llama("llama-mha-untied")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    layers = config["num_hidden_layers"]
    kinds = ["full_attention"] + ["sliding_attention"] * (layers - 1)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mistral", "sliding_window": 3, "layer_types": kinds}))
    with pytest.raises(ValueError, match=r"unsupported mistral settings: layer_types=\['full_attention', .* with sliding_window"):
        hm.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mistral", "sliding_window": 3,
                                                      "layer_types": ["sliding_attention"] * layers}))
    assert hm.load(tmp_path).config.windows == (3,) * layers


def test_missing_and_misshaped_weights_are_all_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf_llama("qwen3-qknorm-tied", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.self_attn.k_norm.weight"]
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"(?s)nothing was loaded.*missing: model.layers.1.self_attn.k_norm.weight.*wrong shape: model.norm.weight"):
        hm.load(tmp_path)


def test_attention_layer_checks_position_ids():
    config = hm.LlamaConfig(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    attn = LlamaAttention(config, RotaryEmbedding(8))
    x = torch.randn(2, 3, 16)
    with pytest.raises(TypeError, match=r"position_ids must be an integer tensor of shape \(batch, tokens\) = \(2, 3\), got dtype torch.float32"):
        attn(x, position_ids=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"position_ids must have shape \(batch, tokens\) = \(2, 3\), got \(2, 4\)"):
        attn(x, position_ids=torch.zeros(2, 4, dtype=torch.long))
    with torch.no_grad():  # explicit positions 0..2 = the default
        torch.testing.assert_close(attn(x, position_ids=torch.arange(3).expand(2, 3)), attn(x))
        default, explicit = KVCache(2, 2, 8, 8), KVCache(2, 2, 8, 8)
        attn(x, cache=default)
        attn(x, cache=explicit, position_ids=torch.arange(3).expand(2, 3))
        torch.testing.assert_close(attn(x[:, :1], cache=default), attn(x[:, :1], cache=explicit, position_ids=torch.full((2, 1), 3)))


def test_bad_generate_arguments_are_named(pair):
    _, _, _, model = pair
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"max_new_tokens must be a positive int, got 0"):
        model.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match=rf"eos_token_id \(or None\) must be an int in \[0, {V - 1}\], got {V}"):
        model.generate(ids, max_new_tokens=2, eos_token_id=V)
    limit = model.context_limit()[1]
    if limit is not None:
        with pytest.raises(ValueError, match=rf"prompt \(3 tokens\) \+ max_new_tokens \({limit}\) exceeds max_position_embeddings={limit}"):
            model.generate(ids, max_new_tokens=limit)


# ----------------------------------------------------------------------------- devices and host reads


def tiny_llama(device) -> hm.Qwen3ForCausalLM:
    """QK-norm, GQA, one windowed layer (a ring cache in generate) and one full one."""
    config = hm.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, qk_norm=True, windows=(3, None),
    )
    torch.manual_seed(0)
    return hm.Qwen3ForCausalLM(config).to(device).eval()


def test_a_model_whose_layers_all_slide_runs_a_forward_past_max_position_embeddings():
    """As generate does (and transformers' Mistral): a window bounds what each query sees, not the length."""
    config = hm.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=16, windows=(4, 4))
    torch.manual_seed(0)
    model = hm.MistralForCausalLM(config).eval()
    ids = torch.randint(0, 50, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(ids)  # (1, 21, 50), no cache
        cached = model(ids, cache=model.new_caches(1, 21))  # through the ring caches
    torch.testing.assert_close(whole, cached, atol=1e-5, rtol=0)
    mixed = tiny_llama("cpu")  # one full layer: the limit stands, named as the config names it
    with pytest.raises(ValueError, match=r"33 tokens, more than max_position_embeddings=32"):
        mixed(torch.zeros(1, 33, dtype=torch.long))


def test_llama_makes_nothing_off_its_device():
    from helpers import OffDevice

    model = tiny_llama("meta")
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    real = torch.ones(2, 5, dtype=torch.bool, device="meta")
    with OffDevice() as seen:
        assert model(ids, attention_mask=real).shape == (2, 5, 50)
        assert model.generate(ids, max_new_tokens=3, attention_mask=real).shape == (2, 8)
        assert model(ids).shape == (2, 5, 50)
    assert seen.stray == []


@pytest.mark.parametrize("padded", [False, True])
def test_llama_generate_reads_the_prompt_and_no_decode_step(device, padded):
    """As GPT-2: the inputs are read once per call, the rotary positions and the decode steps read nothing."""
    from helpers import host_reads

    model = tiny_llama(device)
    ids = torch.randint(1, 50, (2, 5), generator=torch.Generator().manual_seed(0)).to(device)
    mask = (torch.arange(5) >= torch.tensor([[0], [2]])).long().to(device) if padded else None  # row 1 left padded
    counts = []
    for n in (1, 6):
        with host_reads(device) as reads:
            model.generate(ids, max_new_tokens=n, attention_mask=mask)
        counts.append(sorted(reads))
    # int mask values; "any padding?" and "does a prompt end in padding?" in one read; ids' min and max
    want = ["__bool__", "tolist", "tolist"] if padded else ["tolist"]
    assert counts == [want, want]


@pytest.mark.parametrize("rows", [1, hl.DECODE_ROWS, hl.DECODE_ROWS + 1, 40])
def test_projections_are_one_gemm_for_decode_rows_only(rows, monkeypatch):
    """A decode step's few rows run Q/K/V (or gate/up) as one stacked GEMM; a prompt's rows run each
    layer alone, into contiguous outputs; the numbers are each layer's either way."""
    torch.manual_seed(0)
    layers = (torch.nn.Linear(32, 48), torch.nn.Linear(32, 16, bias=True), torch.nn.Linear(32, 16))
    x = torch.randn(rows, 1, 32)  # (B, T, C): B*T rows
    stacked = []
    monkeypatch.setattr(llama, "project_many", lambda ls, x: stacked.append(len(ls)) or hl.project_many(ls, x))
    with torch.no_grad():
        outs = llama.projections(layers, x)
    assert stacked == ([3] if rows <= hl.DECODE_ROWS else [])
    for out, layer in zip(outs, layers, strict=True):
        torch.testing.assert_close(out, layer(x).detach(), atol=1e-5, rtol=1e-5)
        assert out.is_contiguous() or rows <= hl.DECODE_ROWS


def tiny_mlp(dtype: torch.dtype = torch.float32) -> llama.MLP:
    torch.manual_seed(0)
    cfg = hm.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=160, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2)
    return llama.MLP(cfg).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, hl.DECODE_ROWS, hl.DECODE_ROWS + 1, 40])
def test_mlp_without_autograd_gives_the_recorded_calls_numbers_bit_for_bit(rows, dtype):
    """Without autograd the MLP writes silu(gate) * up over its own gate tensor: the numbers of the call autograd
    records (a new tensor for each op), and within the float64 SwiGLU's reach."""
    mlp = tiny_mlp(dtype)
    x = torch.randn(1, rows, 64).to(dtype)
    with torch.no_grad():
        got = mlp(x)
    recorded = mlp(x)
    assert recorded.requires_grad and torch.equal(got, recorded.detach())
    w = {name: layer.weight.double() for name, layer in mlp.named_children()}
    x64 = x.double()
    want = (F.silu(x64 @ w["gate_proj"].T) * (x64 @ w["up_proj"].T)) @ w["down_proj"].T
    torch.testing.assert_close(got.double(), want, **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.05}))


def test_mlp_leaves_a_gate_output_a_hook_kept_as_it_was():
    """A forward hook on gate_proj may keep its output: the MLP then makes new tensors rather than write over it."""
    mlp = tiny_mlp()
    kept = []
    mlp.gate_proj.register_forward_hook(lambda module, args, out: kept.append(out))
    x = torch.randn(1, 40, 64)
    with torch.no_grad():
        got = mlp(x)
        gate = F.linear(x, mlp.gate_proj.weight)
    torch.testing.assert_close(kept[0], gate, atol=1e-6, rtol=1e-6)  # still gate_proj(x), not silu(gate) * up
    assert not hl.owns_output(mlp.gate_proj)
    assert torch.equal(got, tiny_mlp()(x).detach())  # the same numbers as the unhooked MLP's


@pytest.mark.parametrize("shape", [(1, 1, 768), (3, 17, 64), (2, 5, 4096)])
def test_rmsnorm_in_float32_is_weight_times_the_normed_input_bit_for_bit(shape):
    """The float32 norm runs as one op with the weight inside; HuggingFace multiplies the weight after: the same bits."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=gen))
        x = torch.randn(shape, generator=gen)
        want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))  # (..., N) as HuggingFace writes it
        assert torch.equal(norm(x), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_without_autograd_runs_the_cpp_op_with_torchs_bits(dtype, monkeypatch):
    """Eager CPU rows without autograd run headwise's C++ op (where built), whose sums repeat torch's order: the bits
    of ``F.rms_norm`` at every width (below a vector, between, long), every scale; under autograd torch's op runs and
    gives the gradients."""
    from headwise import native
    from headwise.models import llama

    if not native.built():
        pytest.skip("headwise's C++ ops are not built here")
    calls = []
    op = torch.ops.headwise.rms_norm
    monkeypatch.setattr(llama.torch.ops.headwise, "rms_norm", lambda *a: calls.append(1) or op(*a), raising=False)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 5, 8, 9, 63, 64, 100, 768, 1025, 4096, 16383):
        norm = RMSNorm(n, 1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(n, generator=gen))
            for rows, scale in (((1, 1), 1.0), ((3, 7), 1e-3), ((2, 5), 40.0)):
                x = (scale * torch.randn(*rows, n, generator=gen)).to(dtype)
                before = len(calls)
                got = norm(x)
                assert len(calls) == before + 1, "the C++ op ran"
                want = F.rms_norm(x, (n,), norm.weight, 1e-5) if dtype == torch.float32 else norm.weight * F.rms_norm(x, (n,), eps=1e-5)
                assert torch.equal(got, want), (n, rows, scale)
    x = torch.randn(2, 3, 64, requires_grad=True)
    norm = RMSNorm(64, 1e-5)
    before = len(calls)
    norm(x).sum().backward()
    assert len(calls) == before and x.grad is not None and norm.weight.grad is not None  # torch's op, differentiable
    monkeypatch.undo()  # the op itself again
    for args in ((x.detach()[:, :, ::2], torch.randn(32), 1e-5), (x.detach().bfloat16(), None, 1e-5)):  # strided rows; bfloat16
        assert set(torch.library.opcheck(op, args).values()) == {"SUCCESS"}  # schema, fake, autograd registration


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 768), (3, 17, 64), (2, 5, 4096), (4, 2, 1000)])
def test_rmsnorm_in_half_is_the_float32_norm_rounded_back_once(shape, dtype):
    """A half x is normed as one op on x: the bits of the float32 op on x.float() rounded back, then the
    weight's product (HuggingFace's order), at any scale; within rounding of HuggingFace's own formula."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=gen))
        for scale in (1e-3, 1.0, 30.0):
            x = (scale * torch.randn(shape, generator=gen)).to(dtype)
            got = norm(x)
            assert torch.equal(got, norm.weight * F.rms_norm(x.float(), (shape[-1],), eps=1e-5).to(dtype))
            wide = x.float()
            hf = norm.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)  # as HuggingFace writes it
            torch.testing.assert_close(got, hf)


@pytest.mark.parametrize("assign", [False, True])
def test_a_model_built_on_meta_loads_and_rotates_as_one_built_on_the_cpu(assign):
    """The rotary frequencies are no state: made on the CPU whatever the default device, they survive a meta build."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    config = hm.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rope_scaling=scaling,
    )
    torch.manual_seed(0)
    model = hm.LlamaForCausalLM(config).eval()
    with torch.device("meta"):
        skeleton = hm.LlamaForCausalLM(config).eval()
    if not assign:
        skeleton.to_empty(device="cpu")
    skeleton.load_state_dict(model.state_dict(), assign=assign)
    ids = torch.randint(0, 50, (2, 9))
    assert torch.equal(skeleton(ids), model(ids))
    assert torch.equal(skeleton.generate(ids, max_new_tokens=4), model.generate(ids, max_new_tokens=4))


def _rewritten(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def test_llama3_scaling_reads_the_trained_length_as_transformers_does(tmp_path, padded_batch):
    """A top-level original_max_position_embeddings (Phi-3's files keep it there) over the rope dict's; without either,
    max_position_embeddings: the logits transformers gives past the trained length."""
    import transformers

    save_hf_llama("llama-mha-untied", tmp_path)
    rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    ids, mask = padded_batch
    real = mask.bool()
    for top, inside in ((8, 32), (None, None)):
        _rewritten(tmp_path, rope_parameters={**rope, **({} if inside is None else {"original_max_position_embeddings": inside})},
                   **({} if top is None else {"original_max_position_embeddings": top}))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        with torch.no_grad():
            want = theirs(ids, attention_mask=mask, position_ids=hf_positions(real)).logits
            got = hm.load(tmp_path)(ids, attention_mask=mask)
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)


def test_a_checkpoint_with_the_old_rotary_tables_loads_as_transformers_loads_it(tmp_path, padded_batch):
    """transformers before 4.31 saved each layer's rotary_emb.inv_freq; transformers drops them, and so does headwise."""
    from safetensors.torch import load_file, save_file

    hf = save_hf_llama("llama-mha-untied", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    D = hf.config.hidden_size // hf.config.num_attention_heads
    tables = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(D // 2) for i in range(hf.config.num_hidden_layers)}
    save_file({**state, **tables}, tmp_path / "model.safetensors")
    ids, mask = padded_batch
    with torch.no_grad():
        torch.testing.assert_close(hm.load(tmp_path)(ids, attention_mask=mask)[mask.bool()],
                                   hf(ids, attention_mask=mask, position_ids=hf_positions(mask.bool())).logits[mask.bool()], atol=1e-4, rtol=0)


def test_a_tied_checkpoint_that_kept_only_the_head_loads_it_as_the_embedding(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf_llama("qwen3-qknorm-tied", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    embed = state.pop("model.embed_tokens.weight")
    save_file({**state, "lm_head.weight": embed}, tmp_path / "model.safetensors")
    assert torch.equal(hm.load(tmp_path).model["embed_tokens"].weight, embed)


@pytest.mark.parametrize(("name", "changes", "match"), [
    ("llama-mha-untied", {"rms_norm_eps": None}, r"invalid llama config: rms_norm_eps must be a number in \(0, inf\), got None"),
    ("llama-mha-untied", {"num_hidden_layers": None}, r"invalid llama config: num_hidden_layers must be a positive int, got None"),
    ("llama-mha-untied", {"rope_parameters": {"rope_type": ["linear"], "factor": 2.0}}, r"rope_type must be one of .*, got \['linear'\]"),
    ("mistral-window", {"sliding_window": 0}, r"invalid mistral config: sliding_window must be a positive int, got 0"),
    ("mistral-window", {"num_hidden_layers": "2"}, r"invalid mistral config: num_hidden_layers must be a positive int, got '2'"),
    ("qwen3-qknorm-tied", {"use_sliding_window": "false", "sliding_window": 4},
     r"invalid qwen3 config: use_sliding_window must be true or false, got 'false'"),
    ("qwen3-qknorm-tied", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": None, "layer_types": None},
     r"invalid qwen3 config: max_window_layers must be an int >= 0, got None"),
    ("qwen3-qknorm-tied", {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
     r"layer_types names sliding layers but use_sliding_window is false"),
    ("qwen3-qknorm-tied", {"use_sliding_window": True, "sliding_window": None, "layer_types": ["sliding_attention", "full_attention"]},
     r"layer_types names sliding layers but sliding_window is null"),
    ("llama-mha-untied", {"layer_types": ["bogus", 3]}, r"layer_types entries must be one of \['full_attention', 'sliding_attention'\], got 'bogus', 3"),
    ("mistral-window", {"layer_types": "sliding_attention"}, r"layer_types must be a list of .*, one per layer, got str 'sliding_attention'"),
    ("mistral-window", {"layer_types": ["sliding_attention"]}, r"layer_types must give one kind per layer \(num_hidden_layers=2\), got 1"),
    ("qwen3-qknorm-tied", {"head_dim": None}, r"invalid qwen3 config: head_dim must be a positive int \(transformers' Qwen3 takes no null\), got None"),
])
def test_config_values_read_differently_from_transformers_are_refused_by_name(name, changes, match, tmp_path):
    """A null where a number belongs, a string where a bool does, a window of 0: each field named (a null took
    LlamaConfig's default, and the string "false" switched sliding on)."""
    save_hf_llama(name, tmp_path)
    _rewritten(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        hm.load(tmp_path)
