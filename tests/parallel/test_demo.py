"""``python -m headwise.parallel.demo`` outside torchrun: one line saying how to run it, no traceback."""

from __future__ import annotations

import pytest

from headwise.parallel import demo


def test_the_demo_without_torchrun_says_to_use_torchrun_in_one_line(monkeypatch, capsys):
    for name in demo.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")  # what is set is not named
    with pytest.raises(SystemExit) as exit:
        demo.main([])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err == ("headwise.parallel.demo: error: run it under torchrun (torchrun --nproc-per-node 2 -m headwise.parallel.demo), "
                   "which sets RANK, WORLD_SIZE, MASTER_ADDR\n")
