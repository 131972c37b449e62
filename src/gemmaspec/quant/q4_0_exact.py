"""Exact Q4_0 packing of weights that already lie on a 4-bit grid (QAT checkpoints).

Q4_0 (ggml ``block_q4_0``): 32 consecutive values along a row (the input dimension, GGUF ne0) share
an fp16 scale d; each value is d·(q − 8) with q ∈ [0, 15]; byte j of the 16 packed bytes holds q[j]
in its low nibble and q[j+16] in its high nibble.

A QAT block holds values round_src(s·k), k ∈ [−8, 7]. Rounding to the nearest level with d = amax/8
(the usual quantizer) is wrong whenever a block's peak sits below level 8 (about 5 % error,
silently). Here each block's step is recovered instead. Every candidate fp16 step d is scored by its
reconstruction d·level (float32) against the source, best first by:

1. every value within ``tolerance_ulp`` units in the source's last place (the block is on the grid);
2. more values reproduced bit-exactly after rounding d·level to the source format (bf16, f16 or f32:
   what a model that computes in the source's dtype reads back);
3. among steps reproducing all 32 that way, more values reproduced in float32 itself (the trained
   step, when fp16 holds it, keeps its float32 products s·k);
4. the smaller worst error, then the earlier candidate.

The candidates: for every level k the peak could sit on (±1..±8, sign free, as ggml's d may be
negative), s = peak/k and its least-squares refinement over the block, rounded to fp16, with the
least-squares step's two fp16 neighbours (levels -8, 7, -7, ±6 on every block; the rest on a block
still off the grid, and on a block on the grid but not all bit-exact only as a bit-exact fit d = peak
/ k). Whenever some fp16 step reproduces all 32 values bit for bit in float32, the search finds one: in
such a fit the peak is d·k for its own level k, so d = peak / k exactly (docs/quantize.md gives the
argument). A block on the grid and still not all bit-exact in float32 then scores the steps read off
its values on levels ±1, ±2, ±4, -8 (value / level), and every fp16 step within ``WINDOW`` fp16 units
of the best so far (both signs, the best's levels): where the trained step is a float32 number that
fp16 cannot hold, the step reproducing the most values after rounding lies there. The window's steps
are counted cheaply first and fully scored only when they could beat the best.
A block still off the grid after every peak level also scores the plain search of issue 33: f16(m / k)
for each distinct nonzero magnitude m of the block and k = 1..8, both signs, levels rint(v / d)
clipped to [-8, 7], so a block left off the grid reproduces at least as many values as that search.
A block whose reconstruction misses a value by more than ``tolerance_ulp`` fits no grid and is
reported off-grid.

The search runs in C (``kernels/q4pack.c``, same candidates, order and tie rules, bit-identical
results; about 100x faster) when a compiler is at hand; this module's numpy version is the reference
and the fallback.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

QK, Q4_0_BYTES = GGML_QUANT_SIZES[T.Q4_0]  # 32 values per block in 18 bytes
_STAGE1 = (-8, 7, -7, 6, -6)  # peak levels tried on every block (finer steps first)
_STAGE2 = (5, 4, 3, 2, 1, -1, -2, -3, -4, -5)  # the others
WINDOW = 8  # fp16 units either side of the best step scored by the last pass (_window_steps)
SOURCE_FORMATS = {7: "bf16", 10: "f16", 23: "f32"}  # mantissa bits -> the source format


@dataclass
class PackResult:
    """Exact packing of one tensor.

    Attributes:
        d: float16 [B] block scales; levels: int8 [B, 32] in [-8, 7] (B = blocks in row order).
        on_grid: bool [B]; exact: int [B] values reproduced bit-exactly per block (float32 d·level equal
            to the source value).
        exact_src: int [B] values reproduced bit-exactly after rounding d·level to the source format
            (bf16/f16; for an f32 source the same as ``exact``): what the search maximizes.
        max_err_ulp: float [B] worst error per block in units of the source's last place.
        sq_err, sq_src: float64 [B] per block: sum of squared reconstruction errors, sum of squared
            source values (for relative Frobenius errors).
    """

    d: np.ndarray
    levels: np.ndarray
    on_grid: np.ndarray
    exact: np.ndarray
    max_err_ulp: np.ndarray
    exact_src: np.ndarray | None = None
    sq_err: np.ndarray | None = None
    sq_src: np.ndarray | None = None
    packed: np.ndarray | None = None

    def q4_0_bytes(self) -> np.ndarray:
        """uint8 [B, 18]: ggml ``block_q4_0`` (fp16 d, then 16 bytes of nibble pairs)."""
        if self.packed is not None:
            return self.packed
        q = (self.levels.astype(np.int16) + 8).astype(np.uint8)
        packed = (q[:, :16] & 0x0F) | (q[:, 16:] << 4)
        return np.concatenate([self.d.astype(np.float16).view(np.uint8).reshape(-1, 2), packed], axis=1)


def ulp(v: np.ndarray, mantissa_bits: int) -> np.ndarray:
    """Unit in the last place (float64, shape of ``v``) of float32 values ``v`` in a source format
    with that many explicit mantissa bits (bf16 7, f16 10, f32 23)."""
    a = np.abs(v.astype(np.float64))
    exp = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    exp = np.maximum(exp, -126)  # float32/bf16 normal range
    return np.where(a > 0, 2.0 ** (exp - mantissa_bits), 2.0 ** (-126 - mantissa_bits))


def round_to_source(x: np.ndarray, mantissa_bits: int) -> np.ndarray:
    """float32 ``x`` (any shape) rounded to the nearest number of the source format (round half to
    even): bf16 (7 mantissa bits), f16 (10; with its subnormals, and past 65504 to inf) or f32 (23,
    unchanged). Returns float32 of ``x``'s shape."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if mantissa_bits == 10:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if mantissa_bits == 23:
        return x
    b = x.view(np.uint32)  # bf16: the upper 16 bits, rounded on the lower 16 (a carry reaches the exponent)
    return ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)


