"""gemmaspec: Gemma models on a small CPU or GPU, with speculative decoding.

Public entry points: :func:`gemmaspec.loader.load_engine` (a target ready to generate),
:func:`gemmaspec.loader.drafter_factory` (the drafter ``--spec-type`` asks for),
:func:`gemmaspec.loading.load_checkpoint` (any supported checkpoint as a built model) and the
``gemmaspec`` command (:mod:`gemmaspec.cli`).
"""

import os as _os

__version__ = "0.1.0"


def _wait_policy() -> None:
    """OpenMP threads spin between parallel regions by default: fastest on a quiet machine, but when
    other processes already keep half the cores busy a spinning thread holds its core while the
    thread it waits for is descheduled, and decode slows several-fold (measured: 8.5 tokens/s spinning
    vs 17.9 passive with one busy process on 2 cores; 28.0 vs 18.2 quiet). So when the 1-minute load
    average is at least half the usable cores at start, threads wait passively. Takes effect only when
    gemmaspec is imported before torch (the ``gemmaspec`` command always is) and the user has set
    neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT``."""
    if "OMP_WAIT_POLICY" in _os.environ or "GOMP_SPINCOUNT" in _os.environ:
        return
    try:
        cores = len(_os.sched_getaffinity(0)) if hasattr(_os, "sched_getaffinity") else (_os.cpu_count() or 1)
        if _os.getloadavg()[0] >= max(1.0, cores / 2):
            _os.environ["OMP_WAIT_POLICY"] = "passive"
    except OSError:
        pass


_wait_policy()
