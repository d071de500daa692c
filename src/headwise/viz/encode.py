"""Tensors as text a page can carry: float32, little-endian, base64 (exact, and ``-inf`` survives)."""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

import torch
from torch import Tensor


def float32_base64(t: Tensor) -> str:
    """``t`` flattened in row-major order as little-endian float32 bytes, base64-encoded."""
    raw = t.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).view(-1, 4)  # (N, 4) bytes of each float
    if sys.byteorder == "big":
        raw = raw.flip(-1)
    return base64.b64encode(bytes(raw.flatten().tolist())).decode("ascii")


def base64_float32(text: str, shape: tuple[int, ...] | list[int]) -> Tensor:
    """The inverse of ``float32_base64``: a float32 tensor of ``shape``."""
    raw = torch.tensor(list(base64.b64decode(text)), dtype=torch.uint8).view(-1, 4)  # (N, 4)
    if sys.byteorder == "big":
        raw = raw.flip(-1)
    return raw.contiguous().view(torch.float32).reshape(tuple(shape))


def script_json(data: Any) -> str:
    """``data`` as JSON that is safe inside ``<script type="application/json">``.

    Every ``<`` and ``/`` is written as a JSON escape, so no text in the data (a token such as
    ``</script>`` or a URL in the sentence) can end the script or read as a link; ``JSON.parse``
    gives the original strings back.
    """
    return json.dumps(data, ensure_ascii=False, allow_nan=False).replace("<", "\\u003c").replace("/", "\\/")
