"""argparse ``type=`` functions for the command line: each takes the flag's text and returns its value
or raises ``argparse.ArgumentTypeError`` saying what was expected and what was given, which argparse
prints as one line (``headwise explain: error: argument --batch: ...``) and exits with status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable, Sequence


def integer(low: int = 1, high: int | None = None) -> Callable[[str], int]:
    """An int in [low, high] (high None: no bound)."""
    expected = f"an int in [{low}, {high}]" if high is not None else ("a positive int" if low == 1 else f"an int >= {low}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


def number(low: float = -math.inf, high: float = math.inf, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite float in [low, high] ((low, high] with ``low_open``)."""
    if math.isinf(high):
        expected = f"a finite number {'>' if low_open else '>='} {low:g}"
    else:
        expected = f"a finite number in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not math.isfinite(value) or (value <= low if low_open else value < low) or value > high:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def listing(item: Callable[[str], object], what: str, *, repeats: bool = False) -> Callable[[str], list]:
    """A non-empty comma list, each entry parsed by ``item``; ``what`` describes an entry. An entry given twice is
    refused unless ``repeats`` (a benchmark would run and report its case twice, each copy compared with the other's)."""

    def parse(text: str) -> list:
        parts = [part.strip() for part in text.split(",")]
        if not text.strip() or any(not part for part in parts):
            raise argparse.ArgumentTypeError(f"expected a comma list of {what} with no empty entries, got {text!r}")
        try:
            values = [item(part) for part in parts]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"expected a comma list of {what}: {e}") from None
        twice = next((part for part, value in zip(parts, values, strict=True) if values.count(value) > 1), None)
        if twice is not None and not repeats:
            raise argparse.ArgumentTypeError(f"expected a comma list of {what}, each once, got {text!r} ({twice} more than once)")
        return values

    return parse


def check_drawable(path: str, flag: str) -> None:
    """A ValueError unless matplotlib draws a file of ``path``'s suffix (asked before any work: the picture is the last
    thing written); needs matplotlib."""
    from matplotlib.figure import Figure

    kinds = Figure().canvas.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix not in kinds:
        raise ValueError(f"{flag} {path}: matplotlib draws no {suffix or 'file without a suffix'!r}; "
                         f"name it .png (or one of {', '.join(sorted(kinds))})")


def choice(choices: Sequence[str]) -> Callable[[str], str]:
    """One of ``choices``."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def text(what: str) -> Callable[[str], str]:
    """Non-empty text that is valid UTF-8 (undecodable bytes reach Python as lone surrogates)."""

    def parse(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"expected {what}, got an empty string")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = value[e.start].encode("utf-8", "surrogateescape")
            raise argparse.ArgumentTypeError(
                f"expected {what} in UTF-8, got bytes that are not UTF-8 ({bad!r} at character {e.start})"
            ) from None
        return value

    return parse


def output(what: str, *, none: str | None = None) -> Callable[[str], str]:
    """A file to write later, checked now (before any work): its folder exists and is writable, and it is not a folder.
    ``none``: the value that asks for no file (returned as it is)."""
    name = text(what)

    def parse(value: str) -> str:
        if none is not None and value == none:
            return value
        value = name(value)
        folder = os.path.dirname(os.path.abspath(value))
        if os.path.isdir(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got the folder {value!r}")
        if not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(f"expected {what} in a folder that exists, got {value!r} ({folder} does not exist)")
        if not os.access(folder, os.W_OK) or (os.path.exists(value) and not os.access(value, os.W_OK)):
            raise argparse.ArgumentTypeError(f"expected {what} that can be written, got {value!r} (no permission)")
        if not os.path.exists(value):  # made and removed: a folder the permissions allow may refuse files (/proc, root)
            try:
                os.close(os.open(value, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
                os.remove(value)
            except OSError as e:
                raise argparse.ArgumentTypeError(f"expected {what} that can be written, got {value!r} ({e.strerror})") from None
        return value

    return parse


def folder(what: str) -> Callable[[str], str]:
    """A folder to write into, checked now (before any work): made if missing, and a file written and removed in it."""
    name = text(what)

    def parse(value: str) -> str:
        value = name(value)
        try:
            os.makedirs(value, exist_ok=True)
            with tempfile.TemporaryFile(dir=value):
                pass
        except OSError as e:
            raise argparse.ArgumentTypeError(f"expected {what} that can be written, got {value!r} ({e.strerror or e})") from None
        return value

    return parse


#: ``--threads``: torch.set_num_threads takes a C int, and a machine has fewer cores than this.
threads = integer(1, 4096)
#: ``--busy``: processes spinning beside a benchmark.
busy = integer(0, 256)
