"""Block-quantized weights and the CPU kernels that multiply by them.

A :class:`QuantizedWeight` holds a weight matrix W [N, K] as int8 values ``q`` [N, K], an fp32
``scale`` [N, K/G] and an optional fp32 ``offset`` [N, K/G] (G = 16 or 32 values per block), so that
``W[n, k] = scale[n, k // G] * q[n, k] + offset[n, k // G]``. GGML's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K and Q6_K blocks all convert to this form without rounding
(:mod:`gemmaspec.loading.ggml_blocks`). A :class:`Q4_0Weight` keeps Q4_0 blocks as stored in the file
(half the memory of the int8 form) and multiplies them with the same bits as the int8 form. Both are
:class:`BlockWeight` objects.

Products with few rows (decode, speculative verify: M <= ``SMALL_M``) run in ``qmatmul.c``, a C
kernel compiled once per machine into the gemmaspec cache with the system C compiler (``cc``); it
reads the int8 weights straight from memory and multiplies them with fp32 activations (activations
are never quantized). Larger products (prefill) dequantize a tile of rows at a time into a reused
fp32 buffer and use PyTorch's matmul. Without a C compiler, or with ``GEMMASPEC_NO_KERNELS=1``, every product uses the
dequantized fp32 matrix, kept in memory: correct, slower, four times the memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from ..paths import cache_home
from .base import BlockWeight

log = logging.getLogger(__name__)

SMALL_M = 16  # at most this many rows go through the C kernel
TILE_BYTES = 16 << 20  # float32 bytes of a weight dequantized at once for a many-row product
_SRC = Path(__file__).with_name("qmatmul.c")
_lib = None
_lib_tried = False
_lock = threading.Lock()


ISAS = ("auto", "avx512", "avx2", "portable")
_ISA_FLAGS = {"auto": [], "avx512": [], "avx2": ["-mno-avx512f"], "portable": ["-DGS_PORTABLE"]}
_ISA_NEEDS = {"avx512": ("avx512f",), "avx2": ("avx2", "fma")}


def isa_choice() -> str:
    """The kernel instruction set asked for with ``GEMMASPEC_ISA`` (``auto``: the best this CPU has;
    ``avx2`` builds the AVX2+FMA path even on an AVX-512 CPU, to test and measure it; ``portable``
    the plain C path). An unknown value, or one this CPU cannot run, falls back to ``auto`` with a
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
    return ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", *_ISA_FLAGS[isa]]


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
    key = hashlib.sha256(
        src.read_bytes() + f"|{' '.join(_flags(isa))}|{os.uname().machine}|{_cpu_flags()}".encode()
    ).hexdigest()[:16]
    so = cache_home() / "kernels" / f"{src.stem}-{key}.so"
    try:
        if not so.exists():
            if sys.stderr.isatty():
                print(f"gemmaspec: compiling the C kernel {src.name} for this CPU (once, a few seconds)",
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
    lib.gs_qmatmul.argtypes = [P, P, P, I, I, I, P, P, I, P, I]
    lib.gs_qmatmul.restype = None
    lib.gs_dequant.argtypes = [P, P, P, I, I, I, P, I]
    lib.gs_dequant.restype = None
    lib.gs_qmatmul_q4_0.argtypes = [P, I, I, P, I, P, I]
    lib.gs_qmatmul_q4_0.restype = None
    lib.gs_dequant_q4_0.argtypes = [P, I, I, I, P, I]
    lib.gs_dequant_q4_0.restype = None
    lib.gs_block_sums.argtypes = [P, I, I, I, P]
    lib.gs_block_sums.restype = None
    lib.gs_isa.argtypes = []
    lib.gs_isa.restype = ctypes.c_char_p
    return lib


def kernel_isa() -> str:
    """The instruction-set path of the loaded kernel (``avx512``, ``avx2``, ``portable``), or ``none``
    when no kernel could be built (dense PyTorch fallback)."""
    lib = load_library()
    return lib.gs_isa().decode() if lib is not None else "none"


def _ptr(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


class CPUBlockWeight(BlockWeight):
    """The CPU formats' shared product logic (:class:`QuantizedWeight`, :class:`Q4_0Weight`; the
    interface, :class:`~gemmaspec.kernels.base.BlockWeight`, lives in ``base.py`` so that the device
    layout in ``cuda.py`` builds on it without an import cycle).

    A subclass gives ``_small(lib, x2, y)`` (the C kernel's product for at most ``SMALL_M`` rows) and
    ``_dequant_rows(lib, n0, n1, out)`` (rows n0..n1-1 of W into float32 ``out``); the product
    logic below is shared."""

    shape: tuple[int, int]
    _dense: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for x float32 [..., K] → float32 [..., N]: the C kernel for up to ``SMALL_M`` rows,
        tiles of W through PyTorch's matmul for more, a kept float32 W without a kernel."""
        n, k = self.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        lib = load_library() if x.device.type == "cpu" else None
        if lib is None:
            if self._dense is None:
                self._dense = self.dequantize()  # no kernel: keep the fp32 matrix
            return F.linear(x, self._dense)
        x2 = x2.float().contiguous()
        if x2.shape[0] > SMALL_M:
            return self._tiled(lib, x2).view(*lead, n)
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        self._small(lib, x2, y)
        return y.view(*lead, n)

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

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K], on the weight's device."""
        n, k = self.q.shape
        lib = load_library() if self.q.device.type == "cpu" else None
        if lib is not None:
            out = torch.empty(n, k, dtype=torch.float32)
            lib.gs_dequant(_ptr(self.q), _ptr(self.scale), _ptr(self.offset), n, k, self.group, _ptr(out),
                           torch.get_num_threads())
            return out
        w = self.q.view(n, k // self.group, self.group).float() * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.view(n, k)

    def _dequant_rows(self, lib, n0: int, n1: int, out: torch.Tensor) -> None:
        k = self.shape[1]
        nb = k // self.group
        off = None if self.offset is None else ctypes.c_void_p(self.offset.data_ptr() + 4 * n0 * nb)
        lib.gs_dequant(ctypes.c_void_p(self.q.data_ptr() + n0 * k), ctypes.c_void_p(self.scale.data_ptr() + 4 * n0 * nb),
                       off, n1 - n0, k, self.group, _ptr(out), torch.get_num_threads())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W as float32 [*ids.shape, K] (an embedding lookup)."""
        n, k = self.q.shape
        g = self.group
        w = self.q[ids].view(-1, k // g, g).float() * self.scale[ids].view(-1, k // g, 1)
        if self.offset is not None:
            w = w + self.offset[ids].view(-1, k // g, 1)
        return w.view(*ids.shape, k)

    def to(self, device: torch.device | str) -> BlockWeight:
        """On the CPU: a QuantizedWeight there; elsewhere the device layout (:func:`device_weight`)."""
        d = torch.device(device)
        if d.type != "cpu":
            return device_weight(self, d)
        off = None if self.offset is None else self.offset.to(d)
        return QuantizedWeight(self.q.to(d), self.scale.to(d), off, self.group)

    def _small(self, lib, x2: torch.Tensor, y: torch.Tensor) -> None:
        m, (n, k) = x2.shape[0], self.shape
        xsum = None
        if self.offset is not None:
            xsum = torch.empty(m, k // self.group, dtype=torch.float32)
            lib.gs_block_sums(_ptr(x2), m, k, self.group, _ptr(xsum))
        lib.gs_qmatmul(_ptr(self.q), _ptr(self.scale), _ptr(self.offset), n, k, self.group, _ptr(x2),
                       _ptr(xsum), m, _ptr(y), torch.get_num_threads())


Q4_0_BLOCK = 18  # bytes of a ggml block_q4_0: fp16 d, then 16 bytes holding 32 4-bit values


class Q4_0Weight(CPUBlockWeight):
    """A weight matrix W [N, K] kept as the GGUF's Q4_0 blocks (0.5625 bytes per weight, half the
    int8 form): per 32 values along K, 18 bytes = fp16 ``d`` + 16 bytes whose low nibbles are values
    0-15 and high nibbles values 16-31; ``W = d * (nibble - 8)``.

    Products are bit-identical to a :class:`QuantizedWeight` of the same values (int8 levels
    ``nibble - 8``, scale ``d``, group 32): the C kernel (``gs_qmatmul_q4_0``) unpacks the nibbles in
    registers and runs the int8 path's operations. Without a C kernel W is dequantized once and kept
    as float32 (correct, slower).

    Args:
        raw: uint8 [N, K / 32 * 18], the tensor's bytes as stored in the file.
        k: K, the row length in values (a multiple of 32).

    Raises:
        ValueError: a dtype or byte count that does not fit [N, K].
    """

    def __init__(self, raw: torch.Tensor, k: int):
        if raw.dtype != torch.uint8 or raw.dim() != 2 or k % 32 or raw.shape[1] != k // 32 * Q4_0_BLOCK:
            raise ValueError(f"bad Q4_0 weight: raw {raw.dtype} {tuple(raw.shape)} for rows of {k} values "
                             f"(need uint8 [N, {k // 32 * Q4_0_BLOCK}], K a multiple of 32)")
        self.raw, self.k = raw.contiguous(), k
        self._dense: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.k)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def levels(self, raw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, d)``: int8 levels nibble - 8 [R, K] and float32 scales [R, K / 32] of ``raw`` (uint8
        [R, K / 32 * 18] rows of blocks; default: all of W), the :class:`QuantizedWeight` form."""
        raw = self.raw if raw is None else raw
        n, nb = raw.shape[0], self.k // 32
        b = raw.reshape(n, nb, Q4_0_BLOCK)
        d = b[..., :2].contiguous().view(torch.float16)[..., 0].float()
        qs = b[..., 2:]
        q = (torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int8) - 8).reshape(n, self.k)
        return q, d

    def to_int8(self) -> QuantizedWeight:
        """The same weights as a :class:`QuantizedWeight` (int8 levels, group 32): twice the memory."""
        q, d = self.levels()
        return QuantizedWeight(q, d, None, 32)

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K]."""
        n, k = self.shape
        lib = load_library() if self.raw.device.type == "cpu" else None
        if lib is not None:
            out = torch.empty(n, k, dtype=torch.float32)
            lib.gs_dequant_q4_0(_ptr(self.raw), 0, n, k, _ptr(out), torch.get_num_threads())
            return out
        return self.rows(torch.arange(n, device=self.raw.device))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W as float32 [*ids.shape, K] (an embedding lookup); only those rows are
        unpacked."""
        q, d = self.levels(self.raw[ids.reshape(-1)])
        w = q.view(-1, self.k // 32, 32).float() * d[..., None]
        return w.view(*ids.shape, self.k)

    def to(self, device: torch.device | str) -> BlockWeight:
        """On the CPU: a Q4_0Weight there; elsewhere the device layout (:func:`device_weight`)."""
        d = torch.device(device)
        if d.type == "cpu":
            return Q4_0Weight(self.raw.to(d), self.k)
        return device_weight(self, d)

    @staticmethod
    def cat(parts: list["Q4_0Weight"]) -> "Q4_0Weight":
        """The rows of ``parts`` (same K) stacked along N, so one kernel call computes them all."""
        return Q4_0Weight(torch.cat([p.raw for p in parts]), parts[0].k)

    def _dequant_rows(self, lib, n0: int, n1: int, out: torch.Tensor) -> None:
        lib.gs_dequant_q4_0(_ptr(self.raw), n0, n1, self.shape[1], _ptr(out), torch.get_num_threads())

    def _small(self, lib, x2: torch.Tensor, y: torch.Tensor) -> None:
        n, k = self.shape
        lib.gs_qmatmul_q4_0(_ptr(self.raw), n, k, _ptr(x2), x2.shape[0], _ptr(y), torch.get_num_threads())


# --- device hook (kernels/cuda.py) ------------------------------------------------------------------
def device_weight(w: BlockWeight, device) -> BlockWeight:
    """``w`` on a non-CPU ``device``, still block-quantized: the layout of :mod:`gemmaspec.kernels.cuda`
    (:class:`~gemmaspec.kernels.cuda.DeviceQuantWeight`, about the stored size; products by its Triton
    kernel or exact tiles), never a float32 matrix. Every ``BlockWeight.to(device)`` calls this for a
    device that is not the CPU."""
    from .cuda import to_device

    return to_device(w, device)
