"""gemmaspec: Gemma models on a small CPU or GPU, with speculative decoding.

Public entry points: :func:`gemmaspec.loading.engine.load_engine` (a target ready to generate),
:func:`gemmaspec.speculative.plan.plan` and :func:`~gemmaspec.speculative.plan.build` (the drafter a
:class:`~gemmaspec.speculative.config.SpecConfig` asks for), :func:`gemmaspec.loading.load_checkpoint`
(any supported checkpoint as a built model) and the ``gemmaspec`` command (:mod:`gemmaspec.cli`).
"""

import os as _os

__version__ = "0.1.0"

WAIT_POLICY = "passive"
"""The ``OMP_WAIT_POLICY`` gemmaspec sets when the user has chosen none (see :func:`_wait_policy`)."""
SET_ENV: dict[str, str] = {}
"""Environment variables gemmaspec set at import (not the user), so that tools which start other
programs (benchmarks running llama.cpp) can hand those programs the user's own environment."""


def _wait_policy() -> None:
    """Make PyTorch's OpenMP threads sleep, not spin, while they wait: set ``OMP_WAIT_POLICY=passive``
    unless the user has set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` (their choice always wins).

    Why: PyTorch's ops run on an OpenMP team during prefill, and between two parallel regions a waiting
    libgomp thread spins by default for up to 300,000 ``pause``s (6-10 ms on this project's Xeon). On
    an idle core that is free; when another process wants the CPU, the spin is taken from it, or from
    the thread the team waits for, once per region, and OpenMP reads the setting once at start while
    load can appear at any time. (Measured when the C kernel still ran on OpenMP, 2-core Xeon, default
    model: passive 19.8 tokens/s, with one more busy process 9.7; libgomp's default 1.3 / 1.0; active
    2.7 / 0.8.) The decode path no longer depends on it: the kernel has its own pool (``kernels/pool.h``)
    and a decode step runs PyTorch's small ops on one thread (``kernels.ops_on_one_thread``).

    ``OMP_WAIT_POLICY`` is the OpenMP standard's variable, so it reaches whichever runtime PyTorch
    loads. It takes effect only when gemmaspec is imported before torch (the ``gemmaspec`` command and
    every module of this package do; ``import torch`` first in your own program leaves torch's runtime
    as it started)."""
    if "OMP_WAIT_POLICY" in _os.environ or "GOMP_SPINCOUNT" in _os.environ:
        if _os.environ.get("OMP_WAIT_POLICY") != SET_ENV.get("OMP_WAIT_POLICY"):
            SET_ENV.pop("OMP_WAIT_POLICY", None)  # the user's own value now
        return
    _os.environ["OMP_WAIT_POLICY"] = SET_ENV["OMP_WAIT_POLICY"] = WAIT_POLICY


_wait_policy()
