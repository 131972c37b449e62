"""Every instruction-set path of the C kernel (AVX-512, AVX2+FMA, portable C) computes the same bits:
the portable path is the reference, and each SIMD path this CPU can run is built and compared with it
(``GEMMASPEC_ISA`` chooses the path at run time)."""

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmaspec import kernels
from test_stored_weights import bits, random_blocks

SIMD = [isa for isa in ("avx512", "avx2") if kernels.cpu_supports(isa)]


@pytest.fixture(scope="module")
def libs():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=4) as pool:  # each build is a compiler process: build them side by side
        ref, *simd = pool.map(kernels.matmul_library, ["portable", *SIMD])
    if ref is None:
        pytest.skip("no C compiler: kernels fall back to torch")
    built = dict(zip(SIMD, simd))
    for isa, lib in built.items():
        assert lib.gs_isa().decode() == isa  # the switch really built that path
    assert ref.gs_isa().decode() == "portable"
    return ref, built


def _run(lib, q, s, o, x, threads):
    n, k = q.shape
    m = x.shape[0]
    g = k // s.shape[1]
    xsum = None
    if o is not None:
        xsum = np.empty((m, k // g), np.float32)
        lib.gs_block_sums(x.ctypes.data, m, k, g, xsum.ctypes.data)
    y = np.empty((m, n), np.float32)
    lib.gs_qmatmul(q.ctypes.data, s.ctypes.data, None if o is None else o.ctypes.data, n, k, g, x.ctypes.data,
                   None if xsum is None else xsum.ctypes.data, m, y.ctypes.data, threads)
    return y


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 70), blocks=st.integers(1, 9), group=st.sampled_from([16, 32]),
       m=st.integers(1, 16), offset=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_simd_paths_equal_the_portable_reference(libs, n, blocks, group, m, offset, threads, seed):
    ref, built = libs
    if not built:
        pytest.skip("this CPU has neither AVX2+FMA nor AVX-512")
    rng = np.random.default_rng(seed)
    k = blocks * group
    q = rng.integers(-128, 128, (n, k), dtype=np.int8)
    s = rng.standard_normal((n, blocks)).astype(np.float32)
    o = rng.standard_normal((n, blocks)).astype(np.float32) if offset else None
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = _run(ref, q, s, o, x, threads)
    for isa, lib in built.items():
        got = _run(lib, q, s, o, x, threads)
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), isa
    # batch invariance within a path: each row alone gives the same bits
    for i in range(m):
        assert np.array_equal(_run(ref, q, s, o, x[i:i + 1].copy(), threads).view(np.int32), want[i:i + 1].view(np.int32))


def test_reference_is_the_exact_product_up_to_rounding(libs):
    """The portable reference itself computes x @ W.T (float64 check), so equality above means something."""
    ref, _ = libs
    rng = np.random.default_rng(1)
    q = rng.integers(-8, 8, (33, 96), dtype=np.int8)
    s = rng.random((33, 3)).astype(np.float32)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    w = (q.reshape(33, 3, 32) * s[..., None]).reshape(33, 96).astype(np.float64)
    got = _run(ref, q, s, None, x, 1)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)


def test_unknown_isa_falls_back_to_auto(monkeypatch):
    monkeypatch.setenv("GEMMASPEC_ISA", "sse9")
    assert kernels.isa_choice() == "auto"
    monkeypatch.setenv("GEMMASPEC_ISA", "portable")
    assert kernels.isa_choice() == "portable"


def test_prefill_dequantizes_a_tile_at_a_time(monkeypatch):
    """A many-row product never widens the whole matrix: only TILE_BYTES of float32 at a time."""
    if kernels.load_library() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(0)
    w = kernels.QuantizedWeight(torch.randint(-8, 8, (1000, 64), dtype=torch.int8, generator=g),
                                torch.rand(1000, 2, generator=g), torch.rand(1000, 2, generator=g), 32)
    x = torch.randn(40, 64, generator=g)
    monkeypatch.setattr(kernels.weights, "TILE_BYTES", 64 * 4 * 300)  # 300 rows per tile: 4 tiles, the last partial
    widest = []
    real = torch.empty

    def spy(*shape, **kw):
        t = real(*shape, **kw)
        if len(shape) == 2 and shape[1] == 64:
            widest.append(shape[0])
        return t

    monkeypatch.setattr(torch, "empty", spy)
    got = w(x)
    monkeypatch.undo()
    assert widest == [300]
    torch.testing.assert_close(got, x @ w.dequantize().T, rtol=1e-6, atol=1e-6)


def _stored_product(lib, fmt, w, n, k, x, threads):
    P, I1 = ctypes.c_void_p * 1, ctypes.c_int * 1
    y = np.empty((x.shape[0], n), np.float32)
    lib.gs_qmatmul_multi(1, I1(fmt), P(w.data_ptr()), P(None), P(None), I1(32), I1(n), k, x.ctypes.data, None,
                         x.shape[0], y.ctypes.data, threads)
    return y


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(qtype=st.sampled_from(["Q4_0", "Q8_0"]), groups=st.integers(1, 12), blocks=st.integers(1, 9),
       m=st.integers(1, 16), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16),
       special=st.sampled_from(["normal", "zeros", "tiny"]))
