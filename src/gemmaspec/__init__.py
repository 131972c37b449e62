"""gemmaspec: Gemma models on a small CPU or GPU, with speculative decoding.

Public entry points: :func:`gemmaspec.loader.load_engine` (a target ready to generate),
:func:`gemmaspec.loader.drafter_factory` (the drafter ``--spec-type`` asks for),
:func:`gemmaspec.loading.load_checkpoint` (any supported checkpoint as a built model) and the
``gemmaspec`` command (:mod:`gemmaspec.cli`).
"""

import os as _os

__version__ = "0.1.0"


def _busy_others() -> int:
    """Processes other than this one running right now (``/proc/loadavg``'s runnable count, the least of
    three looks 5 ms apart, so a passing blip is not taken for a busy machine); 0 when unknown."""
    import time

    seen = []
    try:
        for _ in range(3):
            with open("/proc/loadavg") as f:
                seen.append(int(f.read().split()[3].split("/")[0]) - 1)
            time.sleep(0.005)
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, min(seen))


def _wait_policy() -> None:
    """OpenMP threads spin between parallel regions by default: fastest on a quiet machine, but when
    other processes are busy a spinning thread holds its core while the thread it waits for is
    descheduled, and decode slows several-fold (``benchmarks/kernel_paths.py``, 2 cores: spinning 26.7
    tokens/s quiet, 10.0 with one busy process; passive 18.7 / 18.0; this choice 25.9 / 17.7). So when, at start,
    other processes are running on at least half the usable cores, threads wait passively. Takes effect
    only when gemmaspec is imported before torch (the ``gemmaspec`` command always is) and the user has
    set neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT``."""
    if "OMP_WAIT_POLICY" in _os.environ or "GOMP_SPINCOUNT" in _os.environ:
        return
    cores = len(_os.sched_getaffinity(0)) if hasattr(_os, "sched_getaffinity") else (_os.cpu_count() or 1)
    if _busy_others() >= max(1, cores // 2):
        _os.environ["OMP_WAIT_POLICY"] = "passive"


_wait_policy()