@dataclass
class _Blocks:
    """The blocks being searched: v float32 [B, 32], v64 its float64 copy, u each value's ulp."""

    v: np.ndarray
    v64: np.ndarray
    u: np.ndarray
    mbits: int
    tol: float

    def take(self, idx: np.ndarray) -> "_Blocks":
        return _Blocks(self.v[idx], self.v64[idx], self.u[idx], self.mbits, self.tol)


def _key_better(err, src, f32, best, tol):
    """Whether a candidate's (err, src, f32) [B] beats ``best`` (d, levels, src, f32, err): within
    ``tol`` beats not; then more values exact in the source format; then, both reproducing all 32 that
    way, more exact in float32; then the smaller worst error."""
    b_src, b_f32, b_err = best[2], best[3], best[4]
    ok, b_ok = err <= tol, b_err <= tol
    t, b_t = np.where(src == QK, f32, -1), np.where(b_src == QK, b_f32, -1)
    rest = (src > b_src) | ((src == b_src) & ((t > b_t) | ((t == b_t) & (err < b_err))))
    return (ok & ~b_ok) | ((ok == b_ok) & rest)


def _score(k: _Blocks, d, levels, valid, best):
    """Keep fp16 step ``d`` [B] with float ``levels`` [B, 32] where ``valid`` and better than ``best``
    (d, levels, src, f32, err) by :func:`_key_better`."""
    recon = d.astype(np.float32)[:, None] * levels.astype(np.float32)
    f32 = (recon == k.v).sum(axis=1)
    src = (round_to_source(recon, k.mbits) == k.v).sum(axis=1)
    err = (np.abs(recon.astype(np.float64) - k.v64) / k.u).max(axis=1)
    better = valid & _key_better(err, src, f32, best, k.tol)
    lv = np.where(valid[:, None], levels, 0).astype(np.int8)
    return (np.where(better, d, best[0]), np.where(better[:, None], lv, best[1]), np.where(better, src, best[2]),
            np.where(better, f32, best[3]), np.where(better, err, best[4]))


def _value_steps(k: _Blocks, best):
    """Steps read off single values (blocks on the grid, not all bit-exact): with a step of at most 11
    significant bits, a value on level ±1, ±2, ±4 or -8 is step·level exactly, so value / level is the
    step itself, which the peak (a rounded step·3, 5, 6 or 7) and the least-squares fit only come near.
    For each magnitude 8, 4, 2, 1 among the block's current levels, the first such value gives
    d = f16(v / level), scored with levels rint(v / d) unless it is the block's step already."""
    cur, d_start = best[1].astype(np.int16), best[0].view(np.uint16).copy()
    rows = np.arange(k.v.shape[0])
    for m in (8, 4, 2, 1):
        on_m = np.abs(cur) == m
        has = on_m.any(axis=1)
        at = on_m.argmax(axis=1)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            d = (k.v64[rows, at] / np.where(has, cur[rows, at], 1)).astype(np.float16)
            d64 = d.astype(np.float64)
            levels = np.rint(k.v64 / d64[:, None])
            valid = has & (d64 != 0) & (d.view(np.uint16) != d_start) & ((levels >= -8) & (levels <= 7)).all(axis=1)
        best = _score(k, d, np.clip(levels, -8, 7), valid, best)
    return best


