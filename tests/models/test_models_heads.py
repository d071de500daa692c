"""Head roles: hand-made attention maps with known answers, and the real MiniLM's heads against transformers' weights."""

from __future__ import annotations

import pytest
import torch

from headwise.models import HeadRoles, attention_mass, head_roles
from headwise.models.heads import KINDS

# Tokens: [CLS] a b c d [SEP] [PAD]   (positions 0..6)
SPECIAL = torch.tensor([[True, False, False, False, False, True, False]])
REAL = torch.tensor([[True, True, True, True, True, True, False]])


def one_hot_map(target) -> torch.Tensor:
    """(T, T) weights: query i puts all its weight on key target(i)."""
    w = torch.zeros(7, 7)
    for i in range(7):
        w[i, target(i)] = 1.0
    return w


def test_known_maps_get_their_roles():
    heads = [
        one_hot_map(lambda i: max(i - 1, 0)),  # previous token
        one_hot_map(lambda i: min(i + 1, 6)),  # next token
        one_hot_map(lambda i: i),  # itself
        one_hot_map(lambda i: 0 if i % 2 else 5),  # [CLS] or [SEP]
        torch.full((7, 7), 1 / 7),  # uniform: no role
    ]
    weights = [torch.stack(heads)[None]]  # one layer, (1, 5, 7, 7)
    mass = attention_mass(weights, SPECIAL, REAL)  # (1, 5, 4)
    # Queries averaged over: a b c d (positions 1..4). "previous" of a is [CLS] (special, not previous);
    # "next" of d is [SEP]. So heads 0 and 1 get 3/4 on their kind and 1/4 on the special tokens.
    torch.testing.assert_close(mass[0, 0], torch.tensor([0.75, 0.0, 0.0, 0.25]))
    torch.testing.assert_close(mass[0, 1], torch.tensor([0.0, 0.75, 0.0, 0.25]))
    torch.testing.assert_close(mass[0, 2], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(mass[0, 3], torch.tensor([0.0, 0.0, 0.0, 1.0]))
    torch.testing.assert_close(mass[0, 4], torch.tensor([3 / 28, 3 / 28, 1 / 7, 2 / 7]))  # 1/7 each, but a's previous and d's next are special
    roles = HeadRoles(mass)
    assert [roles.role(0, h) for h in range(5)] == [*KINDS, None]
    assert roles.heads("self") == [(0, 2, 1.0)]
    assert roles.role(0, 4, threshold=0.25) == "[CLS]/[SEP]"  # 2/7: the largest share, above this lower threshold


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"kind must be one of \['previous', 'next', 'self', '\[CLS\]/\[SEP\]'\], got 'cls'"):
        HeadRoles(torch.zeros(1, 1, 4)).heads("cls")


def test_real_minilm_roles_equal_those_from_transformers_weights(encoder, hf_bert):
    """head_roles (weights observed from headwise) = attention_mass over transformers' own weights."""
    sentences = ["The quick brown fox jumps over the lazy dog.", "Heads read from other tokens."]
    roles = head_roles(encoder, sentences)
    assert roles.mass.shape == (6, 12, 4)
    input_ids, mask = encoder.tokenize(sentences)
    with torch.no_grad():
        theirs = hf_bert(input_ids, attention_mask=mask.long(), output_attentions=True).attentions
    special = (input_ids == 101) | (input_ids == 102)
    torch.testing.assert_close(roles.mass, attention_mass(list(theirs), special, mask), atol=1e-5, rtol=0)
    assert roles.heads("previous") and roles.heads("[CLS]/[SEP]")  # MiniLM has both kinds of head


def test_sentences_of_nothing_but_cls_and_sep_are_refused(encoder):
    """Nothing to average over: refused by name (the profile was all zeros, every head "mixed")."""
    with pytest.raises(ValueError, match=r"sentences must hold a token besides \[CLS\] and \[SEP\]"):
        head_roles(encoder, ["", "   "])


def test_special_tokens_are_found_by_id_whatever_the_tokenizer_calls_them(minilm_dir, tmp_path, encoder):
    """A BERT-architecture encoder whose tokenizer names them <s> and </s> (an XLM-R tokenizer, the same ids): the same
    roles, and the heads page's too (looked up by the names [CLS] and [SEP], they were never found)."""
    from headwise.models import SentenceEncoder
    from headwise.viz import head_maps

    for f in minilm_dir.iterdir():
        if f.name != "tokenizer.json":
            (tmp_path / f.name).symlink_to(f)
    text = (minilm_dir / "tokenizer.json").read_text().replace('"[CLS]"', '"<s>"').replace('"[SEP]"', '"</s>"')
    (tmp_path / "tokenizer.json").write_text(text)
    renamed = SentenceEncoder.from_pretrained(tmp_path)
    assert renamed.special_ids == encoder.special_ids == (101, 102) and renamed.special_tokens == ("<s>", "</s>")
    sentences = ["The quick brown fox jumps over the lazy dog."]
    torch.testing.assert_close(head_roles(renamed, sentences).mass, head_roles(encoder, sentences).mass, rtol=0, atol=0)
    assert head_maps(tmp_path, sentences[0]).roles.heads("[CLS]/[SEP]")
    with pytest.raises(ValueError, match=r"text must hold a token besides \[CLS\] and \[SEP\]"):
        head_maps(minilm_dir, "\u200b")  # a text of nothing the profile reads (all zeros, every head "mixed", before)


