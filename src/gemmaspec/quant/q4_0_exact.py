"""Exact Q4_0 packing of weights that already lie on a 4-bit grid (QAT checkpoints).

Q4_0 (ggml ``block_q4_0``): 32 consecutive values along a row (the input dimension, GGUF ne0) share
an fp16 scale d; each value is d·(q − 8) with q ∈ [0, 15]; byte j of the 16 packed bytes holds q[j]
in its low nibble and q[j+16] in its high nibble.

A QAT block holds values round_src(s·k), k ∈ [−8, 7]. Rounding to the nearest level with d = amax/8
(the usual quantizer) is wrong whenever a block's peak sits below level 8 (about 5 % error,
silently). Here each block's step is recovered instead: for every level k the peak could sit on
(±1..±8, sign free, as ggml's d may be negative), take s = peak/k, round every value to its level,
refine s by least squares over the block, round d to fp16, and measure the reconstruction d·k
(float32) against the source: candidates within ``tolerance_ulp`` of every value beat those that are
not; among them the most bit-exact values win, then the smaller error, then the finer step. Levels
-8, 7, -7, ±6 are scored on every block; the rest on a block still off the grid, and on a block on the
grid but not all bit-exact only as a bit-exact fit (d = peak / k reproducing every value exactly).
Whenever some fp16 step reproduces all 32 values bit for bit, the search finds one: in such a fit the
peak is d·k for its own level k, so d = peak / k exactly (docs/quantize.md gives the argument). A block
on the grid and still not all bit-exact then scores the steps read off its values on levels ±1, ±2,
±4, -8 (value / level: exact when the trained step has at most 11 significant bits).
A block whose reconstruction misses a value by more than ``tolerance_ulp`` units in the source's last
place fits no grid and is reported off-grid.

The search runs in C (``kernels/q4pack.c``, same candidates and tie rules, bit-identical results;
about 100x faster) when a compiler is at hand; this module's numpy version is the reference and the
fallback.
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


@dataclass
class PackResult:
    """Exact packing of one tensor.

    Attributes:
        d: float16 [B] block scales; levels: int8 [B, 32] in [-8, 7] (B = blocks in row order).
        on_grid: bool [B]; exact: int [B] values reproduced bit-exactly per block.
        max_err_ulp: float [B] worst error per block in units of the source's last place.
        sq_err, sq_src: float64 [B] per block: sum of squared reconstruction errors, sum of squared
            source values (for relative Frobenius errors).
    """

    d: np.ndarray
    levels: np.ndarray
    on_grid: np.ndarray
    exact: np.ndarray
    max_err_ulp: np.ndarray
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


def _score(v, v64, u, d, levels, valid, tolerance_ulp, best):
    """Keep fp16 step ``d`` [B] with float ``levels`` [B, 32] where ``valid`` and better than ``best``
    (d, levels, exact, err): within tolerance beats not, then more bit-exact values, then the smaller
    worst error."""
    best_d, best_l, best_exact, best_err = best
    recon = d.astype(np.float32)[:, None] * levels.astype(np.float32)
    exact = (recon == v).sum(axis=1)
    err = (np.abs(recon.astype(np.float64) - v64) / u).max(axis=1)
    ok, best_ok = err <= tolerance_ulp, best_err <= tolerance_ulp
    same_class = ok == best_ok
    better = valid & ((ok & ~best_ok) | (same_class & ((exact > best_exact)
                                                      | ((exact == best_exact) & (err < best_err)))))
    return (np.where(better, d, best_d), np.where(better[:, None], np.where(valid[:, None], levels, 0).astype(np.int8),
                                                  best_l),
            np.where(better, exact, best_exact), np.where(better, err, best_err))


def _value_steps(v, v64, u, tolerance_ulp, best):
    """Steps read off single values (blocks on the grid, not all bit-exact): with a step of at most 11
    significant bits, a value on level ±1, ±2, ±4 or -8 is step·level exactly, so value / level is the
    step itself, which the peak (a rounded step·3, 5, 6 or 7) and the least-squares fit only come near.
    For each magnitude 8, 4, 2, 1 among the block's current levels, the first such value gives
    d = f16(v / level), scored with levels rint(v / d) unless it is the block's step already."""
    cur, d_start = best[1].astype(np.int16), best[0].view(np.uint16).copy()
    rows = np.arange(v.shape[0])
    for m in (8, 4, 2, 1):
        on_m = np.abs(cur) == m
        has = on_m.any(axis=1)
        at = on_m.argmax(axis=1)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            d = (v64[rows, at] / np.where(has, cur[rows, at], 1)).astype(np.float16)
            d64 = d.astype(np.float64)
            levels = np.rint(v64 / d64[:, None])
            valid = has & (d64 != 0) & (d.view(np.uint16) != d_start) & ((levels >= -8) & (levels <= 7)).all(axis=1)
        best = _score(v, v64, u, d, np.clip(levels, -8, 7), valid, tolerance_ulp, best)
    return best


