"""Thread setup: the default count and the OpenMP wait policy chosen at import."""

import os

import gemmaspec
from gemmaspec.loader import physical_cores


def test_wait_policy_follows_the_load(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(gemmaspec, "_busy_others", lambda: 1)
    gemmaspec._wait_policy()
    assert "OMP_WAIT_POLICY" not in os.environ  # one other process on 4 cores: threads keep spinning
    monkeypatch.setattr(gemmaspec, "_busy_others", lambda: 2)
    gemmaspec._wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "passive"  # half the cores busy: wait passively
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    gemmaspec._wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "active"  # the user's choice wins


def test_default_threads_are_physical_cores():
    n = physical_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))


def test_busy_others_sees_a_busy_process():
    import subprocess
    import sys
    import time

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)
        assert gemmaspec._busy_others() >= 1  # at least one of the two holds a CPU at any moment
    finally:
        for b in busy:
            b.kill()
            b.wait()
