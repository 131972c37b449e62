"""Block-quantized weights on a GPU: a compact device layout, its exact dequantization, and the
product x @ W.T without widening W to float32 in memory.

Choice of the matmul (PyTorch 2.13, Triton 3.x):

- PyTorch's weight-only ops do not fit GGML blocks exactly. ``aten._weight_int4pack_mm`` on CUDA
  takes bfloat16 activations only, a bfloat16 ``[K/g, N, 2]`` scale-and-zero table, and dequantizes
  ``(q - 8) * scale + zero`` in bfloat16 (``int4mm.cu``, sm80+ only): a Q4_0 block scale is fp16, and
  fp16 → bf16 drops 3 mantissa bits, so the weights change, and so do the float32 activations; it
  covers 4-bit levels only (not Q5_0, Q6_K, Q8_0). ``aten._weight_int8pack_mm`` takes one scale per
  output row, not one per 16/32 values.
- A Triton kernel reads the compact layout below, unpacks the levels in registers, rebuilds each
  weight exactly in float32 and accumulates float32 products: exact weights, float32 activations,
  memory traffic of the packed bytes only (what bounds decode). Triton ships with the CUDA builds of
  PyTorch on Linux, and its interpreter (``TRITON_INTERPRET=1``) runs the same kernel on the CPU, so
  the tests check it without a GPU.
- Everything else (more than ``KERNEL_MAX_ROWS`` rows, i.e. prefill; no Triton) dequantizes
  ``TILE_BYTES`` of W at a time into one reused float32 buffer with plain torch ops and multiplies with
  PyTorch's float32 matmul: exact weights, bounded extra memory, and bit-identical to the CPU
  dequantization because it is the same torch code.

So: the Triton kernel for decode and verify products, tile-wise exact dequantization for the rest.

Device layout (:class:`DeviceQuantWeight`) of W [N, K], for every GGML type handled here (Q4_0,
Q5_0, Q8_0, Q4_K, Q6_K) and for the int8 ``QuantizedWeight`` form; the level of value k is
``u[k] + bias`` with the unsigned code ``u`` split into planes:

- ``lo`` uint8 [N, K/2]: bits 0-3 of u; byte j holds value 2j (low nibble) and 2j+1 (high nibble).
- ``hi`` uint8 [N, K * hb / 8] or None: bits 4.. of u, ``hb`` = 1, 2 or 4 bits per value, value k's
  bits at byte k * hb // 8, bit (k * hb) % 8 (Q5_0: 1, Q6_K: 2, Q8_0: 4).
- ``d`` fp16 or fp32 [N, K/S] (one per super-block of S values) and optional int8 ``sc`` [N, K/G]
  (one per group of G values): ``scale = d * sc`` in float32, exact (fp16 x 8-bit integer).
- optional ``dm`` fp16/fp32 [N, K/S] and int8 ``m`` [N, K/G]: ``offset = dm * m`` (or ``dm`` alone
  when S == G), exact.

``W[n, k] = scale * (u + bias) + offset``, computed in float32 in that order: the same value as
:func:`gemmaspec.kernels.ggml_blocks.to_int8_blocks` (``scale * q + offset``) and
``gguf.quants.dequantize``. Bytes per weight: Q4_0 0.5625 and Q5_0 0.6875, Q8_0 1.0625, Q6_K
0.8203 (all as stored), Q4_K 0.578 (stored 0.5625: its 6-bit sub-scales take a byte here).

Not yet measured on a GPU: ``benchmarks/cuda_check.py`` runs the CUDA tests, decode speed and GPU
memory in one go on a machine that has one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import BlockWeight

KERNEL_MAX_ROWS = 16  # products of at most this many rows use the Triton kernel
TILE_BYTES = 32 << 20  # float32 bytes of W dequantized at once for a many-row product (or without Triton)
CONVERT_BYTES = 16 << 20  # stored bytes converted at once when building the layout (bounds transients)

QTYPES = ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K")


@dataclass(frozen=True)
class _Format:
    """How one GGML type maps onto the layout: values and bytes per stored block, code bits beyond
    4 (hb), level bias, group G (values per sub-scale), super-block S (values per fp16 scale)."""

    block: int
    block_bytes: int
    hb: int
    bias: int
    group: int
    superblock: int
    sub_scales: bool
    offsets: bool


FORMATS = {
    "Q4_0": _Format(32, 18, 0, -8, 32, 32, False, False),
    "Q5_0": _Format(32, 22, 1, -16, 32, 32, False, False),
    "Q8_0": _Format(32, 34, 4, -128, 32, 32, False, False),
    "Q4_K": _Format(256, 144, 0, 0, 32, 256, True, True),
    "Q6_K": _Format(256, 210, 2, -32, 16, 256, True, False),
}


def qtype_name(qtype) -> str:
    """``"Q4_0"`` for ``"q4_0"``, ``"Q4_0"`` or ``gguf.GGMLQuantizationType.Q4_0``."""
    return (qtype.name if hasattr(qtype, "name") else str(qtype)).upper()


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last axis of 2 bytes (uint8 [..., 2]) → float16 [...]."""
    return b.contiguous().view(torch.float16)[..., 0]