def _search(v, v64, u, peak, ks, tolerance_ulp, start=None):
    """Best (d, levels, exact, err) per block over peak levels ``ks``; ``u``: each value's ulp."""
    b = v.shape[0]
    if start is None:
        best_d, best_l = np.zeros(b, dtype=np.float16), np.zeros((b, QK), dtype=np.int8)
        best_exact, best_err = np.full(b, -1, dtype=np.int64), np.full(b, np.inf)
    else:
        best_d, best_l, best_exact, best_err = (x.copy() for x in start)
    for k in ks:  # finer steps first: ties keep them
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(peak != 0, peak / k, 0.0)
            levels = np.rint(np.where(s[:, None] != 0, v64 / s[:, None], 0.0))
        valid = ((levels >= -8) & (levels <= 7)).all(axis=1)
        levels = np.clip(levels, -8, 7)
        den = (levels * levels).sum(axis=1)
        s_ls = np.where(den > 0, (v64 * levels).sum(axis=1) / np.where(den > 0, den, 1.0), 0.0)
        d_ls = s_ls.astype(np.float16)
        steps = (s.astype(np.float16), d_ls, np.nextafter(d_ls, np.float16(np.inf)), np.nextafter(d_ls, np.float16(-np.inf)))
        best = (best_d, best_l, best_exact, best_err)
        for d in steps:  # the fitted fp16 step and its two neighbours: the source's rounding can hide the true one
            best = _score(v, v64, u, d, levels, valid, tolerance_ulp, best)
        best_d, best_l, best_exact, best_err = best
    return best_d, best_l, best_exact, best_err


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
                lib.gs_q4_0_exact.argtypes = [P, ctypes.c_int64, ctypes.c_int, ctypes.c_double, P, P, P, P, P, P, P,
                                              ctypes.c_int]
                lib.gs_q4_0_exact.restype = None
            _lib = lib
    return _lib


def _pack_c(lib, v: np.ndarray, mantissa_bits: int, tolerance_ulp: float, threads: int) -> PackResult:
    b = v.shape[0]
    d = np.empty(b, dtype=np.uint16)
    levels = np.empty((b, QK), dtype=np.int8)
    exact = np.empty(b, dtype=np.int32)
    err = np.empty(b, dtype=np.float64)
    packed = np.empty((b, Q4_0_BYTES), dtype=np.uint8)
    sq_err, sq_src = np.empty(b), np.empty(b)
    lib.gs_q4_0_exact(v.ctypes.data, b, mantissa_bits, float(tolerance_ulp), d.ctypes.data, levels.ctypes.data,
                      exact.ctypes.data, err.ctypes.data, packed.ctypes.data, sq_err.ctypes.data, sq_src.ctypes.data,
                      threads)
    return PackResult(d.view(np.float16), levels, err <= tolerance_ulp, exact.astype(np.int64), err, sq_err, sq_src,
                      packed)


def pack_exact(w: np.ndarray, mantissa_bits: int = 7, tolerance_ulp: float = 1.0, backend: str = "auto",
               threads: int | None = None) -> PackResult:
    """Recover each 32-value block's step and levels.

    Args:
        w: float32 [N, K] (K a multiple of 32), the source values (bf16/f16/f32 widened to float32).
        mantissa_bits: the source format's explicit mantissa bits (bf16 7, f16 10, f32 23).
        tolerance_ulp: a block is on-grid when every value is reproduced within this many ulps.
        backend: ``"c"`` (``kernels/q4pack.c``), ``"numpy"`` (the reference) or ``"auto"`` (C when it
            can be compiled).
        threads: threads for the C backend (default: all cores).

    Raises:
        ValueError: K not a multiple of 32, or NaN/Inf in the source.
    """
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
        return _pack_c(lib, v, mantissa_bits, tolerance_ulp, threads or os.cpu_count() or 1)
    v64 = v.astype(np.float64)
    peak = v64[np.arange(v.shape[0]), np.abs(v64).argmax(axis=1)]
    u = ulp(v, mantissa_bits)
    # the peak of a trained block nearly always sits on the outermost levels: try those on every block,
    # then every other level only on the blocks still off the grid (same choice, several times faster)
    best_d, best_l, best_exact, best_err = _search(v, v64, u, peak, _STAGE1, tolerance_ulp)
    rest = np.nonzero(best_err > tolerance_ulp)[0]
    # within tolerance but not every value bit-exact: an exact fit may still sit on the other levels (a
    # block whose peak is below level 6, e.g. few distinct values); only d = peak / k can be one
    near = np.nonzero((best_err <= tolerance_ulp) & (best_exact < QK) & (peak != 0))[0]
    if rest.size:
        d2, l2, e2, r2 = _search(v[rest], v64[rest], u[rest], peak[rest], _STAGE2,
                                 tolerance_ulp, (best_d[rest], best_l[rest], best_exact[rest], best_err[rest]))
        best_d[rest], best_l[rest], best_exact[rest], best_err[rest] = d2, l2, e2, r2
    if near.size:
        found, d3, l3 = _exact_steps(v[near], peak[near], _STAGE2)
        hit = near[found]
        best_d[hit], best_l[hit], best_exact[hit], best_err[hit] = d3[found], l3[found], QK, 0.0
    near = np.nonzero((best_err <= tolerance_ulp) & (best_exact < QK) & (peak != 0))[0]
    if near.size:
        d4, l4, e4, r4 = _value_steps(v[near], v64[near], u[near], tolerance_ulp,
                                      (best_d[near], best_l[near], best_exact[near], best_err[near]))
        best_d[near], best_l[near], best_exact[near], best_err[near] = d4, l4, e4, r4
    zero = peak == 0  # all-zero block: d = 0, every level 0, exact
    best_d[zero], best_l[zero], best_exact[zero], best_err[zero] = 0, 0, QK, 0.0
    on_grid = (best_exact >= 0) & (best_err <= tolerance_ulp)
    recon = (best_d.astype(np.float32)[:, None] * best_l.astype(np.float32)).astype(np.float64)
    return PackResult(best_d, best_l, on_grid, np.maximum(best_exact, 0), best_err,
                      ((recon - v64) ** 2).sum(axis=1), (v64 ** 2).sum(axis=1))
