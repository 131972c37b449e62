"""Products with int8 activations (``--act-quant q8_0``, ``qdot8.h``): every instruction-set path gives
the portable reference's bits for every stored format and the int8 form, each row of x gives the same
bits alone or with others (so speculative verify rows equal decode rows), the reference is the exact
product of the quantized activations up to float rounding, and greedy speculative decoding on the real
model equals plain decoding in this mode."""

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_stored_weights import random_blocks

from gemmaspec import kernels

SIMD = [isa for isa in ("avx2", "avx512") if kernels.cpu_supports(isa)]
FORMATS = kernels.STORED_TYPES + ("Q4_0x8", "Q8_0x8", "Q5_0x8", "Q4_Kx8", "Q6_Kx8", "int8-32", "int8-32-offsets")


@pytest.fixture(scope="module")
def libs():
    ref = kernels.matmul_library("portable")
    if ref is None:
        pytest.skip("no C compiler: kernels fall back to torch")
    return ref, {isa: kernels.matmul_library(isa) for isa in SIMD}


def weight(rng, fmt: str, n: int, k: int) -> kernels.BlockWeight:
    if fmt.startswith("int8"):
        q = torch.from_numpy(rng.integers(-128, 128, (n, k), dtype=np.int8))
        s = torch.from_numpy(rng.standard_normal((n, k // 32)).astype(np.float32))
        o = torch.from_numpy(rng.standard_normal((n, k // 32)).astype(np.float32)) if "offsets" in fmt else None
        return kernels.QuantizedWeight(q, s, o, 32)
    if fmt.endswith("x8"):  # a multiple of 8 rows: repacked 8 rows at a time for these products (x8.h)
        n = -(-n // 8) * 8
        fmt = fmt[:-2]
    return kernels.StoredWeight(torch.from_numpy(random_blocks(rng, fmt, n, k)), fmt, k)


def q8_product(lib, w: kernels.BlockWeight, x: np.ndarray, threads: int = 1, q8: bool = True,
               stored: bool = False) -> np.ndarray:
    """The product through ``lib`` on the segments the model's products use in that mode (``stored``: on
    the stored layout)."""
    (fmt, raw, s, o, g, n), = w._segments_q8(kernels.load_library()) if q8 and not stored else w._segments()
    m, k = x.shape
    y = np.empty((m, n), np.float32)
    P, I1 = ctypes.c_void_p * 1, ctypes.c_int * 1
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    fn = lib.gs_qmatmul_multi_q8 if q8 else lib.gs_qmatmul_multi
    fn(1, I1(fmt), P(raw.data_ptr()), P(ptr(s)), P(ptr(o)), I1(g), I1(n), k, x.ctypes.data, None, m,
       y.ctypes.data, threads)
    return y


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.int32)


def quantize(lib, x: np.ndarray):
    m, k = x.shape
    aq = np.empty((m, k), np.int8)
    da = np.empty((m, k // 32), np.float32)
    lib.gs_quantize_act(x.ctypes.data, m, k, aq.ctypes.data, da.ctypes.data)
    return aq, da


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(FORMATS), n=st.integers(1, 70), supers=st.integers(1, 3), m=st.integers(1, 16),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_simd_paths_equal_the_portable_reference(libs, fmt, n, supers, m, threads, seed):
    ref, built = libs
    rng = np.random.default_rng(seed)
    k = 256 * supers if fmt[:4] in ("Q4_K", "Q6_K") else 32 * rng.integers(1, 12)  # odd block counts too
    w = weight(rng, fmt, n, int(k))
    x = (rng.standard_normal((m, int(k))) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
    want = q8_product(ref, w, x, threads)
    for isa, lib in built.items():
        assert np.array_equal(bits(q8_product(lib, w, x, threads)), bits(want)), isa
    # batch invariance: each row alone gives the same bits (verify rows = decode rows)
    for i in range(m):
        assert np.array_equal(bits(q8_product(ref, w, x[i:i + 1].copy(), threads)), bits(want[i:i + 1]))


@pytest.mark.parametrize("isa", ["portable"] + SIMD)
def test_activations_quantized_by_the_documented_rule(libs, isa):
    ref, built = libs
    lib = built.get(isa, ref)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 256)) * np.array([1e-3, 1, 30, 0, 1e4])[:, None]).astype(np.float32)
    x[1, 40] = -7.5  # a block whose largest value is negative
    aq, da = quantize(lib, x)
    blocks = x.reshape(5, 8, 32)
    amax = np.abs(blocks).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    np.testing.assert_array_equal(da, d)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    want = np.rint(blocks * inv[..., None]).astype(np.int8).reshape(5, 256)  # nearest, ties to even
    np.testing.assert_array_equal(aq, want)
    assert np.abs(aq).max() <= 127 and (aq[3] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_is_the_product_of_the_quantized_activations(libs, fmt):
    """The result is W @ (aq * da) computed in float64, up to float32 rounding: the integer sums are
    exact, and the scales and offsets are the format's own (dequantized W)."""
    ref, _ = libs
    rng = np.random.default_rng(5)
    k = 512
    w = weight(rng, fmt, 19, k)
    dense = w.dequantize().double().numpy()
    x = rng.standard_normal((3, k)).astype(np.float32)
    aq, da = quantize(ref, x)
    xq = (aq.reshape(3, k // 32, 32) * da[..., None].astype(np.float64)).reshape(3, k)
    got = q8_product(ref, w, x)
    if w._offset_group():  # the offset term reads the fp32 block sums of x itself, not the quantized ones
        xq_for_offsets = x.astype(np.float64)
        off = w._fallback() if isinstance(w, kernels.StoredWeight) else w
        o = off.offset.double().numpy()  # [N, K/32]
        scale_part = dense - np.repeat(o, 32, axis=1)
        want = xq @ scale_part.T + (xq_for_offsets.reshape(3, k // 32, 32).sum(-1) @ o.T)
    else:
        want = xq @ dense.T
    scale = np.abs(xq) @ np.abs(dense).T + np.abs(x.astype(np.float64)) @ np.abs(dense).T
    assert (np.abs(got - want) <= 1e-5 * scale + 1e-30).all()
    # and it is close to the fp32-activation product (the rounding of x is all that differs)
    fp = q8_product(ref, w, x, q8=False)
    assert np.linalg.norm(got - fp) <= 3e-2 * np.linalg.norm(fp)


def test_mode_switch_and_bad_values(monkeypatch):
    before = kernels.act_quant()
    try:
        kernels.set_act_quant("q8_0")
        assert kernels.act_quant() == "q8_0"
        kernels.set_act_quant("none")
        assert kernels.act_quant() == "none"
        with pytest.raises(ValueError, match="choose one of auto, none, q8_0"):
            kernels.set_act_quant("q4")
    finally:
        kernels.set_act_quant(before)
    monkeypatch.setenv("GEMMASPEC_ACT_QUANT", "int3")
    assert kernels._env_act_quant() == "auto"  # warned, the default


def test_auto_picks_int8_activations_for_big_models_only():
    """``auto`` (the default) resolves per loaded target by the bytes its decode step reads; an explicit
    mode is never overridden."""
    before = kernels.act_quant()
    try:
        kernels.set_act_quant("auto")
        assert kernels.resolve_act_quant(kernels.AUTO_Q8_BYTES) == "q8_0"  # Gemma 4 E2B: 1.2 GiB
        assert kernels.act_quant() == "q8_0"
        assert kernels.resolve_act_quant(235 << 20) == "none"  # Gemma 3 270M
        kernels.set_act_quant("none")
        assert kernels.resolve_act_quant(4 << 30) == "none"
        kernels.set_act_quant("q8_0")
        assert kernels.resolve_act_quant(1 << 20) == "q8_0"
    finally:
        kernels.set_act_quant(before)


def test_auto_gives_a_mid_sized_models_head_int8_activations_for_every_row_count(engine):
    """Under ``auto`` the default model (235 MiB per step) keeps fp32 activations in its Q4_K / Q6_K layer
    products but its head multiplies int8 activations, for any number of rows: a logits row is the same from a 1-row decode, a verify and a
    20-row prefill (so cached and fresh prompts agree), and differs from the fp32 product; an explicit
    ``none`` still rules, and smaller or larger models are not marked."""
    if kernels.load_library() is None:
        pytest.skip("no C compiler")
    from gemmaspec.kernels import build

    head = engine.model.head
    assert head.auto_q8  # marked at load (load_checkpoint)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((20, head.shape[1])).astype(np.float32))
    saved = build._act_mode, build._act_q8
    try:
        kernels.set_act_quant("auto")
        build._act_q8 = False  # the layers' mode for this model size
        many = head(x)  # more than SMALL_M rows
        assert x.shape[0] > kernels.SMALL_M
        for i in (0, 7, 19):
            assert torch.equal(head(x[i:i + 1])[0], many[i])
        assert torch.equal(head(x[3:6]), many[3:6])
        kernels.set_act_quant("none")
        assert not torch.equal(head(x[:2]), many[:2])
        assert not kernels.auto_q8_head(235 << 20, kernels.Q4_0Weight(torch.zeros(8, 18, dtype=torch.uint8), 32))
        kernels.set_act_quant("auto")
        w = kernels.Q4_0Weight(torch.zeros(8, 18, dtype=torch.uint8), 32)
        assert not kernels.auto_q8_head(kernels.AUTO_Q8_HEAD_BYTES - 1, w) and not w.auto_q8  # tiny models
        assert not kernels.auto_q8_head(kernels.AUTO_Q8_BYTES, w)  # big ones: int8 everywhere already
        assert kernels.auto_q8_head(235 << 20, w) and w.auto_q8
    finally:
        build._act_mode, build._act_q8 = saved


def test_the_mode_changes_the_model_products_and_fp32_is_the_default(libs):
    if kernels.load_library() is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(9)
    w = weight(rng, "Q4_0", 64, 256)
    x = torch.from_numpy(rng.standard_normal((2, 256)).astype(np.float32))
    before = kernels.act_quant()
    try:
        kernels.set_act_quant("none")
        fp = w(x)
        kernels.set_act_quant("q8_0")
        q8 = w(x)
    finally:
        kernels.set_act_quant(before)
    lib = kernels.load_library()
    assert np.array_equal(bits(fp.numpy()), bits(q8_product(lib, w, x.numpy(), q8=False)))
    assert np.array_equal(bits(q8.numpy()), bits(q8_product(lib, w, x.numpy())))
    assert not torch.equal(fp, q8)


@pytest.mark.parametrize("kind", ["code", "rewrite"])
def test_greedy_speculative_equals_plain_with_int8_activations(engine, kind):
    from test_speculative import _prompt_ids, _tokens

    from gemmaspec.speculative.drafters import NgramDrafter

    before = kernels.act_quant()
    kernels.set_act_quant("q8_0")
    try:
        ids = _prompt_ids(engine, kind)
        plain = _tokens(engine, ids, 40)
        for n_max in (1, 3):
            assert _tokens(engine, ids, 40, NgramDrafter(), n_max) == plain, (kind, n_max)
    finally:
        kernels.set_act_quant(before)


def test_cli_flag_sets_the_mode(model_path, capsys):
    from gemmaspec.cli import main

    before = kernels.act_quant()
    try:
        assert main(["generate", "-m", str(model_path), "-p", "def add(a, b):", "-n", "4", "--temp", "0",
                     "--act-quant", "q8_0"]) == 0
        assert kernels.act_quant() == "q8_0"
    finally:
        kernels.set_act_quant(before)
    assert capsys.readouterr().out.strip()  # it generated text


@pytest.mark.parametrize("fmt", ["Q4_0x8", "Q8_0x8", "Q5_0x8", "Q4_Kx8", "Q6_Kx8"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 23])
def test_two_groups_per_pass_give_the_same_bits(libs, fmt, m):
    """The AVX-512 path runs two groups of 8 repacked rows per pass once x has 2+ rows (each activation
    broadcast serves 16 weight rows): with 40 rows (two pairs and a single group) and 1-23 rows of x (4
    at a time, 8 for Q4_0 with VNNI, so a last chunk of 1-7; the single group then takes them 4 at a time),
    every path gives the portable reference's bits, and each row alone gives its bits in the batch."""
    ref, built = libs
    rng = np.random.default_rng(m)
    k = 512 if fmt[:4] in ("Q4_K", "Q6_K") else 32 * 7
    w = weight(rng, fmt, 40, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = q8_product(ref, w, x, 2)
    for isa, lib in built.items():
        assert np.array_equal(bits(q8_product(lib, w, x, 2)), bits(want)), isa
        for i in range(m):
            assert np.array_equal(bits(q8_product(lib, w, x[i:i + 1].copy(), 1)), bits(want[i:i + 1])), (isa, i)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_repacked_8_rows_at_a_time(qtype):
    """Q4_0 and Q8_0 weights with a multiple of 8 rows are repacked for the int8-activation products
    (x8.h): the layout holds the same blocks (dequantization and row lookups from it give the stored
    values), products from it are W @ (aq * da) like the stored layout's, and rows that are not a
    multiple of 8 keep the stored layout."""
    lib = kernels.load_library()
    if lib is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(11)
    raw = torch.from_numpy(random_blocks(rng, qtype, 72, 320))
    w, plain = kernels.StoredWeight(raw, qtype, 320), kernels.StoredWeight(raw.clone(), qtype, 320)
    (fmt, x8, *_), = w._segments_q8(lib)
    assert fmt == kernels._X8[qtype] and x8.shape == raw.shape and not torch.equal(x8, raw)
    assert torch.equal(w.dequantize(), plain.dequantize())  # now read from the repacked copy
    ids = torch.tensor([0, 7, 8, 71, 33])
    assert torch.equal(w.rows(ids), plain.rows(ids))
    x = rng.standard_normal((3, 320)).astype(np.float32)
    got, stored = q8_product(lib, w, x), q8_product(lib, plain, x, stored=True)
    assert not np.array_equal(bits(got), bits(stored))  # another order of the same integers
    np.testing.assert_allclose(got, stored, rtol=1e-5, atol=1e-4 * np.abs(stored).max())
    # the fp32 products (their own layout, r8.h, on AVX-512 / AVX2) give the stored bits; so does the x8 one
    fp = q8_product(lib, w, x, q8=False)
    assert np.array_equal(bits(fp), bits(q8_product(lib, plain, x, q8=False)))
    y = np.empty((3, 72), np.float32)
    P, I1 = ctypes.c_void_p * 1, ctypes.c_int * 1
    lib.gs_qmatmul_multi(1, I1(fmt), P(x8.data_ptr()), P(None), P(None), I1(32), I1(72), 320, x.ctypes.data, None,
                         3, y.ctypes.data, 1)
    assert np.array_equal(bits(y), bits(fp))
    odd = kernels.StoredWeight(torch.from_numpy(random_blocks(rng, qtype, 13, 64)), qtype, 64)
    assert odd._segments_q8(lib)[0][0] == kernels._FMT[qtype]


def q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 rows as the Q8_0 blocks of the same values (d as stored, the 32 levels as int8), in numpy
    (ggml-common.h's block_q5_0: d, qh[4], qs[16]; value j < 16 the low nibble of qs[j] with bit j of qh
    above it, value j + 16 the high nibble with bit j + 16, minus 16)."""
    n = raw.shape[0]
    b = raw.reshape(-1, 22)
    qh = b[:, 2:6].copy().view("<u4")[:, 0]
    lev = np.empty((b.shape[0], 32), np.int16)
    for j in range(16):
        lev[:, j] = (b[:, 6 + j] & 15) | (((qh >> j) & 1) << 4)
        lev[:, j + 16] = (b[:, 6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
    return np.concatenate([b[:, :2], (lev - 16).astype(np.int8).view(np.uint8)], axis=1).reshape(n, -1)


def test_q5_0_repacks_as_the_q8_0_blocks_of_its_values():
    """A Q5_0 weight with a multiple of 8 rows is repacked for the int8-activation products into the
    Q8_0 x8 layout (its levels fit int8 exactly): 34 bytes per block against 22, products bit for bit
    those of the Q8_0 weight holding the same values, for every row count and alone or in a batch;
    dequantization, row lookups and the fp32 products read from the copy give the stored Q5_0's values
    and bits; rows that are not a multiple of 8 keep the stored layout."""
    lib = kernels.load_library()
    if lib is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(21)
    raw = random_blocks(rng, "Q5_0", 48, 320)
    w = kernels.StoredWeight(torch.from_numpy(raw.copy()), "Q5_0", 320)
    plain = kernels.StoredWeight(torch.from_numpy(raw.copy()), "Q5_0", 320)
    as_q8 = kernels.StoredWeight(torch.from_numpy(q5_0_as_q8_0(raw)), "Q8_0", 320)
    assert torch.equal(as_q8.dequantize(), plain.dequantize())  # the conversion is exact
    (fmt, x8, *_), = w._segments_q8(lib)
    assert fmt == kernels._X8["Q8_0"] and tuple(x8.shape) == (48, 10 * 34)
    assert torch.equal(x8, as_q8._segments_q8(lib)[0][1])  # the very bytes of the Q8_0 weight's copy
    x = rng.standard_normal((19, 320)).astype(np.float32)
    got = q8_product(lib, w, x, 2)
    assert np.array_equal(bits(got), bits(q8_product(lib, as_q8, x, 2)))
    for i in (0, 5, 18):
        assert np.array_equal(bits(q8_product(lib, w, x[i:i + 1].copy(), 1)), bits(got[i:i + 1]))
    assert torch.equal(w.dequantize(), plain.dequantize())  # now read from the copy
    ids = torch.tensor([0, 7, 8, 47, 21])
    assert torch.equal(w.rows(ids), plain.rows(ids))
    y = np.empty((3, 48), np.float32)
    P, I1 = ctypes.c_void_p * 1, ctypes.c_int * 1
    lib.gs_qmatmul_multi(1, I1(fmt), P(x8.data_ptr()), P(None), P(None), I1(32), I1(48), 320, x.ctypes.data, None,
                         3, y.ctypes.data, 1)  # fp32 activations on the copy: the stored Q5_0's bits
    assert np.array_equal(bits(y), bits(q8_product(lib, plain, x[:3].copy(), q8=False)))
    odd = kernels.StoredWeight(torch.from_numpy(random_blocks(rng, "Q5_0", 13, 64)), "Q5_0", 64)
    assert odd._segments_q8(lib)[0][0] == kernels._FMT["Q5_0"]


def test_auto_gives_a_mid_sized_models_layers_int8_activations(engine):
    """Under ``auto`` the default model's layer products multiply int8 activations through the 8-row
    layouts (its fused q|k|v and gate|up, Q5_0 / Q8_0, as x8; its o and down, Q4_K / Q6_K, as I8X8). A
    row's result is the same from 1, 4 or 20 rows at once (decode, verify, prefill), an explicit ``none``
    turns it off, and models outside the head's size range, weights whose rows are not a multiple of 8
    and a stack whose parts are not all marked are left alone."""
    if kernels.load_library() is None:
        pytest.skip("no C compiler")
    from gemmaspec.kernels import build

    layer = engine.model.layers[0]
    saved = build._act_mode, build._act_q8
    try:
        kernels.set_act_quant("auto")
        build._act_q8 = False  # the layers' mode for this model size
        assert layer.gate_up._q8() and layer.qkv._q8() and layer.o._q8() and layer.down._q8()
        for w in (layer.gate_up, layer.down):
            x = torch.from_numpy(np.random.default_rng(5).standard_normal((20, w.shape[1])).astype(np.float32))
            many = w(x)
            for i in (0, 13, 19):
                assert torch.equal(w(x[i:i + 1])[0], many[i])
            assert torch.equal(w(x[4:8]), many[4:8])
        x = torch.from_numpy(np.random.default_rng(5).standard_normal((20, layer.gate_up.shape[1])).astype(np.float32))
        many = layer.gate_up(x)
        kernels.set_act_quant("none")
        assert not layer.gate_up._q8() and not torch.equal(layer.gate_up(x[:2]), many[:2])
        kernels.set_act_quant("auto")
        rng = np.random.default_rng(6)
        parts = [kernels.StoredWeight(torch.from_numpy(random_blocks(rng, t, n, 256)), t, 256) for t, n in (("Q4_K", 8), ("Q5_0", 12))]
        assert kernels.auto_q8_layers(kernels.AUTO_Q8_HEAD_BYTES - 1, parts) == 0  # tiny models
        assert kernels.auto_q8_layers(kernels.AUTO_Q8_BYTES, parts) == 0  # big ones: int8 everywhere already
        assert kernels.auto_q8_layers(235 << 20, parts) == 1 and parts[0].auto_q8 and not parts[1].auto_q8
        assert parts[0]._q8() and not kernels.StackedWeight(parts)._q8()  # a mixed stack keeps fp32
    finally:
        build._act_mode, build._act_q8 = saved


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_repack_as_int8_levels_8_rows_at_a_time(qtype):
    """Q4_K and Q6_K weights with a multiple of 8 rows are repacked for the int8-activation products into
    FMT_I8X8 (x8.h): int8 levels [N, K] 8 rows interleaved, fp32 scales (and Q4_K's offsets) per 32 or 16
    values. The copy holds the stored values (dequantization and row lookups from it give the stored
    ones; fp32 products on it give the stored bits), its products are W @ (aq * da) up to float rounding
    (test_reference_is_the_product_of_the_quantized_activations) with every path's bits equal
    (test_simd_paths_equal_the_portable_reference), and rows that are not a multiple of 8 keep the stored
    layout."""
    lib = kernels.load_library()
    if lib is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(12)
    raw = torch.from_numpy(random_blocks(rng, qtype, 24, 512))
    w, plain = kernels.StoredWeight(raw, qtype, 512), kernels.StoredWeight(raw.clone(), qtype, 512)
    (fmt, lev, s, o, g, n), = w._segments_q8(lib)
    assert (fmt, g, n, tuple(lev.shape), s.numel()) == (kernels.FMT_I8X8, 32 if qtype == "Q4_K" else 16, 24, (24, 512),
                                                        24 * 512 // g)
    assert (o is not None) == (qtype == "Q4_K")
    q, sc, off, g2 = plain.levels()  # the int8 form: row 9's block 3 sits in group 1, lane 1
    assert g2 == g and float(s[(1 * (512 // g) + 3) * 8 + 1]) == float(sc[9, 3])
    at = ((1 * (512 // g) + 3) * 8 * g) + 4 * 1  # its first byte group, lane 1: values 0..3 of that block
    assert torch.equal(lev.flatten()[at:at + 4], q[9, 3 * g:3 * g + 4])
    assert torch.equal(w.dequantize(), plain.dequantize())  # now read from the copy
    ids = torch.tensor([0, 7, 8, 23, 13])
    assert torch.equal(w.rows(ids), plain.rows(ids))
    x = rng.standard_normal((3, 512)).astype(np.float32)
    fp = q8_product(lib, w, x, q8=False, stored=True)
    y = np.empty((3, 24), np.float32)
    P, I1, F1 = ctypes.c_void_p * 1, ctypes.c_int * 1, ctypes.c_void_p * 1
    lib.gs_qmatmul_multi(1, I1(fmt), P(lev.data_ptr()), F1(s.data_ptr()), F1(None if o is None else o.data_ptr()),
                         I1(g), I1(24), 512, x.ctypes.data, None, 3, y.ctypes.data, 1)
    assert np.array_equal(bits(y), bits(fp))  # fp32 activations on the copy: the stored bits
    odd = kernels.StoredWeight(torch.from_numpy(random_blocks(rng, qtype, 13, 256)), qtype, 256)
    assert odd._segments_q8(lib)[0][0] == kernels._FMT[qtype]
