"""A ready engine from a model path (or the default model) and a device: device choice, CPU threads,
the checkpoint, the kernel library and the context size.

The drafter is chosen and loaded by :mod:`gemmaspec.speculative.plan`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..engine import Engine
from ..errors import InputError
from ..kernels import load_library, resolve_act_quant
from . import load_checkpoint, step_bytes


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` → CUDA when available, else CPU. Raises InputError for an unavailable device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for, but this PyTorch sees no CUDA GPU; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise InputError(f"--device must be auto, cpu or cuda (got {device})")
    return torch.device(device)


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads of one core counted once), from Linux's
    CPU topology; the number of usable CPUs where the topology cannot be read."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list").read_text().strip())
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def set_threads(threads: int | None) -> None:
    """Use ``threads`` CPU threads (``-t``; default: the physical cores this process may run on, since
    a second hyper-thread of a core adds no memory bandwidth to a memory-bound decode).

    Raises:
        InputError: threads < 1.
    """
    if threads is not None and threads < 1:
        raise InputError(f"threads must be >= 1 (got {threads})")
    torch.set_num_threads(threads if threads is not None else physical_cores())


def load_engine(path=None, ctx_size: int | None = None, device: str = "auto", threads: int | None = None) -> Engine:
    """A ready :class:`Engine`.

    Args:
        path: GGUF file or Hugging Face checkpoint directory (None: the default model).
        ctx_size: context size in tokens; None = min(4096, the model's), 0 = the model's.
        device: ``auto``, ``cpu`` or ``cuda``.
        threads: CPU threads (None: the physical cores this process may use).

    Raises:
        GemmaspecError: bad file, unsupported model, bad device or context size.
    """
    from ..heap import startup_heap

    with startup_heap():  # no full garbage collection while loading; what is loaded is frozen
        return _load_engine(path, ctx_size, device, threads)


def _load_engine(path, ctx_size, device, threads) -> Engine:
    set_threads(threads)
    loaded = load_checkpoint(path, resolve_device(device), role="target")
    if loaded.model.device.type == "cpu":
        load_library()  # a first start compiles the kernel here, so it counts as loading, not as prefill
        resolve_act_quant(step_bytes(loaded.model))
    if ctx_size is None:  # default: 4096, or the model's context when that is smaller
        ctx_size = min(4096, loaded.config.context_length)
    ctx = ctx_size if ctx_size > 0 else loaded.config.context_length
    if ctx > loaded.config.context_length:
        raise InputError(f"-c {ctx} exceeds the model's context of {loaded.config.context_length} tokens")
    if ctx < 2:
        raise InputError(f"-c must be at least 2 (got {ctx})")
    return Engine(loaded.model, loaded.tokenizer, ctx, model_path=loaded.path)
