"""gemmaspec: Gemma models on a small CPU or GPU, with speculative decoding.

Public entry points: :func:`gemmaspec.loader.load_engine` (a target ready to generate),
:func:`gemmaspec.loader.drafter_factory` (the drafter ``--spec-type`` asks for),
:func:`gemmaspec.loading.load_checkpoint` (any supported checkpoint as a built model) and the
``gemmaspec`` command (:mod:`gemmaspec.cli`).
"""

import os as _os

__version__ = "0.1.0"

WAIT_POLICY = "passive"
SET_ENV: dict[str, str] = {}
"""Environment variables gemmaspec set at import (not the user), so that tools which start other
programs (benchmarks running llama.cpp) can hand those programs the user's own environment."""
"""The ``OMP_WAIT_POLICY`` gemmaspec sets when the user has chosen none (see :func:`_wait_policy`)."""


def _wait_policy() -> None:
    """Make OpenMP threads sleep, not spin, while they wait: set ``OMP_WAIT_POLICY=passive`` unless the
    user has set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` (their choice always wins).

    Why: a decode step of the default model runs ~95 parallel regions (four kernel calls per layer, the
    head, a few PyTorch ops), and between two of them a waiting libgomp thread spins by default for up to
    300,000 ``pause``s (6-10 ms on this Xeon) before it sleeps. On an idle core that is free and saves a
    wake-up; but when another process wants the CPU, each spin is taken from the thread the team waits
    for or from that process, once per region. So the spin that helps on an idle machine is what makes
    decode collapse under load, and OpenMP reads the setting once, at start, while load can appear at
    any time. ``benchmarks/kernel_paths.py`` (results/wait_policy.md; 2-core KVM Xeon shared with other
    jobs that kept about one core busy, default model, greedy, medians of 3 fresh processes): passive
    19.8 tokens/s, with one more busy process 9.7; ``GOMP_SPINCOUNT`` 1k 14.7 / 10.9, 3k 18.1 / 10.1,
    10k 11.5 / 7.1, 30k 6.1 / 3.8, 300k (libgomp's default) 1.3 / 1.0, active 2.7 / 0.8. No bounded spin
    did measurably better than none under load, and every longer one did worse. The price: on a machine
    with nothing else running, spinning is faster (one clean-ish sample: 300k 35 tokens/s, passive 18).

    ``OMP_WAIT_POLICY`` is the OpenMP standard's variable, so it reaches whichever runtimes the process
    loads: PyTorch's libgomp (LLVM's libomp in some builds) and the system libgomp the C kernel links
    (here one library: the kernel's ``libgomp.so.1`` resolves to the one PyTorch already loaded). It
    takes effect only when gemmaspec is imported before torch (the ``gemmaspec`` command and every module
    of this package do; ``import torch`` first in your own program leaves torch's runtime as it started)."""
    if "OMP_WAIT_POLICY" in _os.environ or "GOMP_SPINCOUNT" in _os.environ:
        if _os.environ.get("OMP_WAIT_POLICY") != SET_ENV.get("OMP_WAIT_POLICY"):
            SET_ENV.pop("OMP_WAIT_POLICY", None)  # the user's own value now
        return
    _os.environ["OMP_WAIT_POLICY"] = SET_ENV["OMP_WAIT_POLICY"] = WAIT_POLICY


_wait_policy()
