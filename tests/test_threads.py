"""Thread setup: the default count and the OpenMP wait policy chosen at import."""

import os
import subprocess
import sys

import pytest

import gemmaspec
from gemmaspec.errors import InputError
from gemmaspec.loading.engine import physical_cores, set_threads


def test_wait_policy_is_passive_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    gemmaspec._wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "passive"
    assert gemmaspec.SET_ENV == {"OMP_WAIT_POLICY": "passive"}  # benchmarks hand llama.cpp the env without it
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    gemmaspec._wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "active"  # the user's choice wins
    assert gemmaspec.SET_ENV == {}
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "5000")
    gemmaspec._wait_policy()
    assert "OMP_WAIT_POLICY" not in os.environ  # a spin count of the user's is a choice too
    assert os.environ["GOMP_SPINCOUNT"] == "5000"


def _openmp_settings(env: dict) -> tuple[list[str], list[str]]:
    """In a fresh process (``import gemmaspec``, torch, the C kernel, one parallel product), what every
    OpenMP runtime reported at start (``OMP_DISPLAY_ENV``: the GOMP_SPINCOUNT lines, one per runtime)
    and the OpenMP libraries mapped into the process."""
    code = ("import gemmaspec, torch\n"
            "from gemmaspec.kernels import load_library\n"
            "load_library()\n"
            "torch.ones(512, 512) @ torch.ones(512, 512)\n"
            "libs = {l.split()[-1] for l in open('/proc/self/maps') if 'omp' in l.rsplit('/', 1)[-1]}\n"
            "print('\\n'.join(sorted(libs)))\n")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**base, "OMP_DISPLAY_ENV": "verbose", **env})
    assert res.returncode == 0, res.stderr[-2000:]
    spins = [line.split("=", 1)[1].strip().strip("'") for line in res.stderr.splitlines()
             if line.strip().startswith("GOMP_SPINCOUNT")]
    return spins, res.stdout.split()


def test_every_openmp_runtime_in_the_process_waits_passively():
    spins, libs = _openmp_settings({})
    if not any("gomp" in lib for lib in libs):
        pytest.skip(f"no libgomp in this process ({libs}); the spin count is libgomp's")
    # each libgomp loaded (PyTorch's, the kernel's own if it is a different one) printed its settings once
    assert len(spins) == len([lib for lib in libs if "gomp" in lib])
    assert spins and all(s == "0" for s in spins)  # passive: no spinning at all


def test_users_openmp_setting_reaches_the_runtime():
    spins, libs = _openmp_settings({"GOMP_SPINCOUNT": "4321"})
    if not any("gomp" in lib for lib in libs):
        pytest.skip(f"no libgomp in this process ({libs})")
    assert spins and all(s == "4321" for s in spins)


def test_default_threads_are_physical_cores(monkeypatch):
    n = physical_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    # two logical CPUs on one core count once; a core of its own counts
    topo = {0: "0-1", 1: "0-1", 2: "2"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(topo))
    real_read = __import__("pathlib").Path.read_text

    def read_text(self, *a, **k):
        parts = self.parts
        if parts[-1] == "core_cpus_list" and parts[-3].startswith("cpu"):
            return topo[int(parts[-3][3:])] + "\n"
        return real_read(self, *a, **k)

    monkeypatch.setattr("pathlib.Path.read_text", read_text)
    assert physical_cores() == 2


def test_set_threads(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        set_threads(None)
        assert torch.get_num_threads() == physical_cores()
        set_threads(1)
        assert torch.get_num_threads() == 1
        with pytest.raises(InputError, match="threads must be >= 1"):
            set_threads(0)
    finally:
        torch.set_num_threads(before)
