"""Block-quantized weights on the CPU and their products (see :mod:`gemmaspec.kernels` for the
formats): :class:`QuantizedWeight` (int8 levels + fp32 scales), :class:`StoredWeight` (the GGUF's
blocks as stored), :class:`StackedWeight` (several side by side), their shared product logic
(:class:`CPUBlockWeight`) and :func:`device_weight` (any of them on a GPU).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import build
from .base import BlockWeight
from .build import _FMT, _I8X8, _R8, _R8_ISAS, _X8, FMT_I8, FMT_I8X8, STORED_TYPES, load_library, threads
from .outbuf import output
from .regroup import _bg_ready, _release, sync_layouts

SMALL_M = 16  # at most this many rows go through the C kernel
TILE_BYTES = 16 << 20  # float32 bytes of a weight dequantized at once for a many-row product
_REPACK_ROWS = 8192  # rows repacked before the stored ones are released (a multiple of 8)


def _ptr(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())



class CPUBlockWeight(BlockWeight):
    """The CPU formats' shared product logic (:class:`QuantizedWeight`, :class:`StoredWeight`,
    :class:`StackedWeight`; the interface, :class:`~gemmaspec.kernels.base.BlockWeight`, lives in
    ``base.py`` so that the device layout in ``cuda.py`` builds on it without an import cycle).

    A subclass describes its memory as kernel segments (``_segments()``: the format number, weight
    bytes, int8 scales/offsets and group, rows) and gives ``_fallback()`` (the same weights in a form
    PyTorch can multiply without the C kernel); the product logic below is shared."""

    shape: tuple[int, int]
    _dense: torch.Tensor | None = None
    # int8 activations for this weight's products under ``--act-quant auto`` whatever the process's mode
    # (build.set_act_quant); an explicit ``none`` or ``q8_0`` still rules. Set by
    # :func:`~gemmaspec.kernels.build.auto_q8_head` (a mid-sized model's head) and
    # :func:`~gemmaspec.kernels.build.auto_q8_layers` (its layer products that the 8-row layouts hold).
    auto_q8: bool = False

    def _q8(self) -> bool:
        """Whether this weight's products multiply int8 activations now."""
        return build._act_q8 or self._marked_q8()

    def _marked_q8(self) -> bool:
        """Whether its products multiply int8 activations because it is marked ``auto_q8`` (under ``auto``)."""
        return self.auto_q8 and build._act_mode == "auto"

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
        tiles of W through PyTorch's matmul for more, a kept float32 W without a kernel. With int8
        activations (``--act-quant q8_0``) the C kernel takes any number of rows, prefill included: its
        integer dot products beat the float32 matmul there (an E2B MLP matrix, 256 rows, 2 Zen 4 threads:
        35 ms vs 124 ms), and each row's result is the one a decode step computes for it."""
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
            m, q8 = x2.shape[0], self._q8()
            if (m <= SMALL_M or q8) and args[q8] is not None:
                y = output(m, n)  # a wide round's logits on kept memory (outbuf.py)
                fns[q8](*args[q8], k, x2.data_ptr(), None, m, y.data_ptr(), threads())
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
        if x2.shape[0] > SMALL_M and not self._q8():
            return self._tiled(lib, x2).view(*lead, n)
        y = output(x2.shape[0], n)
        self._small(lib, x2, y)
        args = self.__dict__.get("_kernel_args"), self.__dict__.get("_kernel_args_q8")
        self._plan = ((lib.gs_qmatmul_multi, lib.gs_qmatmul_multi_q8), n, k,
                      tuple(None if a is None else a[0] for a in args))
        return y.view(*lead, n)

    def _small(self, lib, x2: torch.Tensor, y: torch.Tensor) -> None:
        """y float32 [M, N] = x2 float32 [M, K] @ W.T in one call of the C kernel (M <= SMALL_M, or any M
        with int8 activations)."""
        m, k = x2.shape
        q8 = self._q8()
        cached = self.kernel_args(lib, q8)
        # the kernel computes the block sums of x that offsets (Q4_K) need itself (xsum NULL)
        fn = lib.gs_qmatmul_multi_q8 if q8 else lib.gs_qmatmul_multi
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

    def dot_rows(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """float32 [n] = rows ``ids`` (int64 [n]) of W, each . x (float32 [K]): the C kernel's
        ``gs_dot_ids`` on the kernel's threads (the rows unpacked one at a time, never written out),
        or ``rows(ids) @ x`` where it does not apply."""
        segs = self._read_segments()
        k = self.shape[1]
        lib = load_library() if self._device.type == "cpu" else None
        if lib is None or len(segs) != 1 or k % 16 or x.dtype != torch.float32:
            return self.rows(ids) @ x
        fmt, w, s, o, g, _ = segs[0]
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        xc = x.contiguous()
        out = torch.empty(flat.numel(), dtype=torch.float32)
        lib.gs_dot_ids(fmt, _ptr(w), _ptr(s), _ptr(o), g, _ptr(flat), flat.numel(), k, _ptr(xc), _ptr(out), threads())
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
        """Q4_0, Q8_0 and Q5_0 with a multiple of 8 rows: the rows repacked 8 at a time (``x8.h``,
        llama.cpp's idea of ``block_q4_0x8``: one activation load and one vector of 8 scales serve 8 rows,
        one weight stream per 8 rows), built on the first int8-activation product, the same size as the
        stored bytes (Q5_0: as the Q8_0 blocks of the same values, 34 bytes per 32 values against 22,
        whose integer dot products need no unpacking of the fifth bit), which are then released from
        memory (:func:`_release`: they stay in the file). Q4_K and Q6_K: their int8 levels with fp32
        scales (and Q4_K's offsets), 8 rows at a time (``FMT_I8X8``, :meth:`_i8x8`); other types: as
        stored."""
        n = self.raw.shape[0]
        if self.qtype in _I8X8 and n % 8 == 0:
            got = self._i8x8(lib)
            if got is not None:
                return got
        if self.qtype not in _X8 or n % 8:
            return self._segments()
        if self.__dict__.get("_x8") is None:
            self._x8 = self._repacked(lib.gs_repack_x8, row_bytes=self.k // 32 * 34 if self.qtype == "Q5_0" else None)
            if self._x8 is None:
                return self._segments()
        return [(_X8[self.qtype], self._x8, None, None, 32, n)]

    def _repacked(self, repack, nthreads: int | None = None, stop=None,
                  row_bytes: int | None = None) -> torch.Tensor | None:
        """A copy of the rows in another layout (``repack``: ``gs_repack_x8`` or ``gs_repack_r8``) of
        ``row_bytes`` bytes per row (default: the stored size), built chunk by chunk on ``nthreads``
        threads (default :func:`threads`), each chunk's stored pages released once copied (so the peak
        stays one chunk above the copy's size; a released page read again comes back unchanged from the
        file or swap); None if the kernel refuses the format, or when ``stop`` (a
        :class:`threading.Event`) is set between chunks."""
        n = self.raw.shape[0]
        # pages are only taken as they are written (~0.2 s for 170 MiB here)
        out = torch.empty(n, row_bytes or self.raw.shape[1], dtype=torch.uint8)
        for r0 in range(0, n, _REPACK_ROWS):
            if stop is not None and stop.is_set():
                return None
            r1 = min(n, r0 + _REPACK_ROWS)
            if repack(_FMT[self.qtype], self.raw[r0].data_ptr(), r1 - r0, self.k, out[r0].data_ptr(),
                      nthreads or threads()):
                return None
            _release(self.raw[r0:r1])
        return out

    def _i8x8(self, lib) -> list[tuple] | None:
        """The ``FMT_I8X8`` segment of a Q4_K or Q6_K weight (``x8.h``): levels int8 [N, K] interleaved 8
        rows at a time, fp32 scales and (Q4_K) offsets [N / 8 * K / G * 8], G = 32 (Q4_K) or 16 (Q6_K):
        1.25 bytes per value against 0.5625 (Q4_K) or 0.82 (Q6_K) stored, so that int8 dot products serve
        8 weight rows per activation load without unpacking sub-block scales. Built on first use, chunk
        by chunk, each chunk's stored pages released once copied; None when the kernel refuses."""
        got = self.__dict__.get("_i8x8_seg")
        if got is None:
            n, k, g = self.raw.shape[0], self.k, _I8X8[self.qtype]
            lev = torch.empty(n, k, dtype=torch.int8)
            s = torch.empty(n * (k // g), dtype=torch.float32)
            o = torch.empty(n * (k // g), dtype=torch.float32) if self.qtype == "Q4_K" else None
            for r0 in range(0, n, _REPACK_ROWS):
                r1 = min(n, r0 + _REPACK_ROWS)
                at = r0 * (k // g)
                if lib.gs_repack_i8x8(_FMT[self.qtype], self.raw[r0].data_ptr(), r1 - r0, k, lev[r0].data_ptr(),
                                      s[at:].data_ptr(), None if o is None else o[at:].data_ptr(), threads()):
                    return None
                _release(self.raw[r0:r1])
            got = self._i8x8_seg = [(FMT_I8X8, lev, s, o, g, n)]
        return got

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
        if self.__dict__.get("_i8x8_seg") is not None:
            return self._i8x8_seg
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

    def _marked_q8(self) -> bool:
        """Under ``auto``, the stack or every one of its parts is marked ``auto_q8``
        (:func:`~gemmaspec.kernels.build.auto_q8_layers` marks a model's weights, which the model stacks)."""
        return build._act_mode == "auto" and (self.auto_q8 or all(p.auto_q8 for p in self.parts))

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
