"""``headwise.hf`` without transformers: the package imports, and each entry point names the extra.

One child with ``sys.modules['transformers'] = None`` (what Python does for a package that is not
installed), reaching ``headwise.hf`` the way a user does: ``import headwise as hw; hw.hf...``.
"""

from __future__ import annotations

import subprocess
import sys

CALLS = {
    "hw.hf.register()": "running transformers models on headwise",
    "hw.hf.check(None)": "checking a transformers model",
    "hw.hf.load(object, 'some/path')": "loading a transformers model on headwise",
    "hw.hf.mask()": "building transformers' attention masks for headwise",
}
CHILD = "import sys\nsys.modules['transformers'] = None\nimport headwise as hw\nprint(sorted(hw.hf.__all__))\n" + "".join(
    f"try:\n    {call}\nexcept ImportError as e:\n    print(type(e).__name__, e)\n" for call in CALLS
)


def test_the_package_imports_and_each_entry_point_raises_an_import_error_naming_the_extra():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    names, *errors = out.stdout.splitlines()
    assert names == "['INERT', 'REFUSED', 'attend', 'check', 'load', 'mask', 'register']"
    assert len(errors) == len(CALLS)
    for line, feature in zip(errors, CALLS.values(), strict=True):
        assert line.startswith("ModuleNotFoundError ")  # an ImportError
        assert f"{feature} needs the package 'transformers', which is not installed: pip install 'headwise[hf]'" in line
