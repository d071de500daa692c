"""Grade one learner class in this process: every configuration, then one verdict."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import hints as H
from .learner import Raised, SetupError, build, kind_of, positional, where
from .match import attempt, closest, is_scores, matching_probes, step_status
from .record import Recorder
from .reference import BOOK_CLASSES, CONFIGS, Config, book_defaults, reference
from .report import Result


@dataclass
class Outcome:
    """What happened in one configuration; ``step`` None = same output as the book."""

    config: Config
    step: str | None = None
    hints: list[str] = field(default_factory=list)
    expected: str | None = None
    got: str | None = None
    raised: Raised | None = None  # step "error": where their code raised, and what
    steps: dict[str, str] | None = None  # step -> "match" / "skipped" / "missing"
    dropout: float = 0.0  # the rate the failing configuration was built with
    again: bool = False  # failed on the second call (``_again``), the first call the book's


def grade_class(cls: type, name: str | None = None, file: str | None = None) -> Result:
    """Grade ``cls`` against the book's class of its kind in every configuration.

    Args:
        cls: the learner's class.
        name: its name in the report (default ``cls.__name__``); a book name fixes the kind.
        file: the learner's file, to point at the line where their code raised.

    Example:
        >>> from headwise.teaching import MultiHeadAttention
        >>> grade_class(MultiHeadAttention).passed
        True
    """
    name = name or cls.__name__
    try:
        kind = kind_of(name, cls)
    except (Exception, SystemExit) as e:
        raised = where(e, file)
        return Result(name, "unknown", False, "error", error=raised.error, line=raised.line, code=raised.code)
    guessed = name not in BOOK_CLASSES  # the kind read from the signature (kind_of): the report says so where it matters
    outcomes = [_try(cls, kind, config, file, guessed) for config in CONFIGS[kind]]
    if all(o.step is None for o in outcomes):  # the numbers are the book's: then its dropout, where the numbers tell
        outcomes.append(_dropout(cls, kind, CONFIGS[kind][0], file))
    return _verdict(name, kind, outcomes)


DROPOUT = 0.5  # the rate the dropout check builds with: half the weights dropped in training
DROPOUT_AGAIN = 0.25  # and a second: a class keeping a rate of its own (the book's demo nn.Dropout(0.5)) fails there
DROPOUT_SEED = 7  # the seed both train() passes draw their masks under


def _dropout(cls: type, kind: str, config: Config, file: str | None) -> Outcome:
    """Built with dropout, in eval() mode the output must be the book's (no dropout there); in train() mode, under the
    same seed, the book's own (its nn.Dropout on the attention weights draws the same mask as the learner's there);
    at two rates, so that a rate of the class's own fails."""
    for rate in (DROPOUT, DROPOUT_AGAIN):
        if (outcome := _dropout_at(cls, kind, config, file, rate)).step is not None:
            return outcome
    return Outcome(config)


def _dropout_at(cls: type, kind: str, config: Config, file: str | None, rate: float) -> Outcome:
    ref = reference(kind, config)
    try:
        module = build(cls, kind, config, ref.state, rate)
        x = _input(ref.x, module)  # (B, T, d_in)
        with torch.no_grad():
            evaluated = module(x)
            trained = _seeded(module.train(), x)
    except (Exception, SystemExit) as e:
        raised = where(e, file)
        return Outcome(config, "error", raised=Raised(raised.line, raised.code, f"with dropout={rate}: {raised.error}"), dropout=rate)
    want = ref.output
    if not _same(evaluated, want):
        expected, got = _show([evaluated.detach()] if isinstance(evaluated, Tensor) else [], want, False)
        return Outcome(config, "dropout", [H.DROPOUT_IN_EVAL], expected, got, dropout=rate)
    book = _book(kind, config, ref.state, x, rate)
    with torch.no_grad():
        want_trained = _seeded(book.train(), x).double()
    if _same(trained, want_trained):
        return Outcome(config)
    hint = H.DROPOUT_NEVER if _same(trained, want) else H.DROPOUT_ELSEWHERE
    return Outcome(config, "dropout", [hint], _row(want_trained, 0), _row(trained.detach(), 0) if isinstance(trained, Tensor) else None,
                   dropout=rate)


