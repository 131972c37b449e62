"""Block-quantized weights and the CPU kernels that multiply by them.

A :class:`StoredWeight` keeps a weight matrix W [N, K] as the GGUF file's blocks, byte for byte
(Q4_0, Q8_0, Q5_0, Q4_K, Q6_K: :data:`STORED_TYPES`; the bytes may view a memory-mapped file). A
:class:`QuantizedWeight` holds W as int8 values ``q`` [N, K], an fp32 ``scale`` [N, K/G] and an
optional fp32 ``offset`` [N, K/G] (G = 16 or 32 values per block), so that
``W[n, k] = scale[n, k // G] * q[n, k] + offset[n, k // G]``; every GGML block type converts to this
form without rounding (:mod:`gemmaspec.kernels.ggml_blocks`), which is how the types without a stored
kernel (Q4_1, Q5_1, Q5_K) are held. Both multiply with the same bits for the same weights. A
:class:`StackedWeight` puts several of them side by side (q, k, v) for one kernel call. All are
:class:`BlockWeight` objects.

Products with few rows (decode, speculative verify: M <= ``SMALL_M``) run in ``qmatmul.c``, a C
kernel compiled once per machine into the gemmaspec cache with the system C compiler (``cc``); it
reads the weights straight from memory and multiplies them with fp32 activations, or, in the opt-in
mode of :func:`set_act_quant` (``--act-quant q8_0``), with activations quantized to int8 per 32 values
(llama.cpp's scheme; ``qdot8.h``). Larger products (prefill) dequantize a tile of rows at a time into a reused
fp32 buffer and use PyTorch's matmul. Without a C compiler, or with ``GEMMASPEC_NO_KERNELS=1``, every product uses the
dequantized fp32 matrix, kept in memory: correct, slower, four times the memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import atexit
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..paths import cache_home
from .base import BlockWeight

log = logging.getLogger(__name__)

SMALL_M = 16  # at most this many rows go through the C kernel
TILE_BYTES = 16 << 20  # float32 bytes of a weight dequantized at once for a many-row product
_SRC = Path(__file__).with_name("qmatmul.c")
_threads: int | None = None  # the kernel's thread count inside ops_on_one_thread(); else PyTorch's


def threads() -> int:
    """Threads the C kernel uses: PyTorch's intra-op thread count (``-t`` sets it), or inside
    :func:`ops_on_one_thread` the count from before it."""
    return _threads if _threads is not None else torch.get_num_threads()


@contextlib.contextmanager
def ops_on_one_thread():
    """Within this block PyTorch's own ops run on one thread while the C kernel keeps its threads.

    For steps of few rows (decode, speculative verify, drafting): their PyTorch ops (norms, RoPE,
    attention over one query row, softmax) take microseconds, less than waking a team of OpenMP threads
    (a passive OpenMP wake-up made a [1, 4, 100] softmax cost 123 us instead of 11 on this project's
    2-core machine), while the weight products, which do need every core, run in the kernel's own pool
    (``pool.h``). Results do not change: PyTorch's CPU ops give the same bits for any thread count on
    these shapes (each output row is computed by one thread either way)."""
    global _threads
    saved, before = _threads, torch.get_num_threads()
    _threads = threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)
        _threads = saved


ACT_QUANTS = ("none", "q8_0")  # activations of the kernel's products: fp32, or int8 per 32 values


def _env_act_quant() -> bool:
    mode = os.environ.get("GEMMASPEC_ACT_QUANT", "none").strip().lower() or "none"
    if mode not in ACT_QUANTS:
        log.warning("gemmaspec: GEMMASPEC_ACT_QUANT=%s is not one of %s; using none", mode, ", ".join(ACT_QUANTS))
        return False
    return mode == "q8_0"


_act_q8 = _env_act_quant()


def set_act_quant(mode: str) -> None:
    """How the C kernel's few-row products (decode, speculative verify, drafting) treat activations:
    ``"none"`` (the default) multiplies fp32 activations, bit-identical to the int8-level reference and
    matching transformers to ~1e-6; ``"q8_0"`` quantizes each row of x to int8 per 32 values (one fp32
    step per block) and uses integer dot products (AVX-512 VNNI, AVX2, NEON), llama.cpp's CPU scheme:
    less work per weight, results within the rounding of x (relative ~1e-2 per product) of the fp32
    ones (``qdot8.h`` documents the arithmetic). Either mode is batch-invariant, so speculative decoding
    stays lossless within it. Many-row products (prefill) keep fp32 activations. ``GEMMASPEC_ACT_QUANT``
    sets the initial mode.

    Raises:
        ValueError: a mode not in :data:`ACT_QUANTS`.
    """
    global _act_q8
    if mode not in ACT_QUANTS:
        raise ValueError(f"--act-quant {mode!r}: choose one of {', '.join(ACT_QUANTS)}")
    _act_q8 = mode == "q8_0"


def act_quant() -> str:
    """The current activation mode (see :func:`set_act_quant`)."""
    return "q8_0" if _act_q8 else "none"


_lib = None
_lib_tried = False
_lock = threading.Lock()


ISAS = ("auto", "avx512", "avx2", "neon", "portable")
_ISA_FLAGS = {"auto": [], "avx512": [], "avx2": ["-mno-avx512f"], "neon": [], "portable": ["-DGS_PORTABLE"]}
_ISA_NEEDS = {"avx512": ("avx512f",), "avx2": ("avx2", "fma"), "neon": ("asimd",)}


def isa_choice() -> str:
    """The kernel instruction set asked for with ``GEMMASPEC_ISA`` (``auto``: the best this CPU has;
    ``avx2`` builds the AVX2+FMA path even on an AVX-512 CPU, to test and measure it; ``neon`` the
    AArch64 path (the default there); ``portable`` the plain C path). An unknown value, or one this CPU cannot run, falls back to ``auto`` with a
    warning."""
    isa = os.environ.get("GEMMASPEC_ISA", "auto").strip().lower() or "auto"
    if isa not in ISAS:
        log.warning("gemmaspec: GEMMASPEC_ISA=%s is not one of %s; using auto", isa, ", ".join(ISAS))
        return "auto"
    if not cpu_supports(isa):
        log.warning("gemmaspec: GEMMASPEC_ISA=%s but this CPU lacks %s; using auto", isa, "/".join(_ISA_NEEDS[isa]))
        return "auto"
    return isa


def cpu_supports(isa: str) -> bool:
    """Whether this CPU can run kernels built for ``isa`` (from its feature flags; ``auto`` and
    ``portable`` always)."""
    flags = set(_cpu_flags().split())
    return all(f in flags for f in _ISA_NEEDS.get(isa, ()))


def _flags(isa: str) -> list[str]:
    """Compiler flags of the kernel for ``isa``, plus ``GEMMASPEC_CFLAGS`` (split on spaces: extra flags
    for tuning builds, e.g. ``-DGS_ONE_ROW_FMTS=12``; they are part of the cache key)."""
    return ["-O3", "-march=native", "-ffp-contract=off", "-pthread", *_ISA_FLAGS[isa],
            *os.environ.get("GEMMASPEC_CFLAGS", "").split()]


def _compile(src: Path, out: Path, isa: str = "auto") -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc or gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        cmd = [cc, *_flags(isa), "-shared", "-fPIC", str(src), "-o", str(tmp_so), "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {res.stderr.strip()[:500]}")
        os.replace(tmp_so, out)  # atomic: a concurrent process sees the whole file or none


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so a cache shared between machines never runs code built
    with ``-march=native`` for another processor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def compiled_library(src: Path, isa: str = "auto"):
    """``src`` (a C file beside this module) compiled into the gemmaspec cache and loaded as a
    ``ctypes.CDLL``, or None when it cannot be had (no compiler, a broken build,
    ``GEMMASPEC_NO_KERNELS=1``). Compiles on first use (about 1 s) into ``<cache>/kernels/``; the file
    name holds a hash of the source, the compiler flags, the machine and its CPU flags, so a change of
    any of them rebuilds it."""
    if os.environ.get("GEMMASPEC_NO_KERNELS") == "1":
        return None
    headers = b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))  # what the source includes
    key = hashlib.sha256(
        src.read_bytes() + headers + f"|{' '.join(_flags(isa))}|{os.uname().machine}|{_cpu_flags()}".encode()
    ).hexdigest()[:16]
    so = cache_home() / "kernels" / f"{src.stem}-{key}.so"
    try:
        if not so.exists():
            if sys.stderr.isatty():
                print(f"gemmaspec: compiling the C kernel {src.name} for this CPU (once per machine, 10-30 s)",
                      file=sys.stderr, flush=True)
            _compile(src, so, isa)
        return ctypes.CDLL(str(so))
    except OSError as exc:  # no compiler, or a broken build: the caller falls back
        log.warning("gemmaspec: C kernel %s unavailable (%s); using the slower fallback", src.name, exc)
        return None


def load_library():
    """The compiled matmul kernel library (``qmatmul.c``), or None when it cannot be had
    (see :func:`compiled_library`)."""
    global _lib, _lib_tried
    if _lib_tried:
        return _lib
    with _lock:
        if _lib_tried:
            return _lib
        _lib_tried = True
        _lib = matmul_library(isa_choice())
        return _lib


def matmul_library(isa: str = "auto"):
    """``qmatmul.c`` built for ``isa`` (see :data:`ISAS`) with its functions' signatures set, or None
    (see :func:`compiled_library`). ``lib.gs_isa()`` says which path was compiled in."""
    lib = compiled_library(_SRC, isa)
    if lib is None:
        return None
    P, I = ctypes.c_void_p, ctypes.c_int
    sigs = {
        "gs_qmatmul": [P, P, P, I, I, I, P, P, I, P, I],
        "gs_qmatmul_multi": [I, P, P, P, P, P, P, I, P, P, I, P, I],
        "gs_qmatmul_multi_q8": [I, P, P, P, P, P, P, I, P, P, I, P, I],
        "gs_quantize_act": [P, I, I, P, P],
        "gs_qmatmul_stored": [I, P, I, I, P, P, I, P, I],
        "gs_dequant_rows": [I, P, P, P, I, I, I, I, P, I],
        "gs_dequant_ids": [I, P, P, P, I, P, I, I, P],
        "gs_block_sums": [P, I, I, I, P],
        "gs_rms_norm": [P, P, I, I, ctypes.c_float, P],
        "gs_norm_rope": [P, ctypes.c_long, I, I, I, P, I, P, P, P, ctypes.c_float, P],
        "gs_gelu_mul": [P, ctypes.c_long, I, I, P],
        "gs_add_rms_norm": [P, P, I, I, ctypes.c_float, P, P],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.gs_attention.argtypes = [P, ctypes.c_long, I, I, I, I, P, P, I, P, ctypes.c_float, ctypes.c_float, P]
    lib.gs_attention.restype = I
    lib.gs_decode_layers.argtypes = [I, P, P, P, P, I, I, I, I, I, I, ctypes.c_float, ctypes.c_float, I, I, I]
    lib.gs_decode_layers.restype = I
    lib.gs_assistant_step.argtypes = [I, P, P, P, P, P, I, I, I, I, I, ctypes.c_float, P, P, P, I, P, P, P, I, I]
    lib.gs_assistant_step.restype = I
    lib.gs_repack_x8.argtypes = [I, P, ctypes.c_long, I, P, I]
    lib.gs_repack_x8.restype = I
    lib.gs_repack_r8.argtypes = [I, P, ctypes.c_long, I, P, I]
    lib.gs_repack_r8.restype = I
    lib.gs_isa.argtypes = []
    lib.gs_isa.restype = ctypes.c_char_p
    return lib


def kernel_isa() -> str:
    """The instruction-set path of the loaded kernel (``avx512``, ``avx2``, ``neon``, ``portable``), or ``none``
    when no kernel could be built (dense PyTorch fallback)."""
    lib = load_library()
    return lib.gs_isa().decode() if lib is not None else "none"


def _ptr(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


# Weight formats of qmatmul.c (FMT_*): the int8 form, and GGML block types kept as stored.
FMT_I8 = 0
STORED_TYPES = ("Q4_0", "Q8_0", "Q5_0", "Q4_K", "Q6_K")  # GGML types StoredWeight keeps as stored
_FMT = {"Q4_0": 1, "Q8_0": 2, "Q5_0": 3, "Q4_K": 4, "Q6_K": 5}
# Q4_0 and Q8_0 repacked 8 rows at a time for the int8-activation products (x8.h)
FMT_Q4_0X8, FMT_Q8_0X8 = 6, 7
_X8 = {"Q4_0": FMT_Q4_0X8, "Q8_0": FMT_Q8_0X8}
# ... and regrouped 8 rows at a time for the fp32-activation products (r8.h)
FMT_Q4_0R8, FMT_Q8_0R8 = 8, 9
_R8 = {"Q4_0": FMT_Q4_0R8, "Q8_0": FMT_Q8_0R8}
_R8_ISAS = ("avx512", "avx2")  # kernel paths that read the regrouped layout in place
_REPACK_ROWS = 8192  # rows repacked before the stored ones are released (a multiple of 8)
_HAS_OFFSETS = ("Q4_K",)


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
    repacked layout sums in another order than the stored one), and with ``GEMMASPEC_REGROUP=first-use``
    (the regroup then happens at each weight's first product, as before).

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
        if isinstance(w, StackedWeight):
            parts = [q for q in w._segment_owners() if q is not None]
        else:
            parts = [w] if isinstance(w, StoredWeight) else []
        for q in parts:
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
    """Put those of ``weights`` (:class:`StoredWeight` or None, as :meth:`CPUBlockWeight._segment_owners`
    lists them) that :func:`regroup_in_background` has finished in use: each copy's address and format
    are written into the kernel-argument arrays built from its stored layout. Called by the thread about
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


