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


def _exact_qat_blocks(rng, n_blocks, kind):
    """Synthetic QAT blocks that an fp16 step reproduces bit for bit: per block a step s that bf16 (and
    fp16) holds exactly and levels in [-8, 7], values bf16(s·level); only blocks where every value is
    exactly s·level are kept (checked, not assumed). Returns (float32 [n, 32] values, s, levels)."""
    if kind == "uniform":  # the peak mostly on -8 or 7
        lv = rng.integers(-8, 8, (n_blocks, 32))
    elif kind == "narrow":  # the peak below level 6: a random level range [lo, hi] inside [-5, 5]
        lo, hi = rng.integers(-5, 1, (n_blocks, 1)), rng.integers(0, 6, (n_blocks, 1))
        lv = lo + np.floor(rng.random((n_blocks, 32)) * (hi - lo + 1)).astype(int)
    elif kind == "gauss":  # trained weights: most levels near 0
        lv = np.clip(np.rint(rng.normal(0, rng.uniform(0.5, 2.5), (n_blocks, 32))), -8, 7).astype(int)
    elif kind == "few":  # 1-3 distinct levels (zero included or not)
        choices = rng.integers(-8, 8, (n_blocks, 3))
        lv = np.take_along_axis(choices, rng.integers(0, rng.integers(1, 4), (n_blocks, 32)), axis=1)
    elif kind == "one_sign":  # only negative or only positive levels
        lv = rng.integers(1, 8, (n_blocks, 32)) * rng.choice([-1, 1], (n_blocks, 1))
    elif kind == "zero":
        lv = np.zeros((n_blocks, 32), int)
    lv = lv * rng.choice([-1, 1], (n_blocks, 1)) if kind in ("narrow", "gauss") else lv
    lv = np.clip(lv, -8, 7)
    bits = rng.integers(1, 9, (n_blocks, 1))  # the step's significant bits (bf16 holds 8)
    mant = rng.integers(2 ** (bits - 1), 2**bits)
    if rng.random() < 0.2:  # fp16 subnormal steps: multiples of 2^-24
        s = (mant * 2.0**-24).astype(np.float32)
    else:
        s = (mant * 2.0 ** (rng.integers(-13, 3, (n_blocks, 1)) - bits)).astype(np.float32)
    w = _bf16(s * lv)
    ok = (w.astype(np.float64) == s.astype(np.float64) * lv).all(axis=1)
    assert (s.astype(np.float16).astype(np.float32) == s).all()  # fp16 holds every step
    return w[ok], s[ok], lv[ok]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["uniform", "narrow", "gauss", "few", "one_sign", "zero"]))
def test_finds_a_bit_exact_step_whenever_one_exists(seed, kind):
    """Every block that some fp16 step reproduces bit for bit comes back 100 % bit-exact, whatever level
    the peak sits on, with the C packer and the numpy reference making the same choice bit for bit."""
    rng = np.random.default_rng(seed)
    w, s, lv = _exact_qat_blocks(rng, 400, kind)
    assert w.shape[0] > 20
    a, b = pack_exact(w, backend="numpy"), pack_exact(w, backend="c")
    for r in (a, b):
        assert (r.exact == 32).all() and (r.max_err_ulp == 0).all() and r.on_grid.all()
        recon = r.d.astype(np.float32)[:, None] * r.levels.astype(np.float32)
        assert np.array_equal(recon, w)
        assert (r.levels >= -8).all() and (r.levels <= 7).all()
    assert np.array_equal(a.d.view(np.uint16), b.d.view(np.uint16)) and np.array_equal(a.levels, b.levels)
    assert np.array_equal(a.q4_0_bytes(), b.q4_0_bytes())


@pytest.mark.parametrize("backend", ["c", "numpy"])
def test_exact_step_with_the_peak_on_a_middle_level(backend):
    """Levels -2..2 of the step 2^-6: at the outer levels, d = f16(peak / 6) reproduces every value within
    1 ulp but only 9 of them bit-exactly (what the search kept before); d = peak / 2 reproduces all 32."""
    s = np.float32(2.0**-6)
    lv = np.array([2, -2, 1, -1, 0, 1, 2, -1] * 4)
    w = (s * lv).astype(np.float32)[None, :]
    assert np.array_equal(_bf16(w), w)
    r = pack_exact(w, backend=backend)
    assert r.exact[0] == 32 and r.max_err_ulp[0] == 0
    assert np.array_equal(r.d.astype(np.float32)[:, None] * r.levels.astype(np.float32), w)


