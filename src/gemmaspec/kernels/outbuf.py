"""Large product outputs on reused memory (:func:`output`): a wide round's logits without fresh pages.

glibc serves an allocation of 32 MiB or more (its dynamic mmap threshold's ceiling) with a fresh
mapping and unmaps it when freed, so a product that returns that much pays a page fault per 4 KiB
of it every time. The head of a 262,144-token vocabulary returns 1 MiB of float32 logits per row:
every verify round of 32 or more rows (8 slots drafting 3 tokens each) was such a product. On a
2-core AMD EPYC (Zen 4) the Gemma 3 270M head and an argmax per row took 43.5 ms over 32 rows where 24
rows took 21.2, and 28.0 ms on a kept buffer (48 rows: 67.7 against 49.3 ms; medians of 40,
alternating; ``benchmarks/wide_logits.py``, docs/speed.md, "Wide rounds"). Raising glibc's thresholds
instead (``mallopt``) helped only part of the time: small allocations made between two rounds split
the freed block.

:func:`output` hands out a view of a kept buffer when nothing else still uses it (PyTorch's count of
the buffer's storage users: a caller that keeps the logits, or any view of them, keeps the buffer
busy and the next product gets a buffer of its own), else a fresh tensor; at most
:data:`POOL_BUFFERS` buffers are kept, so up to that many times the largest such output stays resident
(8 slots verifying 3 drafts each: 32 MiB per buffer).
"""

from __future__ import annotations

import threading

import torch

MIN_BYTES = 32 << 20
"""Outputs of at least this many bytes come from the pool (glibc maps these afresh); smaller ones are
plain ``torch.empty`` (the heap reuses them)."""

POOL_BUFFERS = 2
"""Buffers kept (two products alive at once reuse memory too); the largest are kept."""

_pool: list[torch.Tensor] = []
_lock = threading.Lock()


def _users(buf: torch.Tensor) -> int:
    """Users of ``buf``'s storage besides ``buf`` itself (views, tensors sharing it)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) - 2  # buf, and the call's own handle


def output(m: int, n: int) -> torch.Tensor:
    """An uninitialised float32 [m, n] tensor (CPU) for a product to write: from a kept buffer when
    m * n * 4 >= :data:`MIN_BYTES` and one of at least that size is not in use, else fresh (and kept
    if it is larger than a kept one). Thread-safe: a buffer handed out is in use until every view of
    it is gone."""
    size = m * n
    if size * 4 < MIN_BYTES:
        return torch.empty(m, n, dtype=torch.float32)
    with _lock:
        try:
            for buf in _pool:
                if buf.numel() >= size and _users(buf) == 0:
                    return buf[:size].view(m, n)
        except (AttributeError, RuntimeError):  # a PyTorch without the storage count: no pool
            return torch.empty(m, n, dtype=torch.float32)
        buf = torch.empty(size, dtype=torch.float32)
        _pool.append(buf)
        _pool.sort(key=lambda b: -b.numel())
        del _pool[POOL_BUFFERS:]
        return buf.view(m, n)