def _search(k: _Blocks, peak, ks, start=None):
    """Best (d, levels, src, f32, err) per block over peak levels ``ks``."""
    b = k.v.shape[0]
    if start is None:
        start = (np.zeros(b, dtype=np.float16), np.zeros((b, QK), dtype=np.int8), np.full(b, -1, dtype=np.int64),
                 np.full(b, -1, dtype=np.int64), np.full(b, np.inf))
    best = tuple(x.copy() for x in start)
    for lvl in ks:  # finer steps first: ties keep them
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(peak != 0, peak / lvl, 0.0)
            levels = np.rint(np.where(s[:, None] != 0, k.v64 / s[:, None], 0.0))
        valid = ((levels >= -8) & (levels <= 7)).all(axis=1)
        levels = np.clip(levels, -8, 7)
        den = (levels * levels).sum(axis=1)
        s_ls = np.where(den > 0, (k.v64 * levels).sum(axis=1) / np.where(den > 0, den, 1.0), 0.0)
        d_ls = s_ls.astype(np.float16)
        steps = (s.astype(np.float16), d_ls, np.nextafter(d_ls, np.float16(np.inf)), np.nextafter(d_ls, np.float16(-np.inf)))
        for d in steps:  # the fitted fp16 step and its two neighbours: the source's rounding can hide the true one
            best = _score(k, d, levels, valid, best)
    return best


def _magnitude_steps(k: _Blocks, best):
    """Blocks still off the grid after every peak level: the plain search of issue 33. For k = 1..8, for
    each distinct nonzero magnitude m of the block (in block order, its first value), d = f16(m / k),
    scored as +d, then -d, with levels rint(v / d) clipped to [-8, 7] (a d that rounds to 0 or past
    65504 is skipped)."""
    a = np.abs(k.v64)
    earlier = np.tril(np.ones((QK, QK), dtype=bool), -1)  # [i, j]: j < i
    first = (a != 0) & ~((a[:, :, None] == a[:, None, :]) & earlier).any(axis=2)
    for div in range(1, 9):
        for i in range(QK):
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                d = (a[:, i] / div).astype(np.float16)
                d64 = d.astype(np.float64)
                levels = np.rint(k.v64 / np.where(d64 != 0, d64, 1.0)[:, None])
            valid = first[:, i] & (d64 != 0) & np.isfinite(d64)
            d = np.where(valid, d, np.float16(0))
            best = _score(k, d, np.clip(levels, -8, 7), valid, best)
            best = _score(k, -d, np.clip(-levels, -8, 7), valid, best)
    return best


def _exact_steps(v, peak, ks):
    """Per block, the first level k of ``ks`` whose step d = peak / k is an fp16 number reproducing all
    32 values bit-exactly (levels rint(v / d) in [-8, 7], d·level == v in float32): (found bool [B],
    d float16 [B], levels int8 [B, 32]). Every exact fit is one of these: in an exact fit the peak is
    d·k for its own level k, so d = peak / k exactly, and the division (correctly rounded, the quotient
    representable) gives it bit for bit."""
    b = v.shape[0]
    found, best_d, best_l = np.zeros(b, dtype=bool), np.zeros(b, dtype=np.float16), np.zeros((b, QK), dtype=np.int8)
    for k in ks:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            d = (peak / k).astype(np.float16)
            d32 = d.astype(np.float32)
            levels = np.rint(v.astype(np.float64) / d.astype(np.float64)[:, None])
            hit = ((levels >= -8) & (levels <= 7) & (d32[:, None] * levels.astype(np.float32) == v)).all(axis=1)
        hit &= (d.astype(np.float64) * k == peak) & ~found  # the peak on level k itself (as the C kernel asks)
        found |= hit
        best_d = np.where(hit, d, best_d)
        best_l = np.where(hit[:, None], np.where(hit[:, None], levels, 0).astype(np.int8), best_l)
    return found, best_d, best_l


