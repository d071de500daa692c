"""head_maps: every head's weights equal transformers' eager attentions; roles match the weights."""

from __future__ import annotations

import json

import pytest
import torch

from headwise.viz import DEFAULT_TEXT, head_maps


def hf_attentions(directory, kind: str, ids: list[int]) -> torch.Tensor:
    """(L, H, T, T) attention weights from transformers (eager), float64 for the comparison."""
    import transformers

    cls = {"bert": transformers.BertModel, "gpt2": transformers.GPT2LMHeadModel}[kind]
    model = cls.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    return torch.cat(out.attentions).double()  # (L, H, T, T)


def tokenizer_ids(directory, text: str) -> tuple[list[int], list[str]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.no_padding()  # MiniLM's tokenizer.json pads to 128
    encoding = tokenizer.encode(text)
    return encoding.ids, encoding.tokens


def reference_mass(w: torch.Tensor, special: list[bool]) -> torch.Tensor:
    """(L, H, 4) mean weight on previous / next / self / special keys over ordinary queries, by loops."""
    L, H, T, _ = w.shape
    plain = [i for i in range(T) if not special[i]]
    out = torch.zeros(L, H, 4, dtype=torch.float64)
    for i in plain:
        out[..., 0] += w[..., i, i - 1] if i > 0 and not special[i - 1] else 0.0
        out[..., 1] += w[..., i, i + 1] if i + 1 < T and not special[i + 1] else 0.0
        out[..., 2] += w[..., i, i]
        out[..., 3] += sum(w[..., i, j] for j in range(T) if special[j])
    return out / len(plain)


def test_default_is_minilm_on_the_books_sentence(minilm_maps, minilm_dir):
    m = minilm_maps
    ids, tokens = tokenizer_ids(minilm_dir, DEFAULT_TEXT)
    assert m.model == "all-MiniLM-L6-v2" and m.text == DEFAULT_TEXT and not m.causal
    assert m.tokens == tuple(tokens) == ("[CLS]", "your", "journey", "starts", "with", "one", "step", ".", "[SEP]")
    assert (m.layers, m.heads) == (6, 12) and m.weights.shape == (6, 12, 9, 9) and m.weights.dtype == torch.float32
    torch.testing.assert_close(m.weights.double(), hf_attentions(minilm_dir, "bert", ids), atol=2e-5, rtol=0)


def test_minilm_roles_are_the_mass_of_its_weights(minilm_maps):
    m = minilm_maps
    special = [t in ("[CLS]", "[SEP]") for t in m.tokens]
    torch.testing.assert_close(m.roles.mass.double(), reference_mass(m.weights.double(), special), atol=1e-5, rtol=0)
    for layer in range(m.layers):
        for head in range(m.heads):
            role, share = m.role(layer, head)
            mass = m.roles.mass[layer, head]
            assert share == pytest.approx(float(mass.max()))
            assert role == ("mixed" if share < 0.5 else m.roles.kinds[int(mass.argmax())])
    assert m.role(0, 2)[0] == "previous" and m.role(1, 8)[0] == "next"  # MiniLM's positional heads on this sentence


def test_a_bert_directory(bert_dir):
    text = "The cat sat on the mat."
    m = head_maps(bert_dir, text)
    ids, tokens = tokenizer_ids(bert_dir, text)
    assert m.model == bert_dir.name and m.tokens == tuple(tokens) and m.weights.shape == (2, 4, len(ids), len(ids))
    torch.testing.assert_close(m.weights.double(), hf_attentions(bert_dir, "bert", ids), atol=2e-5, rtol=0)


def test_a_gpt2_directory_is_causal(gpt2_dir):
    text = "the cat sat on the mat ."
    m = head_maps(gpt2_dir, text)
    ids, tokens = tokenizer_ids(gpt2_dir, text)
    assert m.causal and m.tokens == tuple(tokens) and m.weights.shape == (2, 4, 7, 7)
    expected = hf_attentions(gpt2_dir, "gpt2", ids)
    torch.testing.assert_close(m.weights.double(), expected, atol=2e-5, rtol=0)
    assert torch.equal(m.weights.triu(1), torch.zeros_like(m.weights))  # no weight on the future
    torch.testing.assert_close(m.roles.mass.double(), reference_mass(expected, [False] * 7), atol=1e-5, rtol=0)
    assert float(m.roles.mass[..., 1].abs().max()) == 0.0  # a causal head never sees the next token


def test_a_gpt2_text_past_n_positions_is_cut_and_says_how_much(gpt2_dir):
    """A GPT-2 tokenizer does not truncate: the tokens past n_positions (32) are cut and counted, as transformers'
    directories are, and the maps are transformers' over the first 32."""
    text = "the cat sat on the mat . " * 5  # 35 words
    ids, tokens = tokenizer_ids(gpt2_dir, text)
    m = head_maps(gpt2_dir, text)
    assert m.cut == len(ids) - 32 == 3 and m.tokens == tuple(tokens[:32]) and m.weights.shape == (2, 4, 32, 32)
    torch.testing.assert_close(m.weights.double(), hf_attentions(gpt2_dir, "gpt2", ids[:32]), atol=2e-5, rtol=0)


def test_gpt2_special_tokens_count_as_special(gpt2_dir):
    m = head_maps(gpt2_dir, "<|endoftext|> the cat sat")
    assert m.tokens[0] == "<|endoftext|>"
    special = [True, False, False, False]
    torch.testing.assert_close(m.roles.mass.double(), reference_mass(m.weights.double(), special), atol=1e-5, rtol=0)


def test_a_text_past_the_models_limit_is_cut_and_says_how_much(minilm_dir):
    from tokenizers import Tokenizer

    text = "the cat sat on the mat " * 50  # 300 words
    whole = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    whole.no_truncation()
    whole.no_padding()
    tokens = whole.encode(text).tokens  # [CLS], 300 words, [SEP]
    m = head_maps(text=text)
    assert len(m.tokens) == 256  # sentence_bert_config.json's max_seq_length
    assert m.cut == len(tokens) - 256 == 46
    assert m.tokens == (*tokens[:255], "[SEP]") and m.weights.shape[-2:] == (256, 256)
    assert head_maps(text="the cat sat on the mat").cut == 0


def test_bad_text():
    with pytest.raises(TypeError, match=r"text must be a str \(one sentence\), got list"):
        head_maps(text=["a", "b"])
    with pytest.raises(ValueError, match=r"text must hold at least one word, got ' '"):
        head_maps(text=" ")


def test_bad_directories(tmp_path, gpt2_dir):
    with pytest.raises(FileNotFoundError, match=r"no such directory"):
        head_maps(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True}))
    with pytest.raises(ValueError, match=r"config.json: 't5' is an encoder-decoder; the heads page draws one stack of self-attention"):
        head_maps(tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((gpt2_dir / name).read_bytes())
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json: file not found \(the heads page reads the tokenizer from tokenizer.json\)"):
        head_maps(bare)
    (bare / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer.json: cannot read the tokenizer"):
        head_maps(bare)