def _book(kind: str, config: Config, state: dict, x: Tensor, rate: float) -> torch.nn.Module:
    """The book's class of ``kind`` built as ``config`` with dropout ``rate``, the reference's weights, as x's dtype and device."""
    with book_defaults():
        book = BOOK_CLASSES[kind](*config.args(kind, rate), backend="math")
    book = book.to(device=x.device, dtype=x.dtype)  # as the learner's x
    book.load_state_dict(state)
    return book


def _guessed(cls: type) -> str:
    """What the kind was read from, for a class whose name is not the book's: its signature."""
    heads = "a" if "num_heads" in inspect.signature(cls.__init__).parameters else "no"
    return f" (the kind read from its signature: {len(positional(cls))} positional arguments, {heads} num_heads)"


def _seeded(module: torch.nn.Module, x: Tensor) -> object:
    """``module(x)`` under a fixed seed, the global RNG left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(DROPOUT_SEED)
        return module(x)


def _same(out: object, want: Tensor) -> bool:
    """``out`` a tensor of ``want``'s shape and numbers (float32's rounding); NaN never equal."""
    return isinstance(out, Tensor) and out.shape == want.shape and torch.allclose(out.detach().double().cpu(), want, rtol=1e-4, atol=1e-5)


def _input(x: Tensor, module: torch.nn.Module) -> Tensor:
    """The book's batch (B, T, d_in) in the dtype of the learner's parameters and on their device (float32 where it
    has none): a file that sets ``torch.set_default_dtype(torch.float64)`` builds a float64 class, and gets float64 x."""
    p = next((t for t in module.parameters() if t.is_floating_point()), None)
    if p is None:
        return x.float()
    if p.is_meta:
        raise SetupError("its parameters are on the meta device, which holds no numbers (a torch.set_default_device('meta') "
                         "left on in the file?): build it on the CPU to grade it")
    return x.to(device=p.device, dtype=p.dtype)


def _try(cls: type, kind: str, config: Config, file: str | None, guessed: bool = False) -> Outcome:
    ref = reference(kind, config)
    try:
        module = build(cls, kind, config, ref.state)
    except SetupError as e:
        return Outcome(config, "error", raised=Raised(None, None, str(e)))
    except (Exception, SystemExit) as e:
        raised = where(e, file)
        return Outcome(config, "error", raised=Raised(raised.line, raised.code, f"while building it as the book's {kind} is built{_guessed(cls) if guessed else ''}: {raised.error}"))
    try:
        x = _input(ref.x, module)  # (B, T, d_in)
    except SetupError as e:
        return Outcome(config, "error", raised=Raised(None, None, str(e)))
    try:
        with torch.no_grad(), Recorder() as rec:
            out = module(x)
    except (Exception, SystemExit) as e:  # sys.exit() in forward is the learner's mistake, not the grader's end
        return Outcome(config, "error", raised=where(e, file))
    want = ref.output
    if _same(out, want):
        return _again(module, kind, config, ref.state, x, file)
    records = [*rec.tensors, out.detach()] if isinstance(out, Tensor) else rec.tensors
    status = step_status(records, ref.steps)
    step = next((name for name, s in status.items() if s == "missing"), None)
    if step is None and isinstance(out, Tensor) and out.shape == want.shape:  # the right output computed, then changed
        expected, got = _show([out.detach()], want, False)
        return Outcome(config, "output", [H.CHANGED_AFTER], expected, got, steps=status)
    if step is None:  # every step is there, the output too: only what forward returns is off
        hint = H.WRONG_SHAPE if isinstance(out, Tensor) else H.NOT_RETURNED if out is None else H.NOT_A_TENSOR
        return Outcome(config, "output", [hint], _row(want, 0), _returned(out, want), steps=status)
    matched = matching_probes(records, out, H.probes(kind, ref, config), step)
    outcome = Outcome(config, step, H.narrow([p.hint for p, _ in matched]), steps=status)
    shown = next((t for p, t in matched if p.same_kind and t.shape == ref.steps[step].shape), None)
    if shown is None and (tried := attempt(records, ref.steps, step)) is not None:
        shown = tried  # the record the learner made for this step, not whichever other lies closest
    outcome.expected, outcome.got = _show(records if shown is None else [shown], ref.steps[step], is_scores(step))
    if step == "output" and not (isinstance(out, Tensor) and out.shape == want.shape):
        outcome.got = _returned(out, want)
    return outcome


def _again(module: torch.nn.Module, kind: str, config: Config, state: dict, x: Tensor, file: str | None) -> Outcome:
    """The same module called again with one token fewer must give the book's output for that input: something kept
    from the first call (a mask made at its length) would not."""
    shorter = x[:, : x.shape[1] - 1]  # (B, T - 1, d_in)
    if shorter.shape[1] == 0:
        return Outcome(config)
    with torch.no_grad():
        want = _book(kind, config, state, x, 0.0).eval()(shorter).double()
        try:
            out = module(shorter)
        except (Exception, SystemExit) as e:
            raised = where(e, file)
            return Outcome(config, "error", [H.SECOND_CALL], again=True,
                           raised=Raised(raised.line, raised.code, f"on a second call with {shorter.shape[1]} tokens: {raised.error}"))
    if _same(out, want):
        return Outcome(config)
    return Outcome(config, "output", [H.SECOND_CALL], _row(want, 0), _row(out.detach(), 0) if isinstance(out, Tensor) else None, again=True)


def _returned(out: object, want: Tensor) -> str:
    got = f"shape {tuple(out.shape)}" if isinstance(out, Tensor) else f"a {type(out).__name__}"
    return f"forward returned {got}; the book's returns shape {tuple(want.shape)}"


def _verdict(name: str, kind: str, outcomes: list[Outcome]) -> Result:
    """Pass when every configuration matched; else the first failure, with the hints every failure at that step shares."""
    failed = [o for o in outcomes if o.step is not None]
    if not failed:
        return Result(name, kind, True, configs=len(CONFIGS[kind]))
    first_calls = [o for o in failed if not o.again]  # (a call with fewer tokens fails a second call for the same reasons)
    first = (first_calls or failed)[0]
    if first.again:
        hint = first.hints[0] if first.hints else None
    elif first.step == "error":  # not cutting the mask raises exactly when num_tokens < context_length
        short = [o for o in outcomes if o.config.num_tokens < o.config.context_length]
        hint = H.MASK_NOT_CUT if first_calls == short else None
    else:
        shared = [h for h in first.hints if all(h in o.hints for o in failed if o.step == first.step)]
        hint = "; or ".join(shared) or None  # a mistake whose tensor another failing configuration does not show is not it
    line, code, error = (first.raised.line, first.raised.code, first.raised.error) if first.raised else (None, None, None)
    described = first.config.describe(name, kind, first.dropout)
    return Result(name, kind, False, first.step, hint, described, first.expected, first.got, error, len(CONFIGS[kind]), first.steps, line, code)


def _show(records: list[Tensor], want: Tensor, scale_free: bool) -> tuple[str, str]:
    """Expected and closest, each as its shape and the one row where they differ most."""
    got = closest(records, want, scale_free)
    if got is None:
        return _row(want, None), f"no tensor with {want.numel()} numbers"
    rows_want, rows_got = want.reshape(-1, want.shape[-1]), got.reshape(-1, want.shape[-1])
    diff = (rows_want - rows_got).abs().nan_to_num(nan=float("inf"), posinf=1e30).sum(-1)  # inf - inf gives nan
    diff = diff.masked_fill(torch.isclose(rows_want, rows_got, equal_nan=True).all(-1), 0.0)
    row = int(diff.argmax())
    return _row(want, row), _row(got, row)


def _row(t: Tensor, row: int | None) -> str:
    """``shape (2, 6, 2), [0, 3, :] = [0.1234, -inf]``: one row of the last dim."""
    if row is None:
        row = 0
    index = list(torch.unravel_index(torch.tensor(row), t.shape[:-1])) if t.ndim > 1 else []
    values = t.reshape(-1, t.shape[-1])[row][:8].tolist()
    shown = ", ".join("-inf" if v == float("-inf") else f"{v:.4f}" for v in values) + (", ..." if t.shape[-1] > 8 else "")
    at = ", ".join(str(int(i)) for i in index)
    return f"shape {tuple(t.shape)}, [{at + ', ' if at else ''}:] = [{shown}]"