def _cheap_counts(k: _Blocks, d32, q):
    """Values reproduced by the steps +d32 and -d32 (float32 [B], > 0) with the levels ``q`` (float32
    [B, 32], clipped to [-8, 8]; level 8 only fits -d, level -8 only +d): ((src +, src -), (f32 +,
    f32 -)) [B] each, bit-exact after rounding to the source format and in float32."""
    recon = d32[:, None] * q
    src, f32 = round_to_source(recon, k.mbits) == k.v, recon == k.v
    plus, minus = q != 8, q != -8
    return ((src & plus).sum(axis=1), (src & minus).sum(axis=1)), ((f32 & plus).sum(axis=1), (f32 & minus).sum(axis=1))


def _window_steps(k: _Blocks, best):
    """The last pass (blocks on the grid, not all bit-exact in float32: a trained step fp16 cannot
    hold): every fp16 step within ``WINDOW`` units of the best, ascending, + before -, with the best's
    levels n taken for +|d_best| (in [-8, 8]; clipped to [-8, 7] for +d, -n clipped for -d). Each is
    first counted cheaply (values exact after rounding and in float32, float32 only) and fully scored
    only when those counts could beat the best's: more values exact after rounding, or as many (then,
    at all 32, at least as many in float32)."""
    h0 = best[0].view(np.uint16).astype(np.int64) & 0x7FFF
    n = np.where((best[0] < 0)[:, None], -best[1].astype(np.float32), best[1].astype(np.float32))
    q, levels = n, (np.clip(n, -8, 7), np.clip(-n, -8, 7))
    for off in range(-WINDOW, WINDOW + 1):
        h = h0 + off
        valid = (h0 > 0) & (h > 0) & (h < 0x7C00)
        h = np.where(valid, h, 0x3C00)
        d32 = h.astype(np.uint16).view(np.float16).astype(np.float32)
        (src_p, src_m), (f32_p, f32_m) = _cheap_counts(k, d32, q)
        for sign, src, f32, lv in ((0, src_p, f32_p, levels[0]), (0x8000, src_m, f32_m, levels[1])):
            reach = (src > best[2]) | ((src == best[2]) & ((src < QK) | (f32 >= best[3])))
            best = _score(k, (h | sign).astype(np.uint16).view(np.float16), lv, valid & reach, best)
    return best


_lib, _lib_tried, _lock = None, False, threading.Lock()


def _c_library():
    global _lib, _lib_tried
    with _lock:
        if not _lib_tried:
            _lib_tried = True
            from ..kernels import compiled_library

            lib = compiled_library(Path(__file__).resolve().parent.parent / "kernels" / "q4pack.c")
            if lib is not None:
                P = ctypes.c_void_p
                lib.gs_q4_0_exact.argtypes = [P, ctypes.c_int64, ctypes.c_int, ctypes.c_double, P, P, P, P, P, P, P, P,
                                              ctypes.c_int, ctypes.c_int]
                lib.gs_q4_0_exact.restype = None
            _lib = lib
    return _lib


def _pack_c(lib, v: np.ndarray, mantissa_bits: int, tolerance_ulp: float, threads: int, magnitudes: bool) -> PackResult:
    b = v.shape[0]
    d = np.empty(b, dtype=np.uint16)
    levels = np.empty((b, QK), dtype=np.int8)
    exact, exact_src = np.empty(b, dtype=np.int32), np.empty(b, dtype=np.int32)
    err = np.empty(b, dtype=np.float64)
    packed = np.empty((b, Q4_0_BYTES), dtype=np.uint8)
    sq_err, sq_src = np.empty(b), np.empty(b)
    lib.gs_q4_0_exact(v.ctypes.data, b, mantissa_bits, float(tolerance_ulp), d.ctypes.data, levels.ctypes.data,
                      exact.ctypes.data, exact_src.ctypes.data, err.ctypes.data, packed.ctypes.data, sq_err.ctypes.data,
                      sq_src.ctypes.data, int(magnitudes), threads)
    return PackResult(d.view(np.float16), levels, err <= tolerance_ulp, exact.astype(np.int64), err,
                      exact_src=exact_src.astype(np.int64), sq_err=sq_err, sq_src=sq_src, packed=packed)