class CPUBlockWeight(BlockWeight):
    """The CPU formats' shared product logic (:class:`QuantizedWeight`, :class:`StoredWeight`,
    :class:`StackedWeight`; the interface, :class:`~gemmaspec.kernels.base.BlockWeight`, lives in
    ``base.py`` so that the device layout in ``cuda.py`` builds on it without an import cycle).

    A subclass describes its memory as kernel segments (``_segments()``: the format number, weight
    bytes, int8 scales/offsets and group, rows) and gives ``_fallback()`` (the same weights in a form
    PyTorch can multiply without the C kernel); the product logic below is shared."""

    shape: tuple[int, int]
    _dense: torch.Tensor | None = None

    def _segments(self) -> list[tuple]:  # [(fmt, w, s, o, G, N)]
        raise NotImplementedError

    def _segments_q8(self, lib) -> list[tuple]:
        """The segments the int8-activation products read (a layout built for them, or the stored one)."""
        return self._segments()

    def _segments_f32(self, lib) -> list[tuple]:
        """The segments the fp32-activation products read (a layout built for them, or the stored one)."""
        return self._segments()

    def _read_segments(self) -> list[tuple]:
        """The segments that dequantization and row lookups read: a repacked copy once one exists (so the
        stored bytes, which it replaces in memory, are not read back in), else :meth:`_segments`."""
        return self._segments()

    def _fallback(self) -> "BlockWeight":
        raise NotImplementedError

    @property
    def _device(self) -> torch.device:
        return self._segments()[0][1].device

    def _offset_group(self) -> int | None:
        """G of the segments with offsets (their kernel reads sums of x over G-value blocks), or None."""
        gs = {32 if fmt == _FMT["Q4_K"] else g for fmt, _, _, o, g, _ in self._segments()
              if o is not None or fmt == _FMT["Q4_K"]}
        return gs.pop() if gs else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for x float32 [..., K] → float32 [..., N]: the C kernel for up to ``SMALL_M`` rows,
        tiles of W through PyTorch's matmul for more, a kept float32 W without a kernel."""
        if _bg_ready:
            sync_layouts(self._segment_owners())
        plan = self.__dict__.get("_plan")
        if plan is not None and x.device.type == "cpu":
            # the decode path, kept short (a step makes ~70 of these calls): shapes, kernel arguments
            # and the library were settled by the first call
            fns, n, k, args = plan
            x2 = x.reshape(-1, k)
            if x2.dtype != torch.float32 or not x2.is_contiguous():
                x2 = x2.float().contiguous()
            m = x2.shape[0]
            if m <= SMALL_M and args[_act_q8] is not None:
                y = torch.empty(m, n, dtype=torch.float32)
                fns[_act_q8](*args[_act_q8], k, x2.data_ptr(), None, m, y.data_ptr(), threads())
                return y.view(*x.shape[:-1], n)
        return self._call(x)

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        lead = x.shape[:-1]
        lib = load_library() if x.device.type == "cpu" and self._device.type == "cpu" else None
        if lib is None:
            if self._dense is None:
                self._dense = self.dequantize()  # no kernel: keep the fp32 matrix
            return F.linear(x, self._dense)
        x2 = x.reshape(-1, k).float().contiguous()
        if x2.shape[0] > SMALL_M:
            return self._tiled(lib, x2).view(*lead, n)
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        self._small(lib, x2, y)
        args = self.__dict__.get("_kernel_args"), self.__dict__.get("_kernel_args_q8")
        self._plan = ((lib.gs_qmatmul_multi, lib.gs_qmatmul_multi_q8), n, k,
                      tuple(None if a is None else a[0] for a in args))
        return y.view(*lead, n)

    def _small(self, lib, x2: torch.Tensor, y: torch.Tensor) -> None:
        """y float32 [M, N] = x2 float32 [M, K] @ W.T in one call of the C kernel (M <= SMALL_M)."""
        m, k = x2.shape
        cached = self.kernel_args(lib, _act_q8)
        # the kernel computes the block sums of x that offsets (Q4_K) need itself (xsum NULL)
        fn = lib.gs_qmatmul_multi_q8 if _act_q8 else lib.gs_qmatmul_multi
        fn(*cached[0], k, _ptr(x2), None, m, _ptr(y), threads())

    def kernel_args(self, lib, q8: bool) -> tuple:
        """``((nseg, fmts, ws, ss, os, Gs, Ns), offset group, segments)``: the C kernel's arguments for
        this weight (ctypes arrays) in the fp32 or the int8-activation mode, built once per mode."""
        sync_layouts(self._segment_owners())
        key = "_kernel_args_q8" if q8 else "_kernel_args"
        cached = self.__dict__.get(key)
        if cached is None:  # built once: the arrays never move (a background regroup patches them in place)
            segs = self._segments_q8(lib) if q8 else self._segments_f32(lib)
            ns = len(segs)
            arr = lambda ctype, vals: (ctype * ns)(*vals)  # noqa: E731
            P = ctypes.c_void_p
            cached = ((
                ns, arr(ctypes.c_int, [s[0] for s in segs]), arr(P, [s[1].data_ptr() for s in segs]),
                arr(P, [None if s[2] is None else s[2].data_ptr() for s in segs]),
                arr(P, [None if s[3] is None else s[3].data_ptr() for s in segs]),
                arr(ctypes.c_int, [s[4] for s in segs]), arr(ctypes.c_int, [s[5] for s in segs])),
                self._offset_group(), segs)  # segs: keeps the tensors the addresses point into alive
            if not q8:  # segments still stored while a background regroup works on them: patched when it is done
                owners = self._segment_owners()
                if len(owners) == ns:
                    for i, w in enumerate(owners):
                        if w is not None and w.__dict__.get("_bg") and segs[i][1] is w.raw:
                            w.__dict__.setdefault("_patches", []).append((cached[0][1], cached[0][2], i))
            self.__dict__[key] = cached
        return cached

    def _segment_owners(self) -> list:
        """The :class:`StoredWeight` behind each of this weight's segments (None for other kinds), in
        segment order."""
        return [None] * len(self._segments())

    def _dequant_rows(self, lib, n0: int, n1: int, out: torch.Tensor) -> None:
        """Rows n0..n1-1 of W into float32 ``out`` [>= n1 - n0, K] (the C kernel's dequantizer)."""
        k, base = self.shape[1], 0
        for fmt, w, s, o, g, n in self._read_segments():
            a, b = max(n0, base), min(n1, base + n)
            if a < b:
                dst = ctypes.c_void_p(out.data_ptr() + 4 * (a - n0) * k)
                lib.gs_dequant_rows(fmt, _ptr(w), _ptr(s), _ptr(o), g, a - base, b - base, k, dst, threads())
            base += n

    def _tiled(self, lib, x2: torch.Tensor) -> torch.Tensor:
        """x2 float32 [M, K] @ W.T for many rows (prefill): ``TILE_BYTES`` of W at a time is dequantized
        into one reused float32 buffer and multiplied with PyTorch's matmul, so no product widens the
        whole matrix (the 262,144 x 640 head would be 670 MB as float32)."""
        n, k = self.shape
        rows = max(1, min(n, TILE_BYTES // (4 * k)))
        buf = torch.empty(rows, k, dtype=torch.float32)
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        for n0 in range(0, n, rows):
            r = min(rows, n - n0)
            self._dequant_rows(lib, n0, n0 + r, buf)
            y[:, n0:n0 + r] = x2 @ buf[:r].T
        return y

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K], on the weight's device."""
        n, k = self.shape
        lib = load_library() if self._device.type == "cpu" else None
        if lib is None:
            return self._fallback().dequantize()
        out = torch.empty(n, k, dtype=torch.float32)
        self._dequant_rows(lib, 0, n, out)
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64, any shape) of W as float32 [*ids.shape, K] (an embedding lookup); only
        those rows are unpacked."""
        segs = self._read_segments()
        lib = load_library() if self._device.type == "cpu" else None
        if lib is None or len(segs) != 1:
            return self._fallback().rows(ids)
        fmt, w, s, o, g, _ = segs[0]
        k = self.shape[1]
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), k, dtype=torch.float32)
        lib.gs_dequant_ids(fmt, _ptr(w), _ptr(s), _ptr(o), g, _ptr(flat), flat.numel(), k, _ptr(out))
        return out.view(*ids.shape, k)


class QuantizedWeight(CPUBlockWeight):
    """A weight matrix W [N, K] stored as int8 blocks (see the module docstring).

    Args:
        q: int8 [N, K]; values as stored in the file's blocks.
        scale: float32 [N, K // group].
        offset: float32 [N, K // group] or None.
        group: 16 or 32 (values per block along K).

    Raises:
        ValueError: shapes or dtypes that do not fit together.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int):
        n, k = q.shape
        if q.dtype != torch.int8 or scale.dtype != torch.float32 or k % group or group % 16:
            raise ValueError(f"bad quantized weight: q {q.dtype} {tuple(q.shape)}, group {group}")
        if tuple(scale.shape) != (n, k // group) or (offset is not None and offset.shape != scale.shape):
            raise ValueError(f"bad quantized weight: scale {tuple(scale.shape)} for q {tuple(q.shape)}")
        self.q, self.scale, self.offset, self.group = q.contiguous(), scale.contiguous(), offset, group
        if offset is not None:
            self.offset = offset.contiguous()
        self._dense: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset) if t is not None)

    def _segments(self) -> list[tuple]:
        return [(FMT_I8, self.q, self.scale, self.offset, self.group, self.shape[0])]

    def _fallback(self) -> "QuantizedWeight":
        return self

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K], on the weight's device."""
        if self.q.device.type == "cpu" and load_library() is not None:
            return super().dequantize()
        n, k = self.q.shape
        w = self.q.view(n, k // self.group, self.group).float() * self.scale[..., None]
        w = w + (self.offset[..., None] if self.offset is not None else 0.0)
        return w.view(n, k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W as float32 [*ids.shape, K] (an embedding lookup): scale * q + offset
        (+ 0 without offsets, as the C dequantizer computes it)."""
        if self.q.device.type == "cpu" and load_library() is not None:
            return super().rows(ids)
        n, k = self.q.shape
        g = self.group
        w = self.q[ids].view(-1, k // g, g).float() * self.scale[ids].view(-1, k // g, 1)
        w = w + (self.offset[ids].view(-1, k // g, 1) if self.offset is not None else 0.0)
        return w.view(*ids.shape, k)

    def to(self, device: torch.device | str) -> BlockWeight:
        """On the CPU: a QuantizedWeight there; elsewhere the device layout (:func:`device_weight`)."""
        d = torch.device(device)
        if d.type != "cpu":
            return device_weight(self, d)
        off = None if self.offset is None else self.offset.to(d)
        return QuantizedWeight(self.q.to(d), self.scale.to(d), off, self.group)


class StoredWeight(CPUBlockWeight):
    """A weight matrix W [N, K] kept as the GGUF's blocks, byte for byte (no conversion, no copy: ``raw``
    may view a memory-mapped file). Types: :data:`STORED_TYPES` — Q4_0 (0.5625 bytes per weight),
    Q8_0 (1.0625), Q5_0 (0.6875), Q4_K (0.5625), Q6_K (0.8203), against 1.125 for the int8 form.

    Products are bit-identical to a :class:`QuantizedWeight` of the same values (the exact conversion
    of :func:`gemmaspec.kernels.ggml_blocks.to_int8_blocks`): the C kernel unpacks each block's levels
    in registers and runs the int8 path's operations (``qmatmul.c``). Without a C kernel W is
    converted to the int8 form once and dequantized (correct, slower, more memory).

    Args:
        raw: uint8 [N, row_bytes], the tensor's bytes as stored in the file (row_bytes = K / block
            values * block bytes, from ``gguf.GGML_QUANT_SIZES``).
        qtype: the GGML type name, one of :data:`STORED_TYPES`.
        k: K, the row length in values (a multiple of the type's block size: 32, or 256 for K-quants).

    Raises:
        ValueError: an unsupported type, or a dtype or byte count that does not fit [N, K].
    """

    def __init__(self, raw: torch.Tensor, qtype: str, k: int):
        if qtype not in STORED_TYPES:
            raise ValueError(f"{qtype} weights cannot be kept as stored; supported: {', '.join(STORED_TYPES)}")
        per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        if raw.dtype != torch.uint8 or raw.dim() != 2 or k % per_block or raw.shape[1] != k // per_block * block_bytes:
            raise ValueError(f"bad {qtype} weight: raw {raw.dtype} {tuple(raw.shape)} for rows of {k} values (need "
                             f"uint8 [N, {k // per_block * block_bytes}], K a multiple of {per_block})")
        self.raw, self.qtype, self.k = raw if raw.is_contiguous() else raw.contiguous(), qtype, k
        self._int8: QuantizedWeight | None = None
        self._dense: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.k)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def _segments(self) -> list[tuple]:
        return [(_FMT[self.qtype], self.raw, None, None, 32, self.raw.shape[0])]

    def _segments_q8(self, lib) -> list[tuple]:
        """Q4_0 and Q8_0 with a multiple of 8 rows: the rows repacked 8 at a time (``x8.h``, llama.cpp's
        idea of ``block_q4_0x8``: one activation load and one vector of 8 scales serve 8 rows, one weight
        stream per 8 rows), built on the first int8-activation product, the same size as the stored
        bytes, which are then released from memory (:func:`_release`: they stay in the file); other
        types: as stored."""
        n = self.raw.shape[0]
        if self.qtype not in _X8 or n % 8:
            return self._segments()
        if self.__dict__.get("_x8") is None:
            self._x8 = self._repacked(lib.gs_repack_x8)
            if self._x8 is None:
                return self._segments()
        return [(_X8[self.qtype], self._x8, None, None, 32, n)]

    def _repacked(self, repack, nthreads: int | None = None, stop=None) -> torch.Tensor | None:
        """A copy of the rows in another layout of the same size (``repack``: ``gs_repack_x8`` or
        ``gs_repack_r8``), built chunk by chunk on ``nthreads`` threads (default :func:`threads`), each
        chunk's stored pages released once copied (so the peak stays one chunk above the stored size; a
        released page read again comes back unchanged from the file or swap); None if the kernel refuses
        the format, or when ``stop`` (a :class:`threading.Event`) is set between chunks."""
        n = self.raw.shape[0]
        out = torch.empty_like(self.raw)  # pages are only taken as they are written (~0.2 s for 170 MiB here)
        for r0 in range(0, n, _REPACK_ROWS):
            if stop is not None and stop.is_set():
                return None
            r1 = min(n, r0 + _REPACK_ROWS)
            if repack(_FMT[self.qtype], self.raw[r0].data_ptr(), r1 - r0, self.k, out[r0].data_ptr(),
                      nthreads or threads()):
                return None
            _release(self.raw[r0:r1])
        return out

    def _regroups(self, lib) -> bool:
        """Whether the fp32 products read this weight regrouped (:meth:`_segments_f32`)."""
        return self.qtype in _R8 and self.raw.shape[0] % 8 == 0 and lib.gs_isa().decode() in _R8_ISAS

    def _segment_owners(self) -> list:
        return [self]

    def _segments_f32(self, lib) -> list[tuple]:
        """Q4_0 and Q8_0 with a multiple of 8 rows, on a kernel path of :data:`_R8_ISAS`: the rows
        regrouped 8 at a time (``r8.h``: each row's level bytes as stored, the 8 rows' scales of a block
        side by side, one stream per 8 rows; the stored format's operations, so its bits), built on the
        first fp32-activation product, the same size as the stored bytes, which are then released from
        memory as for :meth:`_segments_q8`; otherwise as stored. (A process that uses both activation
        modes on one weight keeps both layouts.)"""
        n = self.raw.shape[0]
        if not self._regroups(lib):
            return self._segments()
        if self.__dict__.get("_r8") is None:
            if self.__dict__.get("_bg"):  # being regrouped in the background: as stored until it is done
                return self._segments()
            self._r8 = self._repacked(lib.gs_repack_r8)
            if self._r8 is None:
                return self._segments()
        return [(_R8[self.qtype], self._r8, None, None, 32, n)]

    def _read_segments(self) -> list[tuple]:
        n = self.raw.shape[0]
        for attr, fmts in (("_r8", _R8), ("_x8", _X8)):
            t = self.__dict__.get(attr)
            if t is not None:
                return [(fmts[self.qtype], t, None, None, 32, n)]
        return self._segments()

    def _fallback(self) -> QuantizedWeight:
        if self._int8 is None:
            self._int8 = self.to_int8()
        return self._int8

    def levels(self, raw: torch.Tensor | None = None):
        """``(q, scale, offset, group)`` of ``raw`` (uint8 rows of blocks; default: all of W): int8
        levels [R, K], float32 scales and offsets (or None) [R, K / group], the :class:`QuantizedWeight`
        form."""
        from .ggml_blocks import to_int8_blocks

        raw = self.raw if raw is None else raw
        q, s, o, g = to_int8_blocks(raw.cpu().numpy(), GGMLQuantizationType[self.qtype], raw.shape[0], self.k)
        t = lambda a: None if a is None else torch.from_numpy(a).to(raw.device)  # noqa: E731
        return t(q), t(s), t(o), g

    def to_int8(self) -> QuantizedWeight:
        """The same weights as a :class:`QuantizedWeight` (int8 levels): more memory."""
        return QuantizedWeight(*self.levels())

    def to(self, device: torch.device | str) -> BlockWeight:
        """On the CPU: a StoredWeight there; elsewhere the device layout (:func:`device_weight`), still
        block-quantized."""
        d = torch.device(device)
        if d.type == "cpu":
            return StoredWeight(self.raw.to(d), self.qtype, self.k)
        return device_weight(self, d)


class StackedWeight(CPUBlockWeight):
    """Weight matrices of the same K side by side along N ([W_0; W_1; ...], e.g. q, k and v), multiplied
    in one kernel call (one parallel loop over the tiles of all of them) without copying them into one
    tensor, so each keeps its own format (a Q5_0 q with a Q8_0 v) and mapped weights stay mapped.

    Args:
        parts: :class:`QuantizedWeight` / :class:`StoredWeight` objects with the same K, on one device
            (at most 8); those with offsets (Q4_K, int8 with offsets) over one block size.

    Raises:
        ValueError: different K, devices, offset block sizes, or too many parts.
    """

    def __init__(self, parts: list[BlockWeight]):
        parts = [q for p in parts for q in (p.parts if isinstance(p, StackedWeight) else [p])]
        k = parts[0].shape[1]
        offset_groups = {p._offset_group() for p in parts} - {None}
        if (len(parts) > 8 or any(p.shape[1] != k for p in parts) or len({p._device for p in parts}) > 1
                or len(offset_groups) > 1):
            raise ValueError(f"cannot stack {len(parts)} weights of shapes {[p.shape for p in parts]} (same K, one "
                             "device, at most 8, offsets over one block size)")
        self.parts = parts
        self._dense: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def _segments(self) -> list[tuple]:
        return [s for p in self.parts for s in p._segments()]

    def _segments_q8(self, lib) -> list[tuple]:
        return [s for p in self.parts for s in p._segments_q8(lib)]

    def _segments_f32(self, lib) -> list[tuple]:
        return [s for p in self.parts for s in p._segments_f32(lib)]

    def _segment_owners(self) -> list:
        return [w for p in self.parts for w in p._segment_owners()]

    def _read_segments(self) -> list[tuple]:
        return [s for p in self.parts for s in p._read_segments()]

    def _fallback(self) -> "StackedWeight":
        return StackedWeight([p._fallback() for p in self.parts])

    def dequantize(self) -> torch.Tensor:
        if self._device.type != "cpu" or load_library() is None:
            return torch.cat([p.dequantize() for p in self.parts])
        return super().dequantize()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize()[ids]

    def _tiled(self, lib, x2: torch.Tensor) -> torch.Tensor:
        """Each part's own tiled product, side by side: a BLAS matmul's bits for a column can depend on
        how many columns it is given (they do with PyTorch's CPU BLAS on an AMD EPYC), so a part's
        columns are computed exactly as the part alone computes them."""
        return torch.cat([p._tiled(lib, x2) for p in self.parts], dim=-1)

    def to(self, device: torch.device | str) -> BlockWeight:
        """On the CPU: a StackedWeight there; elsewhere the parts' device layouts joined
        (``DeviceQuantWeight.cat``)."""
        d = torch.device(device)
        if d.type == "cpu":
            return StackedWeight([p.to(d) for p in self.parts])
        from .cuda import DeviceQuantWeight

        parts = [device_weight(p, d) for p in self.parts]
        joined = DeviceQuantWeight.cat(parts)
        return joined if joined is not None else _DeviceParts(parts)


class _DeviceParts(BlockWeight):
    """Device weights that cannot be joined into one layout, multiplied one after another and their
    outputs put side by side (what :class:`StackedWeight` becomes off the CPU in that case)."""

    def __init__(self, parts: list[BlockWeight]):
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize()[ids]

    def to(self, device) -> BlockWeight:
        return _DeviceParts([p.to(device) for p in self.parts])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def Q4_0Weight(raw: torch.Tensor, k: int) -> StoredWeight:
    """A Q4_0 :class:`StoredWeight` (raw uint8 [N, K / 32 * 18])."""
    return StoredWeight(raw, "Q4_0", k)


def device_weight(w: BlockWeight, device) -> BlockWeight:
    """``w`` on a non-CPU ``device``, still block-quantized: the layout of :mod:`gemmaspec.kernels.cuda`
    (:class:`~gemmaspec.kernels.cuda.DeviceQuantWeight`, about the stored size; products by its Triton
    kernel or exact tiles), never a float32 matrix. Every ``BlockWeight.to(device)`` calls this for a
    device that is not the CPU."""
    from .cuda import to_device

    return to_device(w, device)
