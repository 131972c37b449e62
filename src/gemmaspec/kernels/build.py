"""The C kernel's build and run-time settings: the compiler and the CPU's features, the instruction
set chosen (:func:`isa_choice`), the compiled library (:func:`load_library`, :func:`matmul_library`)
and its weight formats, the kernel's threads (:func:`threads`, :func:`ops_on_one_thread`) and the
activation mode of its few-row products (:func:`set_act_quant`).

``qmatmul.c`` is compiled once per machine into the gemmaspec cache with the system C compiler
(``cc``); without one, or with ``GEMMASPEC_NO_KERNELS=1``, :func:`load_library` gives None and every
weight product falls back to PyTorch (:mod:`gemmaspec.kernels.weights`).
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
import threading
import time
from pathlib import Path

import torch

from ..paths import cache_home

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("qmatmul.c")
COMPILE_TIME = "up to a minute, two on a busy machine"
"""How long the first compile of ``qmatmul.c`` takes, as announced: measured on 2-core AMD EPYC machines,
45 s beside one busy process, 116 s (at ``nice 10``) with a load average of 7; a quiet machine takes
less. The actual time is said after the compile."""
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


ACT_QUANTS = ("auto", "none", "q8_0")  # activations of the kernel's products: by model size, fp32, int8 per 32 values
AUTO_Q8_BYTES = 512 << 20  # "auto": int8 activations when a decode step's products read at least this much
AUTO_Q8_HEAD_BYTES = 64 << 20  # "auto": below AUTO_Q8_BYTES, from this many, int8 activations in the head only


def _env_act_quant() -> str:
    mode = os.environ.get("GEMMASPEC_ACT_QUANT", "auto").strip().lower() or "auto"
    if mode not in ACT_QUANTS:
        log.warning("gemmaspec: GEMMASPEC_ACT_QUANT=%s is not one of %s; using auto", mode, ", ".join(ACT_QUANTS))
        return "auto"
    return mode


_act_mode = _env_act_quant()  # as asked: auto, none or q8_0
_act_q8 = _act_mode == "q8_0"  # in effect


def set_act_quant(mode: str) -> None:
    """How the C kernel's few-row products (decode, speculative verify, drafting) treat activations:
    ``"none"`` multiplies fp32 activations, bit-identical to the int8-level reference and matching
    transformers to ~1e-6; ``"q8_0"`` quantizes each row of x to int8 per 32 values (one fp32 step per
    block) and uses integer dot products (AVX-512 VNNI, AVX2, NEON), llama.cpp's CPU scheme: less work
    per weight, results within the rounding of x (relative ~1e-2 per product) of the fp32 ones
    (``qdot8.h`` documents the arithmetic); ``"auto"`` (the default) picks per loaded target
    (:func:`resolve_act_quant`): q8_0 for models whose decode step reads at least ``AUTO_Q8_BYTES``
    of weights (Gemma 4 E2B and larger: there the fp32 products are compute-bound on a CPU, and
    llama.cpp computes the same way), none below, but from ``AUTO_Q8_HEAD_BYTES`` (Gemma 3 270M) a
    model's output head (:func:`auto_q8_head`) and its layer products whose weights the 8-row int8
    layouts hold (Q4_0, Q8_0, Q5_0, Q4_K, Q6_K: :func:`auto_q8_layers`) multiply int8 activations.
    Either mode is batch-invariant, so speculative decoding stays lossless within it. With q8_0 the
    many-row products of a prefill go through the same integer kernel; with none they stay PyTorch's
    float32 matmul. ``GEMMASPEC_ACT_QUANT`` sets the initial mode.

    Raises:
        ValueError: a mode not in :data:`ACT_QUANTS`.
    """
    global _act_q8, _act_mode
    if mode not in ACT_QUANTS:
        raise ValueError(f"--act-quant {mode!r}: choose one of {', '.join(ACT_QUANTS)}")
    _act_mode = mode
    _act_q8 = mode == "q8_0"


def resolve_act_quant(step_bytes: int) -> str:
    """Under ``"auto"``, set the mode in effect for a target whose decode step reads ``step_bytes`` bytes
    of weights (q8_0 from ``AUTO_Q8_BYTES`` up, else none); an explicit mode stays. Returns the mode in
    effect."""
    global _act_q8
    if _act_mode == "auto":
        _act_q8 = step_bytes >= AUTO_Q8_BYTES
    return act_quant()


def auto_q8_head(step_bytes: int, head) -> bool:
    """Under ``"auto"``, for a model whose decode step reads ``step_bytes`` bytes of weights from
    ``AUTO_Q8_HEAD_BYTES`` up to ``AUTO_Q8_BYTES`` (Gemma 3 270M: 235 MiB, its head 170 MiB of them), mark
    its output head (a ``CPUBlockWeight``) to multiply int8 activations (``head.auto_q8``) for any number
    of rows (its layers: :func:`auto_q8_layers`). The head is the largest product per row there
    (262,144 x 640: in fp32 an extra verify or batch row costs ~2.5 ms of a ~12 ms step on a 2-core Zen 4;
    in int8 its rows share one pass over the weights, so 2-4 rows cost about what one does,
    ``benchmarks/step_costs.py``), and as every row of it takes the same path the logits of a position
    never depend on how it was computed (prefill, decode, verify, a batch of slots). Returns whether it
    marked the head."""
    if _act_mode != "auto" or not (AUTO_Q8_HEAD_BYTES <= step_bytes < AUTO_Q8_BYTES) or head is None:
        return False
    if not hasattr(head, "auto_q8"):
        return False
    head.auto_q8 = True
    return True


def auto_q8_layers(step_bytes: int, weights) -> int:
    """Under ``"auto"``, for a model in :func:`auto_q8_head`'s size range, mark those of ``weights`` (its
    layers' products) whose every stored part has a multiple of 8 rows in a type the 8-row int8 layouts
    of ``x8.h`` hold (Q4_0, Q8_0, Q5_0 as Q8_0 blocks; Q4_K, Q6_K as ``FMT_I8X8``) to multiply int8
    activations (``auto_q8``), as the head does: their integer dot products serve 8 weight rows per
    activation load. On a 2-core Zen 4 a Gemma 3 270M gate|up matrix (4096 x 640, Q5_0) costs 0.11 /
    0.39 / 0.79 ms over 1 / 8 / 16 rows with fp32 activations and 0.04 / 0.12 / 0.23 ms in the x8 layout;
    a down matrix (640 x 2048, Q6_K) 0.07 / 0.15 / 0.34 against 0.03 / 0.07 / 0.13 ms: a decode step
    gets a little cheaper, a prefill about twice as fast, and each extra verify or batch row much
    cheaper. As for the head, every row of such a product takes the same path (prefill, decode, verify,
    a batch of slots), so results never depend on how a position was computed. Returns how many weights
    it marked."""
    if _act_mode != "auto" or not (AUTO_Q8_HEAD_BYTES <= step_bytes < AUTO_Q8_BYTES):
        return 0
    marked = 0
    for w in weights:
        if not hasattr(w, "auto_q8") or not hasattr(w, "_segment_owners"):
            continue
        owners = w._segment_owners()
        if owners and all((getattr(o, "qtype", None) in _X8 or getattr(o, "qtype", None) in _I8X8)
                          and o.shape[0] % 8 == 0 for o in owners):
            w.auto_q8 = True
            marked += 1
    return marked


def act_quant() -> str:
    """The current activation mode (see :func:`set_act_quant`)."""
    return "q8_0" if _act_q8 else "none"


def _env_draft_act_quant() -> bool:
    mode = os.environ.get("GEMMASPEC_DRAFT_ACT_QUANT", "q8_0").strip().lower() or "q8_0"
    if mode not in ("none", "q8_0"):
        log.warning("gemmaspec: GEMMASPEC_DRAFT_ACT_QUANT=%s is not none or q8_0; using q8_0", mode)
    return mode != "none"


_draft_auto_q8 = _env_draft_act_quant()  # under auto: the assistant's draft step with int8 activations


def draft_act_quant() -> str:
    """The activation mode of an MTP assistant's C draft step (``assistant_step``): under ``"auto"``
    int8 (``q8_0``) whatever the target's mode, because the assistant's few MiB of weights sit in
    cache and its products are bound by arithmetic, not by memory (``benchmarks/draft_batch.py``; the
    figures are in docs/server.md, "Batched MTP drafting"); an
    explicit ``none`` or ``q8_0`` (``--act-quant``) applies to it too, so the C step then matches the
    per-op path bit for bit. ``GEMMASPEC_DRAFT_ACT_QUANT=none`` keeps fp32 drafting under ``auto``.
    Drafts never change output (every draft is verified), only how many are accepted."""
    if _act_mode == "auto":
        return "q8_0" if _draft_auto_q8 else "none"
    return act_quant()


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
    ``GEMMASPEC_NO_KERNELS=1``). Compiles on first use (:data:`COMPILE_TIME`) into ``<cache>/kernels/``; the file
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
            tty = sys.stderr.isatty()
            if tty:
                log.info("gemmaspec: compiling the C kernel %s for this CPU (once per machine: %s)", src.name,
                         COMPILE_TIME)
            t0 = time.perf_counter()
            _compile(src, so, isa)
            if tty:
                log.info("gemmaspec: compiled %s in %.0f s", src.name, time.perf_counter() - t0)
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
        "gs_dot_ids": [I, P, P, P, I, P, I, I, P, P, I],
        "gs_block_sums": [P, I, I, I, P],
        "gs_rms_norm": [P, P, I, I, ctypes.c_float, P],
        "gs_norm_rope": [P, ctypes.c_long, I, I, I, P, I, P, P, P, ctypes.c_float, P],
        "gs_gelu_mul": [P, ctypes.c_long, I, I, P],
        "gs_gelu_mul2": [P, ctypes.c_long, P, ctypes.c_long, I, I, P],
        "gs_add_rms_norm": [P, P, I, I, ctypes.c_float, P, P],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.gs_attention.argtypes = [P, ctypes.c_long, I, I, I, I, P, P, I, P, ctypes.c_float, ctypes.c_float, P]
    lib.gs_attention.restype = I
    lib.gs_attention_mt.argtypes = [P, ctypes.c_long, I, I, I, I, P, P, I, P, ctypes.c_float, ctypes.c_float, P, I]
    lib.gs_attention_mt.restype = I
    lib.gs_attention_seqs.argtypes = [I, P, ctypes.c_long, P, I, I, I, P, P, P, P, ctypes.c_float, ctypes.c_float, P, I]
    lib.gs_attention_seqs.restype = I
    lib.gs_decode_layers.argtypes = [I, P, P, P, P, I, I, I, I, I, I, ctypes.c_float, ctypes.c_float, I, I, I]
    lib.gs_decode_layers.restype = I
    lib.gs_gemma4_layers.argtypes = [I, P, P, P, P, P, I, I, I, I, ctypes.c_float, I, I, I]
    lib.gs_gemma4_layers.restype = I
    lib.gs_assistant_step.argtypes = [I, P, P, P, P, P, I, I, I, I, I, ctypes.c_float, P, P, P, I, P, P, P, I, I]
    lib.gs_assistant_step.restype = I
    lib.gs_assistant_steps.argtypes = [I, I, P, P, P, P, P, I, I, I, I, I, ctypes.c_float, P, P, P, I, P, P, P, I, I]
    lib.gs_assistant_steps.restype = I
    lib.gs_repack_x8.argtypes = [I, P, ctypes.c_long, I, P, I]
    lib.gs_repack_x8.restype = I
    lib.gs_repack_r8.argtypes = [I, P, ctypes.c_long, I, P, I]
    lib.gs_repack_r8.restype = I
    lib.gs_repack_i8x8.argtypes = [I, P, ctypes.c_long, I, P, P, P, I]
    lib.gs_repack_i8x8.restype = I
    lib.gs_isa.argtypes = []
    lib.gs_isa.restype = ctypes.c_char_p
    lib.gs_pool_check.argtypes = [ctypes.c_long, I]
    lib.gs_pool_check.restype = ctypes.c_long
    return lib


def kernel_isa() -> str:
    """The instruction-set path of the loaded kernel (``avx512``, ``avx2``, ``neon``, ``portable``), or ``none``
    when no kernel could be built (dense PyTorch fallback)."""
    lib = load_library()
    return lib.gs_isa().decode() if lib is not None else "none"



# Weight formats of qmatmul.c (FMT_*): the int8 form, and GGML block types kept as stored.
FMT_I8 = 0
STORED_TYPES = ("Q4_0", "Q8_0", "Q5_0", "Q4_K", "Q6_K")  # GGML types StoredWeight keeps as stored
_FMT = {"Q4_0": 1, "Q8_0": 2, "Q5_0": 3, "Q4_K": 4, "Q6_K": 5}
# Q4_0 and Q8_0 repacked 8 rows at a time for the int8-activation products (x8.h); Q5_0 into the Q8_0
# layout (its levels fit int8 exactly: the same values, 34 bytes per 32 against 22)
FMT_Q4_0X8, FMT_Q8_0X8 = 6, 7
_X8 = {"Q4_0": FMT_Q4_0X8, "Q8_0": FMT_Q8_0X8, "Q5_0": FMT_Q8_0X8}
# K-quants as int8 levels with fp32 scales (and offsets), 8 rows at a time, for the int8-activation
# products (x8.h's FMT_I8X8): the values per scale of each
FMT_I8X8 = 10
_I8X8 = {"Q4_K": 32, "Q6_K": 16}
# ... and regrouped 8 rows at a time for the fp32-activation products (r8.h)
FMT_Q4_0R8, FMT_Q8_0R8 = 8, 9
_R8 = {"Q4_0": FMT_Q4_0R8, "Q8_0": FMT_Q8_0R8}
_R8_ISAS = ("avx512", "avx2")  # kernel paths that read the regrouped layout in place