def pack_exact(w: np.ndarray, mantissa_bits: int = 7, tolerance_ulp: float = 1.0, backend: str = "auto",
               threads: int | None = None, magnitudes: bool = True) -> PackResult:
    """Recover each 32-value block's step and levels (the search: this module's docstring).

    Args:
        w: float32 [N, K] (K a multiple of 32), the source values (bf16/f16/f32 widened to float32).
        mantissa_bits: the source format's explicit mantissa bits: 7 (bf16), 10 (f16) or 23 (f32).
        tolerance_ulp: a block is on-grid when every value is reproduced within this many ulps.
        backend: ``"c"`` (``kernels/q4pack.c``), ``"numpy"`` (the reference) or ``"auto"`` (C when it
            can be compiled).
        threads: threads for the C backend (default: all cores).
        magnitudes: whether blocks still off the grid also score the plain search's steps (f16(m / k));
            False skips that pass (~15 us per off-grid block): ``quantize`` turns it off for the rest of a
            tensor once a block is off the grid, since the tensor is then stored in the fallback type.

    Raises:
        ValueError: K not a multiple of 32, NaN/Inf in the source, or another ``mantissa_bits``.
        RuntimeError: ``backend="c"`` without a C compiler.
    """
    if mantissa_bits not in SOURCE_FORMATS:
        raise ValueError(f"mantissa_bits must be 7 (bf16), 10 (f16) or 23 (f32), not {mantissa_bits}")
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QK:
        raise ValueError(f"a Q4_0 tensor needs rows of a multiple of 32 values (shape {w.shape})")
    if not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"the source holds NaN or Inf (first at row {bad[0]}, column {bad[1]})")
    v = np.ascontiguousarray(w.reshape(-1, QK))
    lib = _c_library() if backend in ("auto", "c") else None
    if backend == "c" and lib is None:
        raise RuntimeError("the C packer (kernels/q4pack.c) could not be compiled; is a C compiler (cc) on PATH?")
    if lib is not None:
        return _pack_c(lib, v, mantissa_bits, tolerance_ulp, threads or os.cpu_count() or 1, magnitudes)
    return _pack_numpy(v, mantissa_bits, tolerance_ulp, magnitudes)


def _pack_numpy(v: np.ndarray, mantissa_bits: int, tolerance_ulp: float, magnitudes: bool = True) -> PackResult:
    """The numpy reference of :func:`pack_exact` on blocks ``v`` float32 [B, 32]."""
    k = _Blocks(v, v.astype(np.float64), ulp(v, mantissa_bits), mantissa_bits, tolerance_ulp)
    peak = k.v64[np.arange(v.shape[0]), np.abs(k.v64).argmax(axis=1)]
    # the peak of a trained block nearly always sits on the outermost levels: try those on every block,
    # then every other level only on the blocks still off the grid (same choice, several times faster)
    best = list(_search(k, peak, _STAGE1))

    def update(idx, found):
        for x, y in zip(best, found):
            x[idx] = y

    def near():  # on the grid, not every value bit-exact in float32
        return np.nonzero((best[4] <= tolerance_ulp) & (best[3] < QK) & (peak != 0))[0]

    rest = np.nonzero(best[4] > tolerance_ulp)[0]
    # within tolerance but not every value bit-exact: an exact fit may still sit on the other levels (a
    # block whose peak is below level 6, e.g. few distinct values); only d = peak / k can be one
    idx = near()
    if rest.size:
        update(rest, _search(k.take(rest), peak[rest], _STAGE2, tuple(x[rest] for x in best)))
        rest = rest[best[4][rest] > tolerance_ulp]  # still off the grid: the plain search's steps too
        if rest.size and magnitudes:
            update(rest, _magnitude_steps(k.take(rest), tuple(x[rest] for x in best)))
    if idx.size:
        found, d3, l3 = _exact_steps(v[idx], peak[idx], _STAGE2)
        update(idx[found], (d3[found], l3[found], QK, QK, 0.0))
    for step in (_value_steps, _window_steps):
        idx = near()
        if idx.size:
            update(idx, step(k.take(idx), tuple(x[idx] for x in best)))
    best_d, best_l, best_src, best_f32, best_err = best
    zero = peak == 0  # all-zero block: d = 0, every level 0, exact
    best_d[zero], best_l[zero], best_src[zero], best_f32[zero], best_err[zero] = 0, 0, QK, QK, 0.0
    on_grid = (best_f32 >= 0) & (best_err <= tolerance_ulp)
    recon = (best_d.astype(np.float32)[:, None] * best_l.astype(np.float32)).astype(np.float64)
    return PackResult(best_d, best_l, on_grid, np.maximum(best_f32, 0), best_err, exact_src=np.maximum(best_src, 0),
                      sq_err=((recon - k.v64) ** 2).sum(axis=1), sq_src=(k.v64 ** 2).sum(axis=1))
