"""``headwise.bench.host``: the load a measurement ran under, a background load on demand, the read probe."""

from __future__ import annotations

import os
import shlex
import time

import pytest

from headwise.bench import host


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process that is not a zombie (Linux: its state in /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def started(monkeypatch) -> list:
    """The processes ``busy`` starts, as they start."""
    processes = []
    real = host.subprocess.Popen

    def popen(*args, **kwargs):
        processes.append(real(*args, **kwargs))
        return processes[-1]

    monkeypatch.setattr(host.subprocess, "Popen", popen)
    return processes


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_busy_spins_n_processes_while_the_block_runs_and_ends_them_after(started):
    with host.busy(2):
        assert len(started) == 2
        time.sleep(0.2)
        assert all(_running(p.pid) for p in started)
        assert all(p.poll() is None for p in started)  # still spinning
    assert all(p.returncode is not None for p in started)  # killed and reaped
    assert not any(_running(p.pid) for p in started)


def test_busy_ends_its_processes_when_the_block_raises(started):
    with pytest.raises(RuntimeError, match="inside"), host.busy(1):
        raise RuntimeError("inside")
    assert len(started) == 1 and started[0].returncode is not None
    with pytest.raises(ValueError, match=r"processes must be an int >= 0, got -1"), host.busy(-1):
        pass


def test_loaded_reads_the_load_average_before_and_after(monkeypatch):
    averages = iter([1.5, 2.25])
    monkeypatch.setattr(host, "load_average", lambda: next(averages))
    result, load = host.loaded(lambda: "measured")
    assert result == "measured" and load == host.Load(1.5, 2.25) and str(load) == "1.5→2.2"


def test_read_probe_bandwidth_is_bytes_over_seconds():
    probe = host.ReadProbe(repeats=4)
    probe()
    assert probe.gbps(0.5) == 4 * 512 * 2**20 / 0.5 / 1e9


def test_machine_names_the_cpu_and_torch():
    text = host.machine()
    assert "cores" in text and "torch" in text and "threads" in text


@pytest.mark.parametrize("args", [["--plot", ""], ["--out", "my runs/a.json", "--tokens", "8"], ["--impls", "a,b", "--note", "it's $HOME"], []])
def test_command_quotes_each_argument_so_it_splits_back(args):
    line = host.command("python -m headwise.bench.model_decode", args)
    assert shlex.split(line) == ["python", "-m", "headwise.bench.model_decode", *args]


def test_command_shows_an_empty_argument_as_two_quotes_and_reads_sys_argv_by_default(monkeypatch):
    monkeypatch.setattr(host.sys, "argv", ["headwise", "--plot", "", "--no-ceiling"])
    assert host.command("headwise bench") == "headwise bench --plot '' --no-ceiling"