@pytest.mark.parametrize("backend", ["c", "numpy"])
def test_step_read_off_a_power_of_two_level(backend):
    """A block with no bit-exact fit (bf16 rounds s·3, s·5, s·7): its peak -0.84375 is bf16(-7s), so
    peak / 7 and the least-squares step miss s by an fp16 ulp or two and reproduce 2 values bit-exactly.
    Its values on levels ±1, ±2, ±4 are s·level exactly; the step read off them reproduces those 15."""
    s = np.float32(0.12060547)  # a bf16 (and fp16) number
    lv = np.array([-7, 7, 0, 2, -6, 6, -7, -4, -2, -3, 3, -1, 5, -5, -6, -7, 7, 4, -7, -7, -1, 1, 2, -2, 4, 4, 4,
                   1, -5, 0, -7, 7])
    w = _bf16(s * lv)[None, :]
    r = pack_exact(w, backend=backend)
    assert abs(float(r.d[0])) == s and r.exact[0] == 15 and r.on_grid[0] and r.max_err_ulp[0] <= 0.5


def _qat_f32_steps(rng, n_blocks, kind):
    """Synthetic QAT blocks whose steps are float32 numbers (24 significant bits, so fp16 holds none of
    them): values bf16(s·level), levels uniform in [-8, 7] or Gaussian (sd 2). float32 [n, 32], s [n]."""
    if kind == "uniform":
        lv = rng.integers(-8, 8, (n_blocks, 32))
    else:
        lv = np.clip(np.rint(rng.normal(0, 2, (n_blocks, 32))), -8, 7).astype(int)
    s = (2.0 ** rng.uniform(-10, -2, (n_blocks, 1))).astype(np.float32)
    return _bf16(s * lv.astype(np.float32)), s[:, 0]


def _score_steps(v: np.ndarray, d: np.ndarray):
    """Plain scoring of candidate fp16 steps d [B, C] on blocks v [B, 32]: the nearest levels in [-8, 7],
    then per candidate (values bit-exact after bf16 rounding, bit-exact in float32, worst error in bf16
    ulps)."""
    d64 = d.astype(np.float64)[..., None]
    lv = np.clip(np.rint(v[:, None, :] / np.where(d64 != 0, d64, 1.0)), -8, 7) * (d64 != 0)
    recon = d.astype(np.float32)[..., None] * lv.astype(np.float32)
    src = (_bf16(recon) == v[:, None, :]).sum(-1)
    f32 = (recon == v[:, None, :]).sum(-1)
    err = (np.abs(recon.astype(np.float64) - v[:, None, :]) / _ulp_bf16(v)[:, None, :]).max(-1)
    return src, f32, err


def _best(src, f32, err, d):
    """Per block the candidate with the most values bit-exact after bf16 rounding, then the smallest
    worst error (the first of equals): (d, src, f32, err) [B]."""
    pick = np.array([np.lexsort((err[b], -src[b]))[0] for b in range(src.shape[0])])
    rows = np.arange(src.shape[0])
    return d[rows, pick], src[rows, pick], f32[rows, pick], err[rows, pick]


def _search_in_chunks(v: np.ndarray, d: np.ndarray, chunk=100):
    """_best over candidates d [B, C], a hundred blocks at a time (memory)."""
    parts = [_best(*_score_steps(v[i:i + chunk], d[i:i + chunk]), d[i:i + chunk]) for i in range(0, len(v), chunk)]
    return tuple(np.concatenate(x) for x in zip(*parts))


def _candidate_search(v: np.ndarray):
    """The plain candidate search of issue 33: each block's distinct magnitudes divided by 1..8,
    rounded to fp16 (both signs)."""
    mags = np.abs(v).astype(np.float64)
    d = np.concatenate([(sign * mags / j).astype(np.float16) for j in range(1, 9) for sign in (1, -1)], axis=1)
    return _search_in_chunks(v, d)


def _window_search(v: np.ndarray, s: np.ndarray, width=40):
    """Every fp16 step within ``width`` fp16 units of the trained float32 step s (both signs)."""
    h = s.astype(np.float16).view(np.uint16).astype(np.int64)[:, None] + np.arange(-width, width + 1)
    d = h.astype(np.uint16).view(np.float16)
    return _search_in_chunks(v, np.concatenate([d, -d], axis=1))


