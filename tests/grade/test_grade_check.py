"""Grading in this process: every correct style passes, every known mistake fails at its step with its hint.

The learner files in ``learners/`` are independent implementations written for these tests;
the book's own package (``llms_from_scratch.ch03``) is a second, outside oracle.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llms_from_scratch import ch03 as book
from torch import nn

from headwise.grade import grade
from headwise.grade import hints as H
from headwise.grade.check import Outcome, _verdict, grade_class
from headwise.grade.learner import find_classes, load
from headwise.grade.reference import CONFIGS, reference
from headwise.grade.report import Report, Result

LEARNERS = Path(__file__).parent / "learners"


def grade_here(stem: str) -> dict[str, Result]:
    """Grade ``learners/<stem>.py`` in this process, as the grading subprocess does."""
    module = load(str(LEARNERS / f"{stem}.py"))
    return {name: grade_class(cls, name, module.__file__) for name, cls in find_classes(module, None)}


@pytest.mark.parametrize("stem", ["book", "einsum", "reshape", "fused_qkv"])
def test_every_correct_style_passes(stem):
    results = grade_here(stem)
    assert results and all(r.passed and r.step is None and r.hint is None for r in results.values()), results
    assert all(r.configs == len(CONFIGS[r.kind]) for r in results.values())


@pytest.mark.slow
def test_the_books_own_classes_pass():
    report = grade([book.CausalAttention, book.MultiHeadAttentionWrapper, book.MultiHeadAttention])  # one grading process
    assert report.exit_code == 0, report.to_text()
    assert [(r.name, r.kind, r.passed) for r in report.results] == [(n, n, True) for n in ("CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention")]


MISTAKES = {
    "no_scaling": ("MultiHeadAttention", "weights", H.NO_SCALE),
    "scale_d_in": ("MultiHeadAttention", "weights", H.WRONG_SCALE.format(size="d_in")),
    "scale_d_out": ("MultiHeadAttention", "weights", H.WRONG_SCALE.format(size="d_out")),
    "scale_num_heads": ("MultiHeadAttention", "weights", H.WRONG_SCALE.format(size="num_heads")),
    "softmax_dim": ("MultiHeadAttention", "weights", H.SOFTMAX_DIM.format(what="the queries", dim=2, layout="(b, num_heads, num_tokens, num_tokens)")),
    "causal_softmax_dim": ("CausalAttention", "weights", H.SOFTMAX_DIM.format(what="the queries", dim=1, layout="(b, num_tokens, num_tokens)")),
    "mask_missing": ("MultiHeadAttention", "masked_scores", H.NO_MASK),
    "mask_after_softmax": ("MultiHeadAttention", "masked_scores", H.MASK_AFTER),
    "mask_discarded": ("MultiHeadAttention", "weights", H.MASK_DISCARDED),
    "mask_diagonal": ("MultiHeadAttention", "masked_scores", H.MASK_DIAGONAL),
    "mask_tril": ("MultiHeadAttention", "masked_scores", H.MASK_PAST),
    "scale_num_tokens": ("MultiHeadAttention", "weights", H.WRONG_SCALE.format(size="num_tokens")),
    "scale_num_tokens:CausalAttention": ("CausalAttention", "weights", H.WRONG_SCALE.format(size="num_tokens")),  # the same file's head
    "mask_not_cut": ("MultiHeadAttention", "error", H.MASK_NOT_CUT),
    "view_no_transpose": ("MultiHeadAttention", "queries.transpose", H.NO_TRANSPOSE.format(name="queries")),
    "view_then_reshape": ("MultiHeadAttention", "queries.transpose", H.NO_TRANSPOSE.format(name="queries")),  # the view not an excuse
    "swapped_qk": ("MultiHeadAttention", "scores", H.SWAPPED),
    "merge_no_transpose": ("MultiHeadAttention", "merged", H.MERGE_NO_TRANSPOSE),
    "no_out_proj": ("MultiHeadAttention", "output", H.NO_OUT_PROJ),
    "shared_qk": ("MultiHeadAttention", "queries", H.SHARED_QK.format(got="queries", other="keys")),
    "shared_qk_once:CausalAttention": ("CausalAttention", "queries", H.SHARED_QK.format(got="queries", other="keys")),  # made once
    "shared_qk_once": ("MultiHeadAttention", "keys", H.SHARED_QK.format(got="keys", other="queries")),
    "wrapper_cat_dim": ("MultiHeadAttentionWrapper", "output", H.CAT_DIM.format(dim=1, what="the tokens")),
    "wrapper_no_scaling": ("MultiHeadAttentionWrapper", "heads.0.weights", H.NO_SCALE),
    "wrong_shape": ("MultiHeadAttention", "output", H.WRONG_SHAPE),
    "wrapper_shared_head": ("MultiHeadAttentionWrapper", "heads.0.queries", H.SHARED_HEADS),
    "out_proj_no_bias": ("MultiHeadAttention", "output", H.NO_OUT_PROJ_BIAS),
    "qkv_bias_ignored": ("MultiHeadAttention", "queries", H.NO_QKV_BIAS),
    "qkv_bias_ignored:CausalAttention": ("CausalAttention", "queries", H.NO_QKV_BIAS),  # the same file's head
}


@pytest.mark.parametrize("stem", list(MISTAKES))
def test_each_mistake_fails_at_its_step_with_its_hint(stem):
    name, step, hint = MISTAKES[stem]
    r = grade_here(stem.split(":")[0])[name]
    assert (r.passed, r.step, r.hint) == (False, step, hint)
    assert r.config.startswith(name + "(")
    if step != "error":
        assert r.expected.startswith("shape (") and r.got.startswith(("shape (", "forward returned shape"))


def test_queries_wrong_on_their_own_get_no_hint_and_show_the_learners_queries():
    """Every learner's right keys equal the book's keys: only keys made twice (one layer in both roles) say so. The
    "got" row is the learner's queries (the book's, tokens reversed), not their right keys made just before them."""
    r = grade_here("queries_flipped")["MultiHeadAttention"]
    assert (r.passed, r.step, r.hint) == (False, "queries", None)
    flipped = reference("MultiHeadAttention", CONFIGS["MultiHeadAttention"][0]).steps["queries"].flip(1)  # (2, 6, 2)
    row = r.got.split(" = ")[0].split(", [")[1]  # "0, 0, :]": the row shown
    b, t = (int(i) for i in row.split(", ")[:2])
    assert r.got.endswith(" = [" + ", ".join(f"{v:.4f}" for v in flipped[b, t].tolist()) + "]"), r.got


def test_a_mistake_in_one_class_leaves_the_others_passing():
    results = grade_here("wrapper_cat_dim")
    assert results["CausalAttention"].passed and not results["MultiHeadAttentionWrapper"].passed
    assert "forward returned shape (2, 12, 2); the book's returns shape (2, 6, 4)" in results["MultiHeadAttentionWrapper"].got


def test_the_hints_tell_every_mistake_apart():
    # five pairs of files share a hint: NO_SCALE (MHA and a wrapper's head), sqrt(num_tokens) (MHA and a single head),
    # NO_TRANSPOSE (a view straight to the heads' shape, and the right view reshaped to it), NO_QKV_BIAS (MHA and a head),
    # SHARED_QK for the queries (one layer called twice, and one tensor made once in both roles)
    assert len({hint for _, _, hint in MISTAKES.values()}) == len(MISTAKES) - 5


def test_a_scaling_mistake_invisible_at_head_dim_1_fails_in_a_later_configuration():
    r = grade_here("no_scaling")["MultiHeadAttention"]  # the book's config has head_dim 1: sqrt(1) == 1
    assert r.config == "MultiHeadAttention(5, 12, 9, 0.0, 3, True) on x of shape (3, 7, 5)"


def test_a_crash_points_at_the_learners_own_line():
    r = grade_here("crash")["MultiHeadAttention"]
    assert (r.step, r.hint, r.line, r.code) == ("error", None, "crash.py:31", "attn_scores = queries @ self.keys.transpose(2, 3)")
    assert r.error == "AttributeError: 'MultiHeadAttention' object has no attribute 'keys'"
    text = Report("crash.py", [r]).to_text().splitlines()
    assert text[2] == "MultiHeadAttention: FAIL at crash.py:31"  # the line, not a step named "error"
    assert "  code:         attn_scores = queries @ self.keys.transpose(2, 3)" in text
    r = grade_here("mask_not_cut")["MultiHeadAttention"]
    assert r.line == "mask_not_cut.py:32" and r.error.startswith("RuntimeError")
    assert r.config == "MultiHeadAttention(5, 12, 9, 0.0, 3, True) on x of shape (3, 7, 5)"  # tokens 7 < context_length 9


# ----------------------------------------------------------------------------- kinds and weights


class RenamedMHA(book.MultiHeadAttention):
    """A book class under another name: graded by its signature."""


class RenamedWrapper(book.MultiHeadAttentionWrapper):
    pass


class RenamedHead(book.CausalAttention):
    pass


@pytest.mark.parametrize(("cls", "kind"), [(RenamedMHA, "MultiHeadAttention"), (RenamedWrapper, "MultiHeadAttentionWrapper"), (RenamedHead, "CausalAttention")])
def test_a_class_under_another_name_is_graded_as_the_kind_its_signature_fits(cls, kind):
    r = grade_class(cls)
    assert (r.name, r.kind, r.passed) == (cls.__name__, kind, True)


class ReorderedHead(nn.Module):
    """Layers created value, key, query (the book: query, key, value) under other common names,
    with an extra attribute: graded all the same."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.v_proj = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.k_proj = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.q_proj = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.scale = d_out**-0.5
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        t = x.shape[1]
        scores = (self.q_proj(x) @ self.k_proj(x).transpose(1, 2)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
        return self.drop(torch.softmax(scores * self.scale, dim=-1)) @ self.v_proj(x)


def test_weights_go_in_by_name_not_by_creation_order():
    assert grade_class(ReorderedHead, "CausalAttention").passed


class BareQuery(nn.Module):
    """The book's first self-attention style: bare (d_in, d_out) Parameters used as ``x @ W``; no bias."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_query, self.W_key, self.W_value = (nn.Parameter(torch.rand(d_in, d_out)) for _ in range(3))

    def forward(self, x):
        t = x.shape[1]
        scores = (x @ self.W_query) @ (x @ self.W_key).transpose(1, 2)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
        return torch.softmax(scores / self.W_key.shape[-1] ** 0.5, dim=-1) @ (x @ self.W_value)


def test_a_bare_parameter_is_the_books_x_at_w():
    r = grade_class(BareQuery, "CausalAttention")
    assert (r.step, r.config) == ("queries", "CausalAttention(5, 4, 9, 0.0, True) on x of shape (3, 7, 5)")  # only with qkv_bias


class Unnamed(ReorderedHead):
    def __init__(self, *args):
        super().__init__(*args)
        self.mix = nn.Linear(args[1], args[1])


def test_a_weight_with_an_unknown_name_is_reported_not_guessed():
    r = grade_class(Unnamed, "CausalAttention")
    assert r.step == "error" and r.error.startswith("cannot tell which of the book's weights parameter mix.weight (shape (2, 2)) is")


class WrongWidth(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out // num_heads)

    def forward(self, x):
        return self.W_query(x)


def test_a_mis_shaped_weight_is_named_with_both_shapes():
    r = grade_class(WrongWidth, "MultiHeadAttention")
    assert r.step == "error" and r.error == "parameter W_query.weight has shape (1, 3); the book's W_query has (2, 3)"


def test_causal_reference_steps_are_the_plain_computation():
    config = CONFIGS["CausalAttention"][1]
    ref = reference("CausalAttention", config)
    x, w = ref.x, ref.state
    q, k, v = (x @ w[f"W_{n}.weight"].T + w[f"W_{n}.bias"] for n in ("query", "key", "value"))
    scores = q @ k.transpose(1, 2)
    masked = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    weights = torch.softmax(masked / config.d_out**0.5, dim=-1)
    for name, want in {"queries": q, "scores": scores, "masked_scores": masked, "weights": weights, "output": weights @ v}.items():
        torch.testing.assert_close(ref.steps[name], want, msg=name)


VARIANTS = {  # (file, its line, the line with another mistake) -> (class, step, hint)
    "softmax-over-heads": (("softmax_dim", "0.5, dim=-2)", "0.5, dim=1)"), ("MultiHeadAttention", "weights", H.SOFTMAX_DIM.format(
        what="the heads", dim=1, layout="(b, num_heads, num_tokens, num_tokens)"))),
    "softmax-over-batch": (("softmax_dim", "0.5, dim=-2)", "0.5, dim=0)"), ("MultiHeadAttention", "weights", H.SOFTMAX_DIM.format(
        what="the batch", dim=0, layout="(b, num_heads, num_tokens, num_tokens)"))),
    "divided-by-head_dim": (("softmax_dim", "** 0.5, dim=-2)", ", dim=-1)"), ("MultiHeadAttention", "weights", H.NOT_SQRT)),
    "values-not-transposed": (
        ("no_scaling", "values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)",
         "values = values.view(b, self.num_heads, num_tokens, self.head_dim)"),
        ("MultiHeadAttention", "values.transpose", H.NO_TRANSPOSE.format(name="values"))),
    "cat-on-the-batch": (("wrapper_cat_dim", "], dim=1)", "], dim=0)"), ("MultiHeadAttentionWrapper", "output", H.CAT_DIM.format(dim=0, what="the batch"))),
    "mask-with-zero": (("book", "attn_scores.masked_fill_(mask_bool, -torch.inf)", "attn_scores.masked_fill_(mask_bool, 0)"),
                       ("MultiHeadAttention", "masked_scores", H.MASK_ZERO)),
    "mask-by-multiplying": (("book", "attn_scores.masked_fill_(mask_bool, -torch.inf)", "attn_scores = attn_scores * ~mask_bool"),
                            ("MultiHeadAttention", "masked_scores", H.MASK_ZERO)),
    "head-mask-with-zero": (("book", "[:num_tokens, :num_tokens], -torch.inf)", "[:num_tokens, :num_tokens], 0.0)"),
                            ("CausalAttention", "masked_scores", H.MASK_ZERO)),
    "merged-after-transpose-2-3": (("book", "context_vec = (attn_weights @ values).transpose(1, 2)", "context_vec = (attn_weights @ values).transpose(2, 3)"),
                                   ("MultiHeadAttention", "merged", H.MERGE_TRANSPOSE_23)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_more_mistakes_from_one_edited_line(variant, tmp_path):
    (stem, old, new), (name, step, hint) = VARIANTS[variant]
    source = (LEARNERS / f"{stem}.py").read_text()
    assert source.count(old) == 1
    path = tmp_path / f"{variant}.py"
    path.write_text(source.replace(old, new))
    module = load(str(path))
    r = grade_class(getattr(module, name), name, str(path))
    assert (r.passed, r.step, r.hint) == (False, step, hint)


def test_a_hint_another_failing_configuration_does_not_show_is_not_given():
    """At head_dim 1 two merge mistakes give the same numbers: a hint must hold in every configuration that fails there."""
    first, second = CONFIGS["MultiHeadAttention"][:2]
    outcomes = [Outcome(first, "merged", [H.MERGE_NO_TRANSPOSE, H.MERGE_TRANSPOSE_23]), Outcome(second, "merged", [H.MERGE_TRANSPOSE_23])]
    assert _verdict("MultiHeadAttention", "MultiHeadAttention", outcomes).hint == H.MERGE_TRANSPOSE_23
    outcomes = [Outcome(first, "merged", [H.MERGE_NO_TRANSPOSE]), Outcome(second, "merged", [])]
    assert _verdict("MultiHeadAttention", "MultiHeadAttention", outcomes).hint is None


class DropoutAlwaysOn(nn.Module):
    """The book's head with F.dropout(weights, p): training=True by default, so it drops in eval() too."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_query, self.W_key, self.W_value = (nn.Linear(d_in, d_out, bias=qkv_bias) for _ in range(3))
        self.p = dropout

    def forward(self, x):
        t = x.shape[1]
        scores = (self.W_query(x) @ self.W_key(x).transpose(1, 2)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
        return torch.nn.functional.dropout(torch.softmax(scores / self.W_key.out_features**0.5, dim=-1), self.p) @ self.W_value(x)


class NoDropout(DropoutAlwaysOn):
    def forward(self, x):
        t = x.shape[1]
        scores = (self.W_query(x) @ self.W_key(x).transpose(1, 2)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
        return torch.softmax(scores / self.W_key.out_features**0.5, dim=-1) @ self.W_value(x)


class ChangedAfter(NoDropout):
    def __init__(self, *args):
        super().__init__(*args)
        self.dropout = nn.Dropout(args[3])

    def forward(self, x):
        t = x.shape[1]
        scores = (self.W_query(x) @ self.W_key(x).transpose(1, 2)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
        return torch.tanh(self.dropout(torch.softmax(scores / self.W_key.out_features**0.5, dim=-1)) @ self.W_value(x))


class DropoutBeforeSoftmax(ChangedAfter):
    """Dropout on the masked scores: -inf * 0 gives NaN rows in train() mode."""

    def forward(self, x):
        t = x.shape[1]
        scores = (self.W_query(x) @ self.W_key(x).transpose(1, 2)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
        return torch.softmax(self.dropout(scores) / self.W_key.out_features**0.5, dim=-1) @ self.W_value(x)


class DropoutOnOutput(ChangedAfter):
    def forward(self, x):
        return self.dropout(NoDropout.forward(self, x))


class DropoutAtItsOwnRate(ChangedAfter):
    """nn.Dropout(0.1) where the book builds nn.Dropout(dropout)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        t = x.shape[1]
        scores = (self.W_query(x) @ self.W_key(x).transpose(1, 2)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
        return self.dropout(torch.softmax(scores / self.W_key.out_features**0.5, dim=-1)) @ self.W_value(x)


@pytest.mark.parametrize(("cls", "step", "hint"), [
    (DropoutAlwaysOn, "dropout", "the output changes in eval() mode"),
    (NoDropout, "dropout", "dropout is never applied"),
    (DropoutBeforeSoftmax, "dropout", "dropout is applied somewhere else or at another rate"),
    (DropoutOnOutput, "dropout", "dropout is applied somewhere else or at another rate"),
    (DropoutAtItsOwnRate, "dropout", "dropout is applied somewhere else or at another rate"),
    (ChangedAfter, "output", "the right output was computed, then changed before forward returned it"),
])
def test_dropout_and_a_changed_output_are_told_apart(cls, step, hint):
    result = grade_class(cls, "CausalAttention")
    assert not result.passed and result.step == step and hint in result.hint
    if step == "dropout":
        assert "CausalAttention(3, 2, 6, 0.5, False)" in result.config


def test_a_bias_the_book_lacks_is_named():
    class Biased(ReorderedHead):
        def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
            super().__init__(d_in, d_out, context_length, dropout, True)  # bias=qkv_bias forgotten

    result = grade_class(Biased, "CausalAttention")
    assert not result.passed and "proj.bias is a bias the book's W_" in result.error and "does not have here (qkv_bias=False)" in result.error


def test_a_class_built_as_the_kind_its_signature_gave_says_so():
    """A renamed multi-head class whose head count is not called num_heads is taken for a single head: the report says why."""

    class MyAttn(nn.Module):
        def __init__(self, d_in, d_out, context_length, dropout, n_heads):
            super().__init__()
            self.head_dim = d_out // n_heads

    result = grade_class(MyAttn)
    assert not result.passed and result.kind == "CausalAttention"
    assert "while building it as the book's CausalAttention is built (the kind read from its signature: 5 positional arguments, no num_heads)" in result.error
    named = grade_class(MyAttn, "CausalAttention")  # a book name fixes the kind: nothing read from the signature
    assert "while building it as the book's CausalAttention is built: " in named.error


def test_the_got_row_is_the_learners_try_at_the_step_not_a_later_tensor():
    """A learner whose scores are off (heads flipped before the product): "got" shows their scores, not their weights
    (a row of a causal softmax, [1, 0, ...], that lay closer by count)."""
    r = grade_here("heads_flipped")["MultiHeadAttention"]
    assert r.step == "scores" and not r.got.endswith("[1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000]")
    assert r.got == "shape (2, 2, 6, 6), [0, 0, 0, :] = [-0.2276, -0.3453, -0.3421, -0.1899, -0.1881, -0.2335]"


@pytest.mark.parametrize(("returned", "hint"), [("", H.NOT_RETURNED), ("context_vec, attn_weights", H.NOT_A_TENSOR)])
def test_a_forward_that_returns_no_tensor_gets_a_hint_that_says_so(returned, hint, tmp_path):
    """Every step right, then ``return`` forgotten (None) or a tuple returned: not the wrong-shape hint."""
    lines = (LEARNERS / "book.py").read_text().splitlines()
    assert lines[26].strip() == "return context_vec"  # CausalAttention's
    lines[26] = lines[26].replace("return context_vec", f"return {returned}".rstrip())
    path = tmp_path / "no_tensor.py"
    path.write_text("\n".join(lines) + "\n")
    r = grade_class(load(str(path)).CausalAttention, "CausalAttention", str(path))
    assert (r.passed, r.step, r.hint) == (False, "output", hint)


def test_a_file_that_sets_torchs_defaults_is_graded_in_them(tmp_path):
    """A learner's float64 default (lecture notes print float64) builds a float64 class, fed float64 input: it passes;
    the book's reference is built in float32 on the CPU whatever the file set. A meta default device is named."""
    source = (LEARNERS / "book.py").read_text()
    path = tmp_path / "float64.py"
    path.write_text("import torch\ntorch.set_default_dtype(torch.float64)\n" + source)
    try:
        results = {name: grade_class(cls, name, str(path)) for name, cls in find_classes(load(str(path)), None)}
    finally:
        torch.set_default_dtype(torch.float32)
    assert results and all(r.passed for r in results.values()), results
    path = tmp_path / "meta.py"
    path.write_text(source + "\ntorch.set_default_device('meta')\n")
    try:
        r = grade_class(load(str(path)).MultiHeadAttention, "MultiHeadAttention", str(path))
    finally:
        torch.set_default_device(None)
    assert not r.passed and "its parameters are on the meta device" in r.error, r
    assert getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None) is None  # no device mode left on the process


def test_a_class_named_twice_is_graded_once_and_an_empty_path_is_refused():
    report = grade(str(LEARNERS / "book.py"), classes=["CausalAttention", "CausalAttention"])
    assert [r.name for r in report.results] == ["CausalAttention"] and report.results[0].passed
    with pytest.raises(ValueError, match=r"path_or_class must name a file \(\.py or \.ipynb\), a folder or a module, got ''"):
        grade("")


class DropoutOfItsOwnHalf(ChangedAfter):
    """nn.Dropout(0.5), the book's demo rate, whatever dropout it is given: the train() check at one rate passed it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return DropoutAtItsOwnRate.forward(self, x)


class MaskOfTheFirstCall(NoDropout):
    """The mask made at the first call's number of tokens and kept: a second, shorter call fails."""

    def __init__(self, *args):
        super().__init__(*args)
        self.mask = None

    def forward(self, x):
        t = x.shape[1]
        if self.mask is None:
            self.mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = (self.W_query(x) @ self.W_key(x).transpose(1, 2)).masked_fill(self.mask, -torch.inf)
        return torch.softmax(scores / self.W_key.out_features**0.5, dim=-1) @ self.W_value(x)


def test_a_rate_of_its_own_and_a_mask_kept_from_the_first_call_fail():
    own = grade_class(DropoutOfItsOwnHalf, "CausalAttention")
    assert not own.passed and own.step == "dropout" and "CausalAttention(3, 2, 6, 0.25, False)" in own.config
    kept = grade_class(MaskOfTheFirstCall, "CausalAttention")
    assert not kept.passed and kept.error.startswith("on a second call with") and "called again with one token fewer" in kept.hint


class MaskAsParameter(ChangedAfter):
    """The book's head, its mask an nn.Parameter that trains nothing where the book registers a buffer: correct."""

    def __init__(self, *args):
        super().__init__(*args)
        self.mask = nn.Parameter(torch.ones(args[2], args[2]).triu(1), requires_grad=False)

    def forward(self, x):
        t = x.shape[1]
        scores = (self.W_query(x) @ self.W_key(x).transpose(1, 2)).masked_fill(self.mask.bool()[:t, :t], -torch.inf)
        return self.dropout(torch.softmax(scores / self.W_key.out_features**0.5, dim=-1)) @ self.W_value(x)


def test_a_mask_kept_as_a_parameter_that_trains_nothing_passes():
    result = grade_class(MaskAsParameter, "CausalAttention")
    assert result.passed, (result.step, result.error)
