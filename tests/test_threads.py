"""Thread setup: the default count and the OpenMP wait policy chosen at import."""

import os

import gemmaspec
from gemmaspec.loader import physical_cores


def test_wait_policy_follows_the_load(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "getloadavg", lambda: (0.4, 0.0, 0.0))
    gemmaspec._wait_policy()
    assert "OMP_WAIT_POLICY" not in os.environ  # quiet: threads keep spinning (fastest)
    monkeypatch.setattr(os, "getloadavg", lambda: (2.5, 0.0, 0.0))
    gemmaspec._wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "passive"  # half the cores busy: wait passively
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    gemmaspec._wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "active"  # the user's choice wins


def test_default_threads_are_physical_cores():
    n = physical_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