def _at_least_as_good(r, ref):
    """Block by block: at least as many values bit-exact after bf16 rounding; at equal counts below 32
    a worst error no larger; with all 32, as many values bit-exact in float32 or more, then no larger
    worst error (the packer's one refinement of the order)."""
    _, src, f32, err = ref
    more = r.exact_src > src
    same = r.exact_src == src
    below = same & (src < 32) & (r.max_err_ulp <= err)
    full = same & (src == 32) & ((r.exact > f32) | ((r.exact == f32) & (r.max_err_ulp <= err)))
    return more | below | full


@pytest.mark.parametrize("kind", ["uniform", "gauss"])
def test_float32_steps_beat_the_candidate_search_block_by_block(kind):
    """Where no fp16 step reproduces a block (its trained step a float32 number), the packer keeps the
    step reproducing the most values bit-exactly after bf16 rounding: at least as good as the plain
    candidate search on every block and as every fp16 step near the trained one (both references
    independent plain numpy), and the C packer and the numpy reference choose the same bits."""
    rng = np.random.default_rng({"uniform": 11, "gauss": 12}[kind])
    v, s = _qat_f32_steps(rng, 1500, kind)
    r = pack_exact(v, backend="c")
    assert r.on_grid.all() and (r.max_err_ulp <= 1.0).all()
    cand, near = _candidate_search(v), _window_search(v, s)
    assert (cand[3] <= 1.0).all()  # the reference's picks are on the grid too: the orders agree
    assert _at_least_as_good(r, cand).all() and _at_least_as_good(r, near).all()
    got, ref = r.exact_src.sum() / v.size, cand[1].sum() / v.size
    assert got >= ref + (0.03 if kind == "uniform" else 0.01), (got, ref)  # measured: 0.995 vs 0.953, 1.000 vs 0.976
    assert (r.exact_src >= r.exact).all()
    recon = r.d.astype(np.float32)[:, None] * r.levels.astype(np.float32)
    assert np.array_equal((_bf16(recon) == v).sum(axis=1), r.exact_src)
    assert np.array_equal((recon == v).sum(axis=1), r.exact)
    a = pack_exact(v[:300], backend="numpy")
    b = pack_exact(v[:300], backend="c")
    for x, y in ((a.d.view(np.uint16), b.d.view(np.uint16)), (a.levels, b.levels), (a.exact, b.exact),
                 (a.exact_src, b.exact_src), (a.max_err_ulp, b.max_err_ulp)):
        assert np.array_equal(x, y)


def test_bf16_steps_keep_the_trained_step():
    """A bf16 step is an fp16 number reproducing every value after bf16 rounding; among such steps the
    one with more values bit-exact in float32 wins (the trained step), not a neighbour whose worst error
    happens to be smaller."""
    rng = np.random.default_rng(13)
    w, lv, steps = _qat(rng, 50, 8)
    r = pack_exact(w)
    assert (r.exact_src == 32).all() and (r.max_err_ulp <= 0.5).all()
    assert np.array_equal(np.abs(r.d.astype(np.float32)), steps.reshape(-1))


@pytest.mark.parametrize("mbits", [7, 10])
def test_round_to_source_is_the_formats_own_rounding(mbits):
    """round_to_source equals torch's float32 -> bf16 / f16 conversion, ties, subnormals and overflow
    included."""
    from gemmaspec.quant.q4_0_exact import round_to_source

    rng = np.random.default_rng(14)
    x = (rng.standard_normal(20000) * 2.0 ** rng.integers(-30, 20, 20000)).astype(np.float32)
    if mbits == 7:  # exactly halfway between two bf16 numbers (normal and subnormal)
        ties = (np.r_[1:2000, 0x3F00:0x3F00 + 2000].astype(np.uint32) << 16 | 0x8000).view(np.float32)
    else:  # halfway between two f16 numbers (subnormal and normal)
        h = np.r_[1:2000, 0x3C00:0x3C00 + 2000].astype(np.uint16)
        ties = (h.view(np.float16).astype(np.float64) + (h + 1).view(np.float16).astype(np.float64)) / 2
    x = np.concatenate([x, ties, -ties, [65519.0, 65520.0, 2.0**-25, 3 * 2.0**-26, 1e-30, 0.0]]).astype(np.float32)
    dt = torch.bfloat16 if mbits == 7 else torch.float16
    want = torch.from_numpy(x).to(dt).float().numpy()
    assert np.array_equal(round_to_source(x, mbits), want)


