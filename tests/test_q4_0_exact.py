"""Exact Q4_0 packing recovers QAT grids, including every trap, and round-trips real Q4_0 bytes."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings, strategies as st

from gemmaspec.quant.q4_0_exact import pack_exact


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x.astype(np.float32)).bfloat16().float().numpy()


def _ulp_bf16(x: np.ndarray) -> np.ndarray:
    """bf16's unit in the last place of bf16 values held in float32 (float32's spacing, 16 bits coarser)."""
    return np.spacing(np.abs(x).astype(np.float32)).astype(np.float64) * 2.0**16


def _measured_ulp(r, w: np.ndarray) -> np.ndarray:
    """Worst error per block of the packed reconstruction d·level against ``w``, in bf16 ulps."""
    recon = (r.d.astype(np.float32)[:, None] * r.levels.astype(np.float32)).reshape(w.shape)
    err = np.abs(recon.astype(np.float64) - w) / _ulp_bf16(w)
    return err.reshape(-1, 32).max(axis=1)


def _qat(rng, n_rows, n_blocks, step_exp=(-8, -2), levels=None):
    lv = rng.integers(-8, 8, (n_rows, n_blocks, 32)) if levels is None else levels
    steps = 2.0 ** rng.uniform(*step_exp, (n_rows, n_blocks, 1))
    steps = _bf16(steps)  # a QAT step is itself a bf16 number
    return _bf16((steps * lv).reshape(n_rows, -1)), lv.reshape(n_rows, -1), steps


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_recovers_every_level_of_synthetic_qat_blocks(seed):
    rng = np.random.default_rng(seed)
    w, lv, _ = _qat(rng, 4, 6)
    r = pack_exact(w)
    assert r.on_grid.all()
    recon = (r.d.astype(np.float32)[:, None] * r.levels.astype(np.float32)).reshape(w.shape)
    ulp = np.abs(w) * 2.0 ** -7 + 1e-30
    assert (np.abs(recon - w) <= ulp).all()  # within the source's rounding
    assert (r.max_err_ulp <= 1.0).all()  # within the source's rounding
    assert (r.max_err_ulp <= 0.5).mean() > 0.9  # and almost always within half an ulp (round to nearest)
    # s·k is itself a bf16 number whenever |k| is 0 or a power of two: those values must come back bit-exact
    assert r.exact.sum() >= np.isin(np.abs(lv), [0, 1, 2, 4, 8]).sum()


@pytest.mark.parametrize("trap", ["peak_below_8", "all_zero", "single_value", "only_negative", "only_positive",
                                  "no_minus_8", "with_minus_8", "subnormal_step"])
def test_traps(trap):
    rng = np.random.default_rng(1)
    levels = {
        "peak_below_8": rng.integers(-5, 6, (1, 1, 32)),  # amax/8 would pick the wrong step
        "all_zero": np.zeros((1, 1, 32), int),
        "single_value": np.full((1, 1, 32), 3),
        "only_negative": -rng.integers(1, 9, (1, 1, 32)),
        "only_positive": rng.integers(1, 8, (1, 1, 32)),
        "no_minus_8": rng.integers(-7, 8, (1, 1, 32)),
        "with_minus_8": np.concatenate([np.full((1, 1, 1), -8), rng.integers(-8, 8, (1, 1, 31))], axis=2),
        "subnormal_step": rng.integers(-8, 8, (1, 1, 32)),
    }[trap]
    exp = (-20, -19) if trap == "subnormal_step" else (-6, -4)
    w, lv, _ = _qat(rng, 1, 1, exp, levels)
    r = pack_exact(w)
    recon = r.d.astype(np.float32)[:, None] * r.levels.astype(np.float32)
    # the reported error is the reconstruction's real one, and on_grid says whether it is within 1 ulp
    np.testing.assert_allclose(r.max_err_ulp, _measured_ulp(r, w), rtol=1e-12)
    assert r.on_grid[0] == (r.max_err_ulp[0] <= 1.0)
    if trap == "subnormal_step":  # a step of ~2^-20 is an fp16 subnormal (spacing 2^-24): no fp16 d hits it,
        assert not r.on_grid[0] and r.max_err_ulp[0] > 1.0  # so the block is reported off the grid, not hidden
        return
    assert r.on_grid.all() and r.max_err_ulp[0] <= 1.0, (trap, r.max_err_ulp)
    if trap == "all_zero":
        assert r.max_err_ulp[0] == 0 and r.exact[0] == 32 and r.d[0] == 0
    assert np.array_equal(recon.reshape(w.shape), w) or (np.abs(recon.reshape(w.shape) - w) <= np.abs(w) * 2.0**-7).all()
    if trap == "peak_below_8":  # the naive amax/8 quantizer is ~5 % off here; exact packing is not
        naive = gguf.quants.dequantize(gguf.quants.quantize(w, T.Q4_0), T.Q4_0)
        assert np.abs(naive - w).max() > np.abs(recon.reshape(w.shape) - w).max()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_exactly_representable_blocks_come_back_bit_exact(seed):
    """Levels 0, ±1, ±2, ±4, -8 times a bf16 step are bf16 numbers themselves, and the step an fp16 one:
    an exact fit exists, so the packer must find it (0 ulp, all 32 values bit-exact)."""
    rng = np.random.default_rng(seed)
    levels = rng.choice([-8, -4, -2, -1, 0, 1, 2, 4], (4, 6, 32))
    w, _, _ = _qat(rng, 4, 6, levels=levels)
    r = pack_exact(w)
    assert (r.max_err_ulp == 0).all() and (r.exact == 32).all()
    assert (_measured_ulp(r, w) == 0).all()


def test_grid_runs_along_the_input_dimension():
    """Transposing first (grouping along the output dimension) leaves QAT blocks off-grid."""
    rng = np.random.default_rng(2)
    w, _, _ = _qat(rng, 32, 2)
    assert pack_exact(w).on_grid.all()
    assert not pack_exact(np.ascontiguousarray(w.T)).on_grid.all()


def test_nan_is_an_error():
    w = np.zeros((1, 32), np.float32)
    w[0, 5] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        pack_exact(w)


def test_real_q4_0_bytes_round_trip_byte_identical():
    rng = np.random.default_rng(3)
    src = rng.standard_normal((8, 256)).astype(np.float32)
    q4 = gguf.quants.quantize(src, T.Q4_0)  # ggml's own quantizer (d may be negative)
    deq = gguf.quants.dequantize(q4, T.Q4_0).astype(np.float32)
    r = pack_exact(deq, mantissa_bits=23)
    assert r.on_grid.all() and r.exact.sum() == deq.size
    assert np.array_equal(r.q4_0_bytes().reshape(q4.shape), q4)
