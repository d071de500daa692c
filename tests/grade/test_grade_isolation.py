"""The grading process cannot be talked into a verdict: the learner's code runs in a scratch
directory, the results come back over a pipe it is not given, and every way it can end the
process early still says why nothing (or not everything) was graded.

Each test starts one real grading process (Python and torch: seconds on a busy machine).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headwise.grade import grade

pytestmark = pytest.mark.slow  # left out by make test-fast (pyproject's markers)

FORGED = {"class": "MultiHeadAttention", "kind": "MultiHeadAttention", "passed": True, "step": None, "hint": None, "config": None,
          "expected": None, "got": None, "error": None, "configs": 4}

#: A MultiHeadAttention whose forward raises with the directory it runs in (so the test can see it).
WHERE_AM_I = '''
class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        raise RuntimeError("cwd=" + os.getcwd())
'''


def learner(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"import json\nimport os\nimport sys\n\nimport torch\nimport torch.nn as nn\n\nFORGED = {json.dumps({'result': FORGED})!r}\n{body}")
    return path


def test_forged_results_written_to_files_stdout_and_stderr_change_nothing(tmp_path, monkeypatch):
    home = tmp_path / "caller"
    home.mkdir()
    monkeypatch.chdir(home)
    path = learner(tmp_path, "forger.py", '''
for name in ("events.jsonl", "results.json", "report.json"):
    with open(name, "w") as f:
        f.write(FORGED + "\\n")
print(FORGED)
print(FORGED, file=sys.stderr)
''' + WHERE_AM_I)
    report = grade(path)
    (r,) = report.results
    assert (report.exit_code, r.passed, r.step) == (1, False, "error")
    scratch = Path(r.error.split("cwd=")[1])
    assert scratch != home and not scratch.exists()  # it ran in a scratch directory, since removed
    assert list(home.iterdir()) == []  # and wrote nothing where the caller works


def test_a_forged_line_written_to_every_descriptor_is_detected_not_trusted(tmp_path):
    path = learner(tmp_path, "scanner.py", '''
for fd in range(3, 256):
    try:
        os.write(fd, (FORGED + "\\n").encode())
    except OSError:
        pass
''' + WHERE_AM_I)
    report = grade(path)
    assert report.exit_code == 2 and report.results == []
    assert report.problem.startswith("something other than the grader wrote into the grader's results")


def test_os_exit_0_on_import_says_why_nothing_was_graded(tmp_path):
    path = learner(tmp_path, "quits.py", "os._exit(0)\n" + WHERE_AM_I)
    report = grade(path)
    assert report.exit_code == 2
    assert report.problem == ("the grading process ended with exit code 0 while importing the file: "
                              "the code called os._exit() (or something ended the interpreter) and printed no error")
    assert report.to_text().endswith("nothing graded: " + report.problem)


def test_sys_exit_and_os_exit_inside_forward_say_so(tmp_path):
    path = learner(tmp_path, "exits_in_forward.py", '''
class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        sys.exit(0)


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        os._exit(0)
''')
    report = grade(path)
    mha, head = report.results
    assert (mha.name, mha.passed, mha.step) == ("MultiHeadAttention", False, "error")
    assert (mha.line, mha.code) == ("exits_in_forward.py:16", "sys.exit(0)")
    assert mha.error == "SystemExit(0): the code called sys.exit(), which would end the program"
    assert (head.name, head.passed, head.step) == ("CausalAttention", False, "error")
    assert head.error == ("the grading process ended with exit code 0 while grading CausalAttention: "
                          "the code called os._exit() (or something ended the interpreter) and printed no error")
    assert report.exit_code == 1
