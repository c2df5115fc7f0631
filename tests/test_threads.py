"""exl/threads.py: the automatic thread count under CPU contention (the decision, the probe, the overrides)."""

import pytest
import torch

from exl import threads


@pytest.mark.parametrize("n, others, want", [
    (2, None, 2),   # no /proc/stat: every usable core
    (2, 0.0, 2),
    (2, 0.3, 2),    # a little background work leaves the core usable
    (2, 0.5, 1),    # half a core taken: that core's barrier waits would cost more than it adds
    (2, 1.0, 1),    # a busy process on one core (issue 11's case)
    (2, 2.0, 1),    # never below one thread
    (8, 1.0, 7),
    (8, 2.6, 5),
])
def test_threads_for_leaves_out_busy_cores(n, others, want):
    assert threads.threads_for(n, others) == want


def test_probe_measures_other_processes_not_this_one():
    cpus = threads.usable_cpus()
    load = threads.others_load(cpus, probe_s=0.05)
    assert load is None or 0.0 <= load <= len(cpus) + 0.5
    assert 1 <= threads.auto_threads(probe_s=0.05) <= len(cpus)


def test_overrides(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "_applied", False)
        monkeypatch.setenv("EXL_THREADS", "1")
        assert threads.apply_auto_threads() == 1 and torch.get_num_threads() == 1
        assert threads.apply_auto_threads() is None  # once per process
        monkeypatch.setattr(threads, "_applied", False)
        monkeypatch.setenv("EXL_THREADS", "all")
        assert threads.apply_auto_threads() is None
        monkeypatch.setattr(threads, "_applied", False)
        monkeypatch.setenv("EXL_THREADS", "two")
        with pytest.raises(ValueError, match="EXL_THREADS must be a positive integer or 'all', got 'two'"):
            threads.apply_auto_threads()
        monkeypatch.setattr(threads, "_applied", False)
        monkeypatch.delenv("EXL_THREADS")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert threads.apply_auto_threads() is None  # the user's OpenMP setting stands
    finally:
        torch.set_num_threads(before)