def _k_scales_mins(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K: 12 bytes of packed 6-bit scales and mins (uint8 [..., 12]) → (uint8 [..., 8], uint8 [..., 8])."""
    lo_s, lo_m, rest = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = torch.cat([lo_s & 63, (rest & 0x0F) | ((lo_s >> 6) << 4)], dim=-1)
    mins = torch.cat([lo_m & 63, (rest >> 4) | ((lo_m >> 6) << 4)], dim=-1)
    return scales, mins


def _decode_blocks(b: torch.Tensor, qtype: str):
    """Stored blocks uint8 [R, nb, block_bytes] → (u uint8 [R, nb * block], d fp16 [R, nb * per-super],
    sc int8 or None, dm fp16 or None, m int8 or None), all torch ops on b's device."""
    r, nb = b.shape[0], b.shape[1]
    sc = dm = m = None
    if qtype in ("Q4_0", "Q5_0", "Q8_0"):
        d = _f16(b[..., 0:2])
        if qtype == "Q8_0":
            u = b[..., 2:34] ^ 0x80  # int8 level x as the unsigned code x + 128
        else:
            qs = b[..., 2:18] if qtype == "Q4_0" else b[..., 6:22]
            u = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # values 0-15 low nibbles, 16-31 high
            if qtype == "Q5_0":  # bit j of the little-endian uint32 qh is value j's fifth bit
                bits = (b[..., 2:6, None] >> torch.arange(8, dtype=torch.uint8, device=b.device)) & 1
                u = u | (bits.reshape(r, nb, 32) << 4)
    elif qtype == "Q4_K":
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        scales, mins = _k_scales_mins(b[..., 4:16])
        qs = b[..., 16:144].reshape(r, nb, 4, 32)  # chunk c: sub-block 2c low nibbles, 2c+1 high
        u = torch.stack([qs & 0x0F, qs >> 4], dim=3)
        sc, m, dm = scales.view(torch.int8), mins.view(torch.int8), -dmin  # negation is exact in fp16
    elif qtype == "Q6_K":
        ql = b[..., 0:128].reshape(r, nb, 2, 64)
        qh = b[..., 128:192].reshape(r, nb, 2, 32)
        sc = b[..., 192:208].contiguous().view(torch.int8)
        d = _f16(b[..., 208:210])
        low = torch.cat([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=-1)
        high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)
        u = low | (high << 4)
    else:  # pragma: no cover - guarded by callers
        raise ValueError(qtype)
    flat = lambda t: None if t is None else t.reshape(r, -1)  # noqa: E731
    return u.reshape(r, -1), flat(d), flat(sc), flat(dm), flat(m)


def _pack(u: torch.Tensor, hb: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes uint8 [R, K] → (lo uint8 [R, K/2], hi uint8 [R, K*hb/8] or None)."""
    lo = (u[:, 0::2] & 0x0F) | ((u[:, 1::2] & 0x0F) << 4)
    if not hb:
        return lo, None
    per = 8 // hb
    h = (u >> 4).view(u.shape[0], -1, per)
    hi = h[..., 0].clone()
    for i in range(1, per):
        hi |= h[..., i] << (i * hb)
    return lo, hi


class DeviceQuantWeight(BlockWeight):
    """A weight matrix W [N, K] kept block-quantized on a device (see the module docstring for the
    layout and the products). Build one with :meth:`from_stored`, :meth:`from_int8` or
    :func:`to_device`; it offers what every :class:`~gemmaspec.kernels.BlockWeight` does.

    Args:
        lo, hi, hb, bias: the level planes (``u = lo | hi << 4``, level ``u + bias``).
        d, sc, dm, m: scales and offsets (``scale = d * sc``, ``offset = dm * m``).
        group: G, values per ``sc``/``m`` entry (16 or 32); superblock: S, values per ``d``/``dm``.
        k: K.
        qtype: the source format's name (``Q4_0``... or ``int8``), for reports.

    Raises:
        ValueError: planes whose shapes or dtypes do not fit [N, K].
    """

    def __init__(self, lo, hi, hb: int, bias: int, d, sc, dm, m, group: int, superblock: int, k: int,
                 qtype: str = "int8"):
        n = lo.shape[0]
        problems = []
        if lo.dtype != torch.uint8 or tuple(lo.shape) != (n, k // 2) or k % 2:
            problems.append(f"lo {lo.dtype} {tuple(lo.shape)}")
        if hb not in (0, 1, 2, 4) or (hb == 0) != (hi is None):
            problems.append(f"hb {hb} with hi {None if hi is None else tuple(hi.shape)}")
        elif hi is not None and (hi.dtype != torch.uint8 or tuple(hi.shape) != (n, k * hb // 8)):
            problems.append(f"hi {hi.dtype} {tuple(hi.shape)}")
        if group not in (16, 32) or superblock % group or k % superblock:
            problems.append(f"group {group}, superblock {superblock}")
        else:
            if d.dtype not in (torch.float16, torch.float32) or tuple(d.shape) != (n, k // superblock):
                problems.append(f"d {d.dtype} {tuple(d.shape)}")
            if dm is not None and (dm.dtype not in (torch.float16, torch.float32) or dm.shape != d.shape):
                problems.append(f"dm {dm.dtype} {tuple(dm.shape)}")
            for name, t in (("sc", sc), ("m", m)):
                if t is not None and (t.dtype != torch.int8 or tuple(t.shape) != (n, k // group)):
                    problems.append(f"{name} {t.dtype} {tuple(t.shape)}")
            if superblock != group and (sc is None or (dm is not None and m is None)):
                problems.append("super-blocks larger than a group need sub-scales (and sub-offsets)")
            if m is not None and dm is None:
                problems.append("m without dm")
        if problems:
            raise ValueError(f"bad device weight for [{n}, {k}]: " + "; ".join(problems))
        self.lo, self.hi, self.hb, self.bias = lo.contiguous(), None if hi is None else hi.contiguous(), hb, int(bias)
        self.d, self.sc, self.dm, self.m = d.contiguous(), sc, dm, m
        self.sc = None if sc is None else sc.contiguous()
        self.dm = None if dm is None else dm.contiguous()
        self.m = None if m is None else m.contiguous()
        self.group, self.superblock, self.k, self.qtype = group, superblock, k, qtype
        self._dense = None

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_stored(cls, raw: torch.Tensor, qtype, k: int, device=None) -> "DeviceQuantWeight":
        """The layout of a GGML tensor's stored blocks.

        Args:
            raw: uint8 [N, K / block * block_bytes], the tensor's bytes as in the GGUF file (any device).
            qtype: ``Q4_0``, ``Q5_0``, ``Q8_0``, ``Q4_K`` or ``Q6_K`` (a string or ``gguf.GGMLQuantizationType``).
            k: K, values per row.
            device: where the layout goes (default: raw's device). Rows are moved and converted
                ``CONVERT_BYTES`` at a time, so the device never holds more than the layout plus one chunk.

        Raises:
            ValueError: an unsupported type, or bytes that do not fit [N, K].
        """
        name = qtype_name(qtype)
        fmt = FORMATS.get(name)
        if fmt is None:
            raise ValueError(f"tensor type {name} has no device layout; supported: {', '.join(QTYPES)}")
        if k <= 0 or k % fmt.block:
            raise ValueError(f"{name} rows of {k} values: K must be a positive multiple of {fmt.block}")
        nb = k // fmt.block
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != nb * fmt.block_bytes:
            raise ValueError(f"{name} tensor with rows of {k} values needs uint8 [N, {nb * fmt.block_bytes}], "
                             f"got {raw.dtype} {tuple(raw.shape)}")
        dev = torch.device(device) if device is not None else raw.device
        n = raw.shape[0]
        lo = torch.empty(n, k // 2, dtype=torch.uint8, device=dev)
        hi = torch.empty(n, k * fmt.hb // 8, dtype=torch.uint8, device=dev) if fmt.hb else None
        d = torch.empty(n, nb, dtype=torch.float16, device=dev)
        sc = torch.empty(n, k // fmt.group, dtype=torch.int8, device=dev) if fmt.sub_scales else None
        dm = torch.empty(n, nb, dtype=torch.float16, device=dev) if fmt.offsets else None
        m = torch.empty(n, k // fmt.group, dtype=torch.int8, device=dev) if fmt.offsets else None
        rows = max(1, CONVERT_BYTES // max(1, raw.shape[1]))
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            b = raw[r0:r1].to(dev).view(r1 - r0, nb, fmt.block_bytes)
            u, dd, ss, ddm, mm = _decode_blocks(b, name)
            lo[r0:r1], h = _pack(u, fmt.hb)
            if hi is not None:
                hi[r0:r1] = h
            d[r0:r1] = dd
            for dst, src in ((sc, ss), (dm, ddm), (m, mm)):
                if dst is not None:
                    dst[r0:r1] = src
        return cls(lo, hi, fmt.hb, fmt.bias, d, sc, dm, m, fmt.group, fmt.superblock, k, name)

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int,
                  device=None) -> "DeviceQuantWeight":
        """The layout of the int8 form (``QuantizedWeight``: ``W = scale * q + offset`` per group of
        16 or 32 values): levels packed into the fewest planes their range needs (a Q4_K- or
        Q4_0-derived weight takes 4 bits), fp32 scales and offsets kept as they are.

        Raises:
            ValueError: shapes or dtypes that do not fit (see ``QuantizedWeight``).
        """
        if q.dtype != torch.int8 or q.dim() != 2 or scale.dtype != torch.float32 or group not in (16, 32) \
                or q.shape[1] % group or tuple(scale.shape) != (q.shape[0], q.shape[1] // group) \
                or (offset is not None and (offset.dtype != torch.float32 or offset.shape != scale.shape)):
            raise ValueError(f"bad int8 weight: q {q.dtype} {tuple(q.shape)}, scale {scale.dtype} "
                             f"{tuple(scale.shape)}, group {group}")
        dev = torch.device(device) if device is not None else q.device
        n, k = q.shape
        qmin = int(q.min()) if q.numel() else 0
        qmax = int(q.max()) if q.numel() else 0
        span = qmax - qmin
        hb = next(b for b in (0, 1, 2, 4) if span < 1 << (4 + b))
        lo = torch.empty(n, k // 2, dtype=torch.uint8, device=dev)
        hi = torch.empty(n, k * hb // 8, dtype=torch.uint8, device=dev) if hb else None
        rows = max(1, CONVERT_BYTES // max(1, k))
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            u = (q[r0:r1].to(dev).to(torch.int16) - qmin).to(torch.uint8)
            lo[r0:r1], h = _pack(u, hb)
            if hi is not None:
                hi[r0:r1] = h
        off = None if offset is None else offset.to(dev)
        return cls(lo, hi, hb, qmin, scale.to(dev), None, off, None, group, group, k, "int8")

    # --- BlockWeight --------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        return (self.lo.shape[0], self.k)

    @property
    def device(self) -> torch.device:
        return self.lo.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lo, self.hi, self.d, self.sc, self.dm, self.m)
                   if t is not None)

    def _parts(self):
        return (self.lo, self.hi, self.d, self.sc, self.dm, self.m)

    def _rebuild(self, parts) -> "DeviceQuantWeight":
        lo, hi, d, sc, dm, m = parts
        return DeviceQuantWeight(lo, hi, self.hb, self.bias, d, sc, dm, m, self.group, self.superblock, self.k,
                                 self.qtype)

    def to(self, device) -> "DeviceQuantWeight":
        """The same layout on ``device`` (CPU included: products then take the tile path)."""
        dev = torch.device(device)
        return self._rebuild([None if t is None else t.to(dev) for t in self._parts()])

    @staticmethod
    def cat(parts: list["DeviceQuantWeight"]) -> "DeviceQuantWeight | None":
        """The rows of ``parts`` stacked along N (one kernel call for fused q/k/v or gate/up), or None
        when their layouts differ (format, K, bias, device)."""
        p0 = parts[0]
        key = lambda p: (p.k, p.hb, p.bias, p.group, p.superblock, p.device, p.d.dtype,  # noqa: E731
                         p.sc is None, p.dm is None, p.m is None, None if p.dm is None else p.dm.dtype)
        if any(key(p) != key(p0) for p in parts):
            return None
        cols = zip(*(p._parts() for p in parts))
        return p0._rebuild([None if c[0] is None else torch.cat(c) for c in cols])

    def _scale_offset(self, r0: int, r1: int):
        """float32 scale and offset (or None) of rows r0..r1-1, one per group: [R, K/G]."""
        rep = self.superblock // self.group
        scale = self.d[r0:r1].float()
        if rep > 1:
            scale = scale.repeat_interleave(rep, dim=1)
        if self.sc is not None:
            scale = scale * self.sc[r0:r1].float()
        off = None
        if self.dm is not None:
            off = self.dm[r0:r1].float()
            if rep > 1:
                off = off.repeat_interleave(rep, dim=1)
            if self.m is not None:
                off = off * self.m[r0:r1].float()
        return scale, off

    def _codes(self, r0: int, r1: int) -> torch.Tensor:
        """Unsigned codes u uint8 [R, K] of rows r0..r1-1."""
        lo = self.lo[r0:r1]
        u = torch.stack([lo & 0x0F, lo >> 4], dim=-1).view(r1 - r0, self.k)
        if self.hi is not None:
            per = 8 // self.hb
            h = self.hi[r0:r1]
            mask = (1 << self.hb) - 1
            high = torch.stack([(h >> (i * self.hb)) & mask for i in range(per)], dim=-1).view(r1 - r0, self.k)
            u = u | (high << 4)
        return u

    def _dequant_rows(self, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows r0..r1-1 of W into ``out`` float32 [R, K] (on the weight's device), exactly:
        ``(u + bias) * scale`` then ``+ offset``, as separate float32 operations."""
        out.copy_(self._codes(r0, r1))
        out.add_(self.bias)
        scale, off = self._scale_offset(r0, r1)
        g = out.view(r1 - r0, self.k // self.group, self.group)
        g.mul_(scale[..., None])
        if off is not None:
            g.add_(off[..., None])
        return out

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K] on the weight's device (the whole matrix: for tests and small weights)."""
        n, k = self.shape
        return self._dequant_rows(0, n, torch.empty(n, k, dtype=torch.float32, device=self.device))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W as float32 [*ids.shape, K] on the weight's device (an embedding lookup;
        only those rows are unpacked)."""
        flat = ids.reshape(-1).to(self.device)
        sub = self._rebuild([None if t is None else t[flat] for t in self._parts()])
        return sub.dequantize().view(*ids.shape, self.k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for x float [..., K] → float32 [..., N]: the Triton kernel for up to
        ``KERNEL_MAX_ROWS`` rows on a CUDA device (when Triton is there), else tiles of W dequantized
        into a reused float32 buffer and PyTorch's matmul.

        Raises:
            ValueError: x's last dimension is not K.
        """
        n, k = self.shape
        if x.shape[-1] != k:
            raise ValueError(f"input of {x.shape[-1]} features for a weight of {k}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k).to(device=self.device, dtype=torch.float32).contiguous()
        if x2.shape[0] <= KERNEL_MAX_ROWS and use_kernel(self.device):
            return kernel_matmul(self, x2).view(*lead, n)
        return self._tiled(x2).view(*lead, n)

    def _tiled(self, x2: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        rows = max(1, min(n, TILE_BYTES // (4 * k)))
        buf = _scratch(self.device, rows * k)[:rows * k].view(rows, k)
        y = torch.empty(x2.shape[0], n, dtype=torch.float32, device=self.device)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            w = self._dequant_rows(r0, r1, buf[:r1 - r0])
            y[:, r0:r1] = F.linear(x2, w)
        return y


_scratch_bufs: dict = {}


def _scratch(device: torch.device, numel: int) -> torch.Tensor:
    """One float32 buffer per device, reused by every tile product (products run one at a time)."""
    buf = _scratch_bufs.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.float32, device=device)
        _scratch_bufs[device] = buf
    return buf


def to_device(w, device) -> "DeviceQuantWeight":
    """Any block-quantized weight on ``device`` in the device layout: a GGML tensor kept as stored
    (an object with ``raw``, ``qtype`` and ``k``, or a Q4_0 one with ``raw`` and ``k``), the int8 form
    (``q``, ``scale``, ``offset``, ``group``), or a :class:`DeviceQuantWeight`.

    Raises:
        TypeError: an object of none of these kinds.
        ValueError: an unsupported GGML type.
    """
    if isinstance(w, DeviceQuantWeight):
        return w.to(device)
    if hasattr(w, "raw") and hasattr(w, "k"):
        return DeviceQuantWeight.from_stored(w.raw, getattr(w, "qtype", "Q4_0"), w.k, device=device)
    if hasattr(w, "q") and hasattr(w, "scale"):
        return DeviceQuantWeight.from_int8(w.q, w.scale, w.offset, w.group, device=device)
    raise TypeError(f"{type(w).__name__} is not a block-quantized weight")


# --- the Triton kernel ------------------------------------------------------------------------

_kernel = None
_kernel_tried = False


def triton_kernel():
    """The jitted Triton kernel, or None when Triton cannot be imported. Built on first use (so
    ``TRITON_INTERPRET=1`` set before that runs it on the CPU)."""
    global _kernel, _kernel_tried
    if _kernel_tried:
        return _kernel
    _kernel_tried = True
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def qmm(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, dm_ptr, m_ptr, y_ptr, M, N, K, K_PER,
            BIAS: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
            HAS_SC: tl.constexpr, HAS_DM: tl.constexpr, HAS_M: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # program (pid_n, pid_k): outputs rn of every row, over values [pid_k * K_PER, +K_PER) of K
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BN + tl.arange(0, BN)
        nmask = rn < N
        rn64 = rn.to(tl.int64)
        rm = tl.arange(0, BM)
        mmask = rm < M
        jb = tl.arange(0, BK // 2)
        half = K // 2
        n_sup = K // S
        n_grp = K // G
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_start = pid_k * K_PER
        k_end = tl.minimum(K, k_start + K_PER)
        for k0 in range(k_start, k_end, BK):
            kb = k0 // 2 + jb  # byte index of values (2kb, 2kb + 1)
            kmask = (2 * kb) < k_end
            wmask = nmask[:, None] & kmask[None, :]
            byte = tl.load(lo_ptr + rn64[:, None] * half + kb[None, :], mask=wmask, other=0).to(tl.int32)
            ke = 2 * kb
            ue = byte & 15
            uo = byte >> 4
            if HB > 0:  # 8 // HB values per byte of hi; value k's bits at byte k * HB // 8
                hrow = rn64[:, None] * (K * HB // 8)
                he = tl.load(hi_ptr + hrow + (ke * HB // 8)[None, :], mask=wmask, other=0).to(tl.int32)
                ho = tl.load(hi_ptr + hrow + ((ke + 1) * HB // 8)[None, :], mask=wmask, other=0).to(tl.int32)
                ue = ue | (((he >> ((ke * HB) % 8)[None, :]) & ((1 << HB) - 1)) << 4)
                uo = uo | (((ho >> (((ke + 1) * HB) % 8)[None, :]) & ((1 << HB) - 1)) << 4)
            s_idx = rn64[:, None] * n_sup + (ke // S)[None, :]
            g_idx = rn64[:, None] * n_grp + (ke // G)[None, :]
            scale = tl.load(d_ptr + s_idx, mask=wmask, other=0).to(tl.float32)
            if HAS_SC:
                scale = scale * tl.load(sc_ptr + g_idx, mask=wmask, other=0).to(tl.float32)
            we = (ue + BIAS).to(tl.float32) * scale
            wo = (uo + BIAS).to(tl.float32) * scale
            if HAS_DM:
                off = tl.load(dm_ptr + s_idx, mask=wmask, other=0).to(tl.float32)
                if HAS_M:
                    off = off * tl.load(m_ptr + g_idx, mask=wmask, other=0).to(tl.float32)
                we = we + off
                wo = wo + off
            xmask = mmask[:, None] & kmask[None, :]
            xe = tl.load(x_ptr + rm[:, None] * K + ke[None, :], mask=xmask, other=0.0)
            xo = tl.load(x_ptr + rm[:, None] * K + (ke + 1)[None, :], mask=xmask, other=0.0)
            acc += tl.sum(xe[:, None, :] * we[None, :, :], axis=2)
            acc += tl.sum(xo[:, None, :] * wo[None, :, :], axis=2)
        out = y_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc, mask=mmask[:, None] & nmask[None, :])

    _kernel = qmm
    return _kernel


def use_kernel(device: torch.device) -> bool:
    """Whether products on ``device`` may use the Triton kernel: a CUDA device (or any device when
    ``TRITON_INTERPRET=1``, as in the tests), Triton importable, and ``GEMMASPEC_CUDA_KERNEL`` not
    ``tiles`` (which forces the tile path, to compare the two)."""
    if os.environ.get("GEMMASPEC_CUDA_KERNEL", "").lower() == "tiles":
        return False
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return triton_kernel() is not None


def _blocks(m: int) -> tuple[int, int, int]:
    """(BM, BN, BK) for m rows: BM the next power of two, BM * BN * BK / 2 about 8K products a step."""
    bm = 1 << max(0, (m - 1).bit_length())
    bn = {1: 64, 2: 64, 4: 32, 8: 32}.get(bm, 16)
    return bm, bn, 128


def kernel_matmul(w: DeviceQuantWeight, x2: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """x2 float32 [M, K] (M <= ``KERNEL_MAX_ROWS``, contiguous, on w's device) @ W.T → float32 [M, N]
    with the Triton kernel. K is split over ``split`` programs (default: enough that the N blocks
    keep every multiprocessor of the GPU busy twice over); their partial sums are added by
    ``torch.sum`` (a fixed order)."""
    kern = triton_kernel()
    m, (n, k) = x2.shape[0], w.shape
    if kern is None:
        raise RuntimeError("the Triton kernel needs the triton package (it comes with PyTorch's CUDA builds)")
    if not 1 <= m <= KERNEL_MAX_ROWS or x2.shape[1] != k:
        raise ValueError(f"kernel product of x {tuple(x2.shape)} with W [{n}, {k}]: need 1..{KERNEL_MAX_ROWS} rows of {k}")
    bm, bn, bk = _blocks(m)
    n_blocks = -(-n // bn)
    if split is None:
        sms = torch.cuda.get_device_properties(w.device).multi_processor_count if w.device.type == "cuda" else 1
        split = min(-(-2 * sms // n_blocks), k // (4 * bk))
    split = max(1, min(split, -(-k // bk)))
    k_per = -(-(-(-k // split)) // bk) * bk
    split = -(-k // k_per)
    y = torch.empty(split, m, n, dtype=torch.float32, device=w.device)
    dummy = w.lo  # a pointer for absent planes (never read: the constexpr flags are off)
    kern[(n_blocks, split)](
        x2, w.lo, w.hi if w.hi is not None else dummy, w.d, w.sc if w.sc is not None else dummy,
        w.dm if w.dm is not None else dummy, w.m if w.m is not None else dummy, y, m, n, k, k_per,
        BIAS=w.bias, HB=w.hb, G=w.group, S=w.superblock, HAS_SC=w.sc is not None, HAS_DM=w.dm is not None,
        HAS_M=w.m is not None, BM=bm, BN=bn, BK=bk)
    return y[0] if split == 1 else y.sum(0)