@pytest.mark.parametrize(("threshold", "error"), [("0.5", TypeError), (float("nan"), ValueError), (1.5, ValueError)])
def test_a_threshold_outside_zero_to_one_is_named(threshold, error):
    with pytest.raises(error, match=r"threshold must be a number in \[0, 1\]"):
        HeadRoles(torch.rand(2, 3, 4)).heads("next", threshold=threshold)


UNIFORM = torch.full((1, 5, 7, 7), 1 / 7)  # one layer of the maps above: (B, H, T, T)


@pytest.mark.parametrize(
    ("weights", "special", "is_token", "error", "message"),
    [
        (UNIFORM, SPECIAL, REAL, TypeError, r"weights must be a list of L tensors \(B, H, T, T\), one per layer, got Tensor: wrap"),
        ([], SPECIAL, REAL, ValueError, r"weights must hold at least one layer's \(B, H, T, T\) tensor, got an empty list"),
        ([UNIFORM, UNIFORM.numpy()], SPECIAL, REAL, TypeError, r"weights\[1\] must be a tensor \(B, H, T, T\), got ndarray"),
        ([UNIFORM, UNIFORM.long()], SPECIAL, REAL, TypeError, r"weights\[1\] must be a floating-point tensor .* got dtype torch.int64"),
        ([UNIFORM, UNIFORM[0]], SPECIAL, REAL, ValueError, r"weights\[1\] must be \(B, H, T, T\): .* got shape \(5, 7, 7\)"),
        ([UNIFORM[..., :6]], SPECIAL, REAL, ValueError, r"weights\[0\] must be \(B, H, T, T\): .* got shape \(1, 5, 7, 6\)"),
        ([UNIFORM, UNIFORM[:, :4]], SPECIAL, REAL, ValueError, r"weights\[1\] has shape \(1, 4, 7, 7\) but weights\[0\] has \(1, 5, 7, 7\)"),
        ([UNIFORM, UNIFORM.to("meta")], SPECIAL, REAL, ValueError, r"weights\[1\] is on meta but weights\[0\] on cpu"),
        ([UNIFORM], SPECIAL.tolist(), REAL, TypeError, r"special must be a bool tensor \(B, T\), got list"),
        ([UNIFORM], SPECIAL.long(), REAL, TypeError, r"special must be a bool tensor \(B, T\), got dtype torch.int64: pass special.bool\(\)"),
        ([UNIFORM], SPECIAL, REAL.float(), TypeError, r"is_token must be a bool tensor \(B, T\), got dtype torch.float32"),
        ([UNIFORM], SPECIAL, REAL[:, :6], ValueError, r"is_token must be \(B, T\) = \(1, 7\), .* got shape \(1, 6\)"),
        ([UNIFORM], SPECIAL.expand(2, 7), REAL, ValueError, r"special must be \(B, T\) = \(1, 7\), .* got shape \(2, 7\)"),
        ([UNIFORM], SPECIAL[0], REAL, ValueError, r"special must be \(B, T\) = \(1, 7\), .* got shape \(7,\)"),
        ([UNIFORM], SPECIAL, REAL.to("meta"), ValueError, r"is_token is on meta but the weights on cpu"),
    ],
    ids=["one-tensor", "empty", "ndarray", "int-weights", "3-d", "not-square", "other-shape", "other-device",
         "list-mask", "int-mask", "float-mask", "short-mask", "other-batch", "1-d-mask", "mask-device"],
)
def test_attention_mass_names_a_bad_argument(weights, special, is_token, error, message):
    """Each was an IndexError, an error from inside torch, or (0/1 masks: ~1 is -2) numbers that meant nothing."""
    with pytest.raises(error, match=message):
        attention_mass(weights, special, is_token)


def test_role_refuses_a_layer_or_head_out_of_range_by_name():
    """As HeadMaps.role: counted from 0 (an IndexError, or a float index error from torch, named nothing)."""
    roles = HeadRoles(torch.rand(2, 3, 4))
    for (layer, head), error, message in [
        ((5, 0), ValueError, r"layer must be an int in \[0, 1\], got 5"),
        ((-1, 0), ValueError, r"layer must be an int in \[0, 1\], got -1"),
        ((0, 3), ValueError, r"head must be an int in \[0, 2\], got 3"),
        ((0, 1.0), TypeError, r"head must be an int in \[0, 2\], got 1.0"),
        (("0", 0), TypeError, r"layer must be an int in \[0, 1\], got '0'"),
    ]:
        with pytest.raises(error, match=message):
            roles.role(layer, head)