def test_regrouped_8_rows_give_the_stored_bits(libs, qtype, groups, blocks, m, threads, seed, special):
    """The fp32 products' layout of Q4_0 / Q8_0 (r8.h: 8 rows' blocks side by side) gives the stored
    layout's bits on every path (the SIMD ones read it in place, the portable one rebuilds rows), for any
    number of rows of x; dequantization and row lookups read it back exactly. x also holds signed zeros
    (whole zero rows included) and subnormals, where the AVX2 one-row path's fma(n, x, -8x) for
    (n - 8) * x could only differ in the sign of a zero."""
    ref, built = libs
    rng = np.random.default_rng(seed)
    n, k = 8 * groups, 32 * blocks
    raw = torch.from_numpy(random_blocks(rng, qtype, n, k))
    x = rng.standard_normal((m, k)).astype(np.float32)
    if special == "zeros":
        x[rng.random((m, k)) < 0.5] = 0.0
        x[rng.random((m, k)) < 0.25] = -0.0
        x[rng.integers(0, m)] = rng.choice(np.array([0.0, -0.0], np.float32), k)
    elif special == "tiny":
        x *= np.float32(1e-39)  # subnormal
    fmt, rfmt = kernels._FMT[qtype], kernels._R8[qtype]
    want = _stored_product(ref, fmt, raw, n, k, x, threads)
    r8 = torch.empty_like(raw)
    assert ref.gs_repack_r8(fmt, raw.data_ptr(), n, k, r8.data_ptr(), threads) == 0
    assert not torch.equal(r8, raw)  # the bytes moved
    for isa, lib in {"portable": ref, **built}.items():
        assert np.array_equal(bits(_stored_product(lib, rfmt, r8, n, k, x, threads)), bits(want)), isa
        assert np.array_equal(bits(_stored_product(lib, fmt, raw, n, k, x, threads)), bits(want)), isa
    out = torch.empty(n, k)
    ref.gs_dequant_rows(rfmt, r8.data_ptr(), None, None, 32, 0, n, k, out.data_ptr(), 1)
    assert torch.equal(out, kernels.StoredWeight(raw, qtype, k).dequantize())


def test_stored_weights_regroup_on_the_simd_paths():
    """A StoredWeight regroups (Q4_0 / Q8_0, rows a multiple of 8) at its first fp32 product on an
    AVX-512 or AVX2 kernel, and gives the same bits as before; other row counts and types stay stored."""
    lib = kernels.load_library()
    if lib is None or lib.gs_isa().decode() not in kernels._R8_ISAS:
        pytest.skip("no AVX-512 / AVX2 kernel here")
    rng = np.random.default_rng(5)
    for qtype in ("Q4_0", "Q8_0"):
        raw = torch.from_numpy(random_blocks(rng, qtype, 64, 256))
        w = kernels.StoredWeight(raw.clone(), qtype, 256)
        x = torch.randn(3, 256)
        want = _stored_product(lib, kernels._FMT[qtype], raw, 64, 256, x.numpy(), 1)
        got = w(x)
        assert w.kernel_args(lib, False)[2][0][0] == kernels._R8[qtype]
        assert np.array_equal(bits(got.numpy()), bits(want))
        ids = torch.tensor([0, 7, 8, 63, 33])
        assert torch.equal(w.rows(ids), kernels.StoredWeight(raw, qtype, 256).rows(ids))
        odd = kernels.StoredWeight(torch.from_numpy(random_blocks(rng, qtype, 13, 64)), qtype, 64)
        assert odd._segments_f32(lib)[0][0] == kernels._FMT[qtype]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=st.integers(1, 6), shape=st.sampled_from([(8, 1, 256), (8, 1, 512), (4, 2, 16), (4, 1, 48), (2, 2, 32)]),
       L=st.integers(1, 600), masked=st.booleans(), softcap=st.sampled_from([0.0, 30.0]),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_attention_paths_equal_the_portable_reference(libs, t, shape, L, masked, softcap, threads, seed):
    """gs_attention_mt's SIMD score tiles (vector fused multiply-adds, and on AVX-512 the 16 sums' trees
    side by side) give the portable loops' bits: any query and key count (partial tiles), head dims from
    16 to 512, masks, soft-capping, 1 and 2 threads."""
    ref, built = libs
    if not built:
        pytest.skip("this CPU has neither AVX2+FMA nor AVX-512")
    h, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    k = torch.randn(L, hkv, d, generator=g) / d ** 0.25
    v = torch.randn(L, hkv, d, generator=g)
    mask = (torch.rand(t, L, generator=g) > 0.3).to(torch.uint8) if masked else None

    def run(lib):
        out = torch.full((t, h, d), float("nan"))
        rc = lib.gs_attention_mt(q.data_ptr(), h * d, t, h, hkv, d, k.data_ptr(), v.data_ptr(), L,
                                 None if mask is None else mask.data_ptr(), ctypes.c_float(0.0625),
                                 ctypes.c_float(softcap), out.data_ptr(), threads)
        assert rc == 0
        return out.numpy()

    want = run(ref)
    for isa, lib in built.items():
        assert np.array_equal(bits(run(lib)), bits(want)), isa
