"""Q4_0 weights multiplied as stored (``gs_qmatmul_q4_0``, :class:`~gemmaspec.kernels.Q4_0Weight`):
every instruction-set path gives the same bits as the int8 path on the converted weights, at half
its memory."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmaspec import kernels
from gemmaspec.loading.ggml_blocks import to_int8_blocks

ISAS = ["portable"] + [isa for isa in ("avx2", "avx512") if kernels.cpu_supports(isa)]


@pytest.fixture(scope="module")
def libs():
    built = {isa: kernels.matmul_library(isa) for isa in ISAS}
    if any(lib is None for lib in built.values()):
        pytest.skip("no C compiler: kernels fall back to torch")
    for isa, lib in built.items():
        assert lib.gs_isa().decode() == isa
    return built


def _q4_0_blocks(rng, n: int, k: int) -> np.ndarray:
    """Random Q4_0 bytes uint8 [n, k/32*18]: finite fp16 scales (normal, subnormal, zero, negative)
    and random nibbles."""
    nb = k // 32
    d = (rng.standard_normal((n, nb)) * 10.0 ** rng.integers(-7, 2, (n, nb))).astype(np.float16)
    d[rng.random((n, nb)) < 0.05] = 0
    b = np.empty((n, nb, 18), np.uint8)
    b[..., :2] = d[..., None].view(np.uint8)
    b[..., 2:] = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
    return b.reshape(n, nb * 18)


def _int8(raw: np.ndarray, n: int, k: int):
    q, s, o, g = to_int8_blocks(raw, T.Q4_0, n, k)
    assert o is None and g == 32
    return q, s


def _int8_product(lib, q, s, x, threads):
    n, k = q.shape
    m = x.shape[0]
    y = np.empty((m, n), np.float32)
    lib.gs_qmatmul(q.ctypes.data, s.ctypes.data, None, n, k, 32, x.ctypes.data, None, m, y.ctypes.data, threads)
    return y


def _q4_0_product(lib, raw, k, x, threads):
    n, m = raw.shape[0], x.shape[0]
    y = np.empty((m, n), np.float32)
    lib.gs_qmatmul_q4_0(raw.ctypes.data, n, k, x.ctypes.data, m, y.ctypes.data, threads)
    return y


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.int32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 70), blocks=st.integers(1, 9), m=st.integers(1, 16), threads=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16))
def test_q4_0_kernel_equals_int8_kernel_bit_for_bit(libs, n, blocks, m, threads, seed):
    rng = np.random.default_rng(seed)
    k = blocks * 32
    raw = _q4_0_blocks(rng, n, k)
    q, s = _int8(raw, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = _int8_product(libs["portable"], q, s, x, threads)
    for isa, lib in libs.items():
        assert np.array_equal(_bits(_q4_0_product(lib, raw, k, x, threads)), _bits(want)), isa
        assert np.array_equal(_bits(_int8_product(lib, q, s, x, threads)), _bits(want)), isa


@pytest.mark.parametrize("isa", ISAS)
def test_dequant_tiles_equal_gguf_dequantize(libs, isa):
    rng = np.random.default_rng(3)
    n, k = 37, 160
    raw = _q4_0_blocks(rng, n, k)
    want = gguf.quants.dequantize(raw, T.Q4_0).reshape(n, k).astype(np.float32)
    out = np.full((10, k), np.nan, np.float32)
    libs[isa].gs_dequant_q4_0(raw.ctypes.data, 20, 30, k, out.ctypes.data, 2)
    assert np.array_equal(out, want[20:30])


def test_portable_fp16_conversion_is_exact(libs):
    """Every finite fp16 value as a block scale (the portable path converts fp16 in C)."""
    h = np.arange(0, 1 << 16, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h)]
    n = h.size
    b = np.zeros((n, 18), np.uint8)
    b[:, :2] = h[:, None].view(np.uint8)
    b[:, 2:] = 0x99  # every value nibble 9: level 1, so W = d
    out = np.empty((n, 32), np.float32)
    libs["portable"].gs_dequant_q4_0(b.ctypes.data, 0, n, 32, out.ctypes.data, 1)
    want = h.astype(np.float32) + np.float32(0)  # d * 1 + 0, as gs_dequant computes it (-0 becomes +0)
    assert np.array_equal(out[:, 0].view(np.int32), want.view(np.int32))


def _weights(seed=0, n=300, k=256):
    rng = np.random.default_rng(seed)
    raw = _q4_0_blocks(rng, n, k)
    q, s = _int8(raw, n, k)
    return raw, kernels.Q4_0Weight(torch.from_numpy(raw), k), kernels.QuantizedWeight(torch.from_numpy(q), torch.from_numpy(s), None, 32)


@pytest.mark.parametrize("m", [1, 5, 16, 17, 40])
def test_weight_class_matches_the_int8_weight(m):
    raw, w4, w8 = _weights()
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    got, want = w4(x), w8(x)
    assert got.shape == (m, 300)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_weight_class_rows_dequantize_and_memory():
    raw, w4, w8 = _weights()
    want = gguf.quants.dequantize(raw, T.Q4_0).reshape(300, 256).astype(np.float32)
    assert torch.equal(w4.dequantize(), torch.from_numpy(want))
    ids = torch.tensor([[0, 299], [17, 17]])
    assert torch.equal(w4.rows(ids), torch.from_numpy(want)[ids])
    assert torch.equal(w4.rows(ids).view(torch.int32), w8.rows(ids).view(torch.int32))
    assert w4.shape == (300, 256)
    assert w4.nbytes == raw.nbytes == 300 * 8 * 18
    assert w4.nbytes * 2 == w8.nbytes


def test_weight_class_without_a_compiler_falls_back_exactly(monkeypatch):
    raw, w4, w8 = _weights(1, 40, 64)
    x = torch.randn(3, 64)
    want = x @ torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_0).reshape(40, 64).astype(np.float32)).T
    monkeypatch.setattr(kernels, "load_library", lambda: None)
    torch.testing.assert_close(w4(x), want, rtol=1e-6, atol=1e-6)


def test_bad_shape_is_refused():
    with pytest.raises(ValueError, match="Q4_0"):
        kernels.Q4_0Weight(torch.zeros(4, 17, dtype=torch.uint8), 32)


def _tiny_q4_0_gguf(path):
    """A tiny random Gemma 3 GGUF whose every matrix is Q4_0 (norms F32); returns its config."""
    from gemmaspec.models.config import Gemma3Config
    from gemmaspec.models.gemma3 import required_tensors

    cfg = Gemma3Config(vocab_size=96, hidden_size=64, num_layers=2, intermediate_size=96, num_heads=2,
                       num_kv_heads=1, head_dim=32, sliding_window=8, sliding_window_pattern=2,
                       query_pre_attn_scalar=32.0)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"token_embd": (cfg.vocab_size, h), "attn_q": (cfg.num_heads * hd, h), "attn_k": (hd, h),
              "attn_v": (hd, h), "attn_output": (h, cfg.num_heads * hd), "ffn_gate": (inter, h),
              "ffn_up": (inter, h), "ffn_down": (h, inter), "attn_q_norm": (hd,), "attn_k_norm": (hd,)}
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "gemma3")
    for name in required_tensors(cfg):
        base = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        shape = shapes.get(base, (h,))
        if len(shape) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            v = (rng.standard_normal(shape) / shape[1] ** 0.5).astype(np.float32)
            w.add_tensor(name, gguf.quants.quantize(v, T.Q4_0), raw_dtype=T.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return cfg


def test_a_q4_0_model_keeps_its_bytes_and_gives_the_int8_logits(tmp_path):
    from gemmaspec.loading.gguf import open_reader, tensor_weight
    from gemmaspec.models.gemma3 import Gemma3Model

    cfg = _tiny_q4_0_gguf(tmp_path / "tiny.gguf")
    header = open_reader(tmp_path / "tiny.gguf")
    weights = {t.name: tensor_weight(header, t) for t in header.tensors}
    for t in header.tensors:
        if t.tensor_type == T.Q4_0:
            assert isinstance(weights[t.name], kernels.Q4_0Weight)
            assert weights[t.name].nbytes == t.n_bytes  # memory = file bytes
    as_int8 = {n: w.to_int8() if isinstance(w, kernels.Q4_0Weight) else w for n, w in weights.items()}
    stored, int8 = Gemma3Model(cfg, weights), Gemma3Model(cfg, as_int8)
    assert isinstance(stored.layers[0].qkv, kernels.Q4_0Weight)  # q, k, v fused as stored

    tokens = torch.arange(20) * 7 % cfg.vocab_size
    logits = []
    for model in (stored, int8):
        cache = model.new_cache(64)
        out = [model.forward(tokens, cache, all_logits=True).logits]  # prefill: more than SMALL_M rows
        for tok in (5, 9, 11):
            out.append(model.forward(torch.tensor([tok]), cache).logits)  # decode: the C kernel
        logits.append(torch.cat(out))
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0].view(torch.int32), logits[1].view(torch.int32))