def test_unknown_source_format_is_an_error():
    with pytest.raises(ValueError, match="mantissa_bits"):
        pack_exact(np.zeros((1, 32), np.float32), mantissa_bits=5)


def _moved_off_the_grid(rng, n_blocks, kind, share=0.2, units=3):
    """Synthetic QAT blocks (float32 steps, as :func:`_qat_f32_steps`) with one nonzero value in
    ``share`` of them moved by ``units`` bf16 units (up or down): most of those blocks then fit no grid
    within 1 ulp. Returns (float32 [n, 32] bf16 values, bool [n] moved)."""
    v, _ = _qat_f32_steps(rng, n_blocks, kind)
    moved = rng.random(n_blocks) < share
    moved &= (v != 0).any(axis=1)
    for b in np.nonzero(moved)[0]:
        at = rng.choice(np.nonzero(v[b])[0])
        bits = v[b, at:at + 1].view(np.uint32)
        bits += np.uint32(units << 16) if rng.random() < 0.5 or (bits[0] >> 16) & 0x7FFF <= units else \
            np.uint32(-(units << 16) & 0xFFFFFFFF)
    return _bf16(v), moved


@pytest.mark.parametrize("seed,kind", [(21, "uniform"), (22, "gauss"), (23, "uniform"), (24, "gauss")])
def test_off_grid_blocks_beat_the_candidate_search_block_by_block(seed, kind):
    """On blocks that fit no grid (a value moved by 3 bf16 units), the packer reproduces at least as many
    values bit-exactly after bf16 rounding as the plain candidate search of issue 33 (each distinct
    magnitude / 1..8, rounded to fp16, both signs) on every block, and the C packer and the numpy
    reference choose the same bits."""
    rng = np.random.default_rng(seed)
    v, moved = _moved_off_the_grid(rng, 3000, kind)
    c = pack_exact(v, backend="c")
    off = ~c.on_grid
    assert off.sum() > 300 and not off[~moved].any()  # the moved blocks (most of them) and only those
    a = pack_exact(v[moved], backend="numpy")
    b = pack_exact(v[moved], backend="c")
    for x, y in ((a.d.view(np.uint16), b.d.view(np.uint16)), (a.levels, b.levels), (a.exact, b.exact),
                 (a.exact_src, b.exact_src), (a.max_err_ulp, b.max_err_ulp), (a.on_grid, b.on_grid)):
        assert np.array_equal(x, y)
    _, src, _, _ = _candidate_search(v[off])
    short = np.nonzero(c.exact_src[off] < src)[0]
    assert short.size == 0, (short.size, int(off.sum()), c.exact_src[off][short[:5]], src[short[:5]])
    recon = c.d.astype(np.float32)[:, None] * c.levels.astype(np.float32)
    assert np.array_equal((_bf16(recon) == v).sum(axis=1), c.exact_src)


def test_the_plain_search_pass_can_be_skipped_for_a_tensor_that_falls_back():
    """``magnitudes=False`` (what ``quantize`` passes once a tensor has a block off the grid: it is then
    stored in the fallback type and the rest only feeds the report) skips that pass alike in C and numpy:
    same bits, on-grid blocks unchanged, off-grid blocks never better than with the pass."""
    rng = np.random.default_rng(31)
    v, moved = _moved_off_the_grid(rng, 600, "uniform")
    full = pack_exact(v, backend="c")
    a, b = pack_exact(v, backend="numpy", magnitudes=False), pack_exact(v, backend="c", magnitudes=False)
    assert np.array_equal(a.d.view(np.uint16), b.d.view(np.uint16)) and np.array_equal(a.levels, b.levels)
    assert np.array_equal(a.exact_src, b.exact_src) and np.array_equal(a.on_grid, full.on_grid)
    on = full.on_grid
    assert np.array_equal(b.d.view(np.uint16)[on], full.d.view(np.uint16)[on])
    assert (b.exact_src[~on] <= full.exact_src[~on]).all() and (b.exact_src[~on] < full.exact_src[~on]).any()
