"""The fp32 products' regrouped layout (``r8.h``) built on a background thread, and the release of
the stored pages a repacked copy replaces.

:func:`regroup_in_background` starts the copies; :func:`sync_layouts`, called by the thread about to
run products, puts the finished ones in use. ``_bg_ready`` (the copies done but not yet in use) is
read on the product path (:mod:`gemmaspec.kernels.weights`, the C decode and draft steps) to skip
:func:`sync_layouts` when there is nothing to do.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading
import weakref

import torch

from .base import BlockWeight
from .build import _R8, act_quant, load_library

log = logging.getLogger(__name__)


def _file_backed(a0: int, a1: int) -> bool:
    """Whether addresses [a0, a1) lie in one mapping of a file (``/proc/self/maps``; Linux)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                if lo <= a0 < hi:
                    return a1 <= hi and len(parts) == 6 and not parts[5].startswith("[")
    except (OSError, ValueError, IndexError):
        pass
    return False


def _release(t: torch.Tensor) -> None:
    """Drop ``t``'s pages from this process's memory, Linux: for weights mapped from a GGUF file
    (clean private pages) ``madvise(MADV_DONTNEED)`` unmaps them from this process and leaves them in
    the page cache, so a touch reads them back unchanged and the next process starts without reading
    the file from disk again (``MADV_PAGEOUT``, used before, also evicted them from the page cache:
    the next start re-read ~170 MiB); for anonymous memory ``MADV_PAGEOUT`` (nothing without swap; never
    DONTNEED, which would zero it). Elsewhere nothing. Used after a weight is repacked into a copy that
    replaces it."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        a0, a1 = (start + page - 1) // page * page, end // page * page
        if a1 > a0:
            advice = 4 if _file_backed(a0, a1) else 21  # MADV_DONTNEED / MADV_PAGEOUT
            libc.madvise(ctypes.c_void_p(a0), ctypes.c_size_t(a1 - a0), advice)
    except (OSError, AttributeError, ValueError):
        pass


_bg_lock = threading.Lock()
_bg_ready = weakref.WeakKeyDictionary()  # StoredWeight -> (regrouped copy or None, batch): done, not in use yet


class _Batch:
    """One background regroup: how many of its weights are not yet in use, and an event set when none is."""

    def __init__(self, n: int):
        self.left, self.done = n, threading.Event()


_BG_MEM_SHARE = 0.25  # a background regroup only when its copies take at most this share of available memory


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def regroup_in_background(weights) -> threading.Thread | None:
    """Regroup the fp32-activation layout (``r8.h``) of ``weights`` on a background thread (one kernel
    thread), so that a process's first products (the prompt's prefill, the first decode steps) need not
    wait for it (~0.2-0.3 s for the default model's 170 MiB): until a weight's copy is done its
    products read it as stored (the same bits: the regrouped layout computes exactly what the stored
    one does), and :func:`sync_layouts`, called before products by the thread that runs them, puts
    each finished copy in use by patching the kernel-argument arrays in place (so every cached plan
    sees it). The stored pages are released as for a regroup on first use, but while it works a weight's
    stored pages that products read again come back, so for a moment (~0.2-0.5 s here) both layouts can be
    resident: the peak RSS is up to twice the regrouped bytes, not the stored size plus one chunk.
    Skipped (None) when the copies would take more than a quarter of the available memory, without the
    C kernel, on kernel paths that read only the stored layout, in the int8-activation mode (whose
    repacked layout sums in another order than the stored one; weights marked ``auto_q8``, a mid-sized
    model's head and layer products, are skipped for the same reason), and with
    ``GEMMASPEC_REGROUP=first-use`` (the regroup then happens at each weight's first product, as before).

    Args:
        weights: the weights products will run on (others, and weights already regrouped, are skipped),
            in the order the first forward reaches them.

    Returns:
        the started daemon thread, or None when there is nothing to do.
    """
    lib = load_library()
    if lib is None or act_quant() == "q8_0" or os.environ.get("GEMMASPEC_REGROUP", "background") == "first-use":
        return None
    todo, seen = [], set()
    for w in weights:
        if getattr(w, "_marked_q8", bool)():  # its products read the int8 layout (x8.h)
            continue
        parts = [q for q in w._segment_owners() if q is not None] if isinstance(w, BlockWeight) else []
        for q in parts:  # StoredWeight objects (alone or parts of a StackedWeight)
            if id(q) not in seen and q.__dict__.get("_r8") is None and not q.__dict__.get("_bg") and q._regroups(lib):
                seen.add(id(q))
                todo.append(q)
    if not todo:
        return None
    avail = _mem_available()
    if avail is not None and sum(q.nbytes for q in todo) > _BG_MEM_SHARE * avail:
        return None  # while it works, stored pages read again and the copies can both be resident
    batch = _Batch(len(todo))
    for q in todo:
        q._bg = True
    refs = [weakref.ref(q) for q in todo]  # a model dropped meanwhile is not kept alive by its regroup
    th = threading.Thread(target=_regroup_worker, args=(lib, refs, batch), name="gemmaspec-regroup", daemon=True)
    with _bg_lock:
        if not _bg_threads:
            atexit.register(_stop_regroups)
        _bg_threads[:] = [t for t in _bg_threads if t.is_alive()] + [th]
    th.start()
    return th


_bg_stop = threading.Event()  # set at interpreter exit: background regroups end at their next chunk
_bg_threads: list = []


def _stop_regroups() -> None:
    """At exit, end the background regroups and wait for them (a chunk, a few ms): a daemon thread
    still inside the kernel or PyTorch when the interpreter finalizes aborts the process."""
    _bg_stop.set()
    for th in list(_bg_threads):
        th.join(timeout=30)


def _regroup_worker(lib, refs: list, batch: _Batch) -> None:
    for ref in refs:
        w = ref()
        if w is None:
            continue
        if _bg_stop.is_set():
            return
        try:
            out = w._repacked(lib.gs_repack_r8, nthreads=1, stop=_bg_stop)
        except Exception:  # noqa: BLE001 - the weight stays as stored, which is correct
            log.exception("gemmaspec: background regroup of a %s weight failed; it stays as stored", w.qtype)
            out = None
        with _bg_lock:
            _bg_ready[w] = (out, batch)
        del w
    while not batch.done.wait(0.5):  # until every copy is in use, or the weights are gone, or exit
        if _bg_stop.is_set() or all(r() is None for r in refs):
            return
    for ref in refs:  # stored pages that products read again before their copy was in use
        w = ref()
        if w is not None:
            _release(w.raw)


def sync_layouts(weights) -> None:
    """Put those of ``weights`` (:class:`~gemmaspec.kernels.weights.StoredWeight` or None, as
    :meth:`~gemmaspec.kernels.weights.CPUBlockWeight._segment_owners` lists them) that
    :func:`regroup_in_background` has finished in use: each copy's address and format are written
    into the kernel-argument arrays built from its stored layout. Called by the thread about
    to run products on those weights, before it runs them (a weight's product and the C decode/draft
    steps call it for their own weights), so no kernel reads an array while it changes (a weight's
    products are not run from two threads at once). Cheap when there is nothing to do."""
    if not _bg_ready:
        return
    with _bg_lock:
        items = [(w, *_bg_ready.pop(w)) for w in weights if w is not None and w in _bg_ready]
    for w, out, batch in items:
        if out is not None and w.__dict__.get("_r8") is None:
            w._r8 = out
            fmt, ptr = _R8[w.qtype], out.data_ptr()
            for fmts, ws, i in w.__dict__.pop("_patches", []):
                ws[i] = ptr
                fmts[i] = fmt
        w.__dict__.pop("_patches", None)
        w._bg = False
        batch.left -= 1
        if batch.left == 0:
            batch.done.set()
