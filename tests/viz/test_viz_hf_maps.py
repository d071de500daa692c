"""The heads of any transformers architecture: its model on headwise's attention, weights as ``observe`` sees them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from headwise.viz import head_maps, heads_page

TEXT = "the cat sat on the mat ."
WORDS = ["the", "cat", "sat", "on", "mat", "."]


def _directory(path: Path, model: transformers.PreTrainedModel) -> Path:
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3)  # far from uniform attention
    model.save_pretrained(path)
    vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config).eval()
    return _directory(tmp_path_factory.mktemp("qwen3"), model), model


def test_a_qwen3_directory_draws_through_transformers_on_headwise(qwen3):
    directory, model = qwen3
    maps = head_maps(directory, TEXT)
    assert maps.tokens == tuple(TEXT.split()) and maps.causal
    assert maps.weights.shape == (2, 4, 7, 7)
    ids = torch.tensor([[WORDS.index(w) + 2 for w in TEXT.split()]])
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = torch.cat(model(input_ids=ids, output_attentions=True).attentions)  # (L, H, T, T), transformers' own attention
    torch.testing.assert_close(maps.weights, want, rtol=0, atol=1e-5)
    assert "Qwen3Model, transformers on headwise" in maps.model
    assert "Qwen3Model, transformers on headwise" in heads_page(maps)  # the page says which model


def test_a_bidirectional_encoder_is_not_causal(tmp_path):
    torch.manual_seed(1)
    config = transformers.RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                        max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    maps = head_maps(_directory(tmp_path, transformers.RobertaModel(config).eval()), TEXT)
    assert not maps.causal and maps.weights.shape == (2, 4, 7, 7)
    torch.testing.assert_close(maps.weights.sum(-1), torch.ones(2, 4, 7))


def test_a_text_past_the_positions_is_drawn_up_to_them(qwen3):
    """A tokenizer without truncation: the tokens past max_position_embeddings (64) are cut and counted, never run past
    the positions the model was made for."""
    directory, model = qwen3
    text = " ".join(["the cat sat on the mat ."] * 10)  # 70 tokens
    maps = head_maps(directory, text)
    assert maps.cut == 6 and len(maps.tokens) == 64 and maps.weights.shape == (2, 4, 64, 64)
    ids = torch.tensor([[WORDS.index(w) + 2 for w in text.split()][:64]])
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = torch.cat(model(input_ids=ids, output_attentions=True).attentions)  # (L, H, 64, 64)
    torch.testing.assert_close(maps.weights, want, rtol=0, atol=1e-5)


def test_a_text_past_learned_positions_that_start_late_is_refused(tmp_path):
    torch.manual_seed(1)
    config = transformers.RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                        max_position_embeddings=16, pad_token_id=0)  # fmt: skip
    directory = _directory(tmp_path, transformers.RobertaModel(config).eval())
    with pytest.raises(ValueError, match=r"could not run the text's 16 tokens .*max_position_embeddings \(16\); shorten the text"):
        head_maps(directory, " ".join(["the cat sat on"] * 4))  # 16 tokens: RoBERTa's positions start at pad_token_id + 1


def test_a_causal_lm_directory_loads_its_base_model_quietly(qwen3, capfd):
    """The unused ``lm_head`` is left without transformers' load report (nor its progress bar), and the logging level
    is the caller's again after."""
    directory, _ = qwen3
    before = transformers.logging.get_verbosity()
    head_maps(directory, TEXT)
    out, err = capfd.readouterr()
    assert "lm_head" not in out + err and "LOAD REPORT" not in out + err and "Loading weights" not in err
    assert transformers.logging.get_verbosity() == before


def test_a_directory_missing_a_weight_is_refused_naming_it(qwen3, tmp_path):
    """transformers would initialise a missing weight at random (and say so in a report): the heads drawn would be no
    checkpoint's. Every missing key is named."""
    from safetensors.torch import load_file, save_file

    directory, _ = qwen3
    for f in directory.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.self_attn.q_proj.weight"], weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not hold every weight of its Qwen3Model \(missing: layers.0.self_attn.q_proj.weight, "
                                         r"norm.weight\): its heads would be drawn from randomly initialised weights"):
        head_maps(tmp_path, TEXT)


@pytest.mark.parametrize("which", ["qwen3", "gpt2"])
def test_a_tokenizer_that_pads_to_a_fixed_length_draws_the_text_alone(which, qwen3, gpt2_dir, tmp_path):
    """A ``tokenizer.json`` may pad every text to a fixed length (all-MiniLM-L6-v2's pads to 128): the pads are not the
    text's tokens, and the model runs without them (transformers' and headwise's own GPT-2 alike)."""
    source = qwen3[0] if which == "qwen3" else gpt2_dir
    for f in source.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tokenizer.enable_padding(length=12, pad_id=1, pad_token="<|endoftext|>")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    text = TEXT if which == "qwen3" else "the cat"
    want = head_maps(source, text)
    maps = head_maps(tmp_path, text)
    assert maps.tokens == want.tokens == tuple(text.split()) and maps.cut == 0
    assert torch.equal(maps.weights, want.weights)


def test_an_encoder_saved_without_its_pooler_is_drawn(tmp_path):
    """A checkpoint saved from a task model (``RobertaForMaskedLM``) has no pooler, which reads the last layer's output
    alone: no head depends on it, so it is not a missing weight here."""
    torch.manual_seed(2)
    config = transformers.RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                        max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    model = transformers.RobertaForMaskedLM(config).eval()
    maps = head_maps(_directory(tmp_path, model), TEXT)
    ids = torch.tensor([[WORDS.index(w) + 2 for w in TEXT.split()]])
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = torch.cat(model(input_ids=ids, output_attentions=True).attentions)  # (L, H, T, T)
    torch.testing.assert_close(maps.weights, want, rtol=0, atol=1e-5)
    assert not maps.causal


def test_a_one_token_text_takes_causal_from_the_model(qwen3, tmp_path):
    """One token's weights are [1.0] either way: whether the page says causal comes from the attention modules."""
    torch.manual_seed(1)
    config = transformers.RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                        max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    encoder = _directory(tmp_path, transformers.RobertaModel(config).eval())
    assert head_maps(qwen3[0], "cat").causal and not head_maps(encoder, "cat").causal
