"""Weights multiplied as stored (:class:`~gemmaspec.kernels.StoredWeight`: Q4_0, Q8_0, Q5_0, Q4_K, Q6_K
blocks read straight from the file's bytes): every instruction-set path gives the same bits as the
int8 path on the exactly converted weights (``to_int8_blocks``), for any number of rows, threads and
shapes; side-by-side weights (:class:`~gemmaspec.kernels.StackedWeight`) equal their parts; a model
built from stored weights gives the int8 model's logits bit for bit."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmaspec import kernels
from gemmaspec.kernels.ggml_blocks import to_int8_blocks

ISAS = ["portable"] + [isa for isa in ("avx2", "avx512") if kernels.cpu_supports(isa)]
TYPES = kernels.STORED_TYPES
# byte offsets of the fp16 fields of each block (kept finite in random blocks)
F16_AT = {"Q4_0": (0,), "Q8_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


@pytest.fixture(scope="module")
def libs():
    built = {isa: kernels.matmul_library(isa) for isa in ISAS}
    if any(lib is None for lib in built.values()):
        pytest.skip("no C compiler: kernels fall back to torch")
    for isa, lib in built.items():
        assert lib.gs_isa().decode() == isa
    return built


def random_blocks(rng, qtype: str, n: int, k: int) -> np.ndarray:
    """Random bytes of an [n, k] tensor of ``qtype`` (uint8 [n, row_bytes]): every level, scale and
    min pattern, with finite fp16 fields (normal, subnormal, zero, negative)."""
    per, size = GGML_QUANT_SIZES[T[qtype]]
    nb = k // per
    b = rng.integers(0, 256, (n, nb, size), dtype=np.uint8)
    for at in F16_AT[qtype]:
        d = (rng.standard_normal((n, nb)) * 10.0 ** rng.integers(-7, 2, (n, nb))).astype(np.float16)
        d[rng.random((n, nb)) < 0.05] = 0
        b[..., at:at + 2] = d[..., None].view(np.uint8)
    return b.reshape(n, nb * size)


def as_int8(raw: np.ndarray, qtype: str, k: int) -> kernels.QuantizedWeight:
    q, s, o, g = to_int8_blocks(raw, T[qtype], raw.shape[0], k)
    return kernels.QuantizedWeight(torch.from_numpy(q), torch.from_numpy(s), None if o is None else torch.from_numpy(o), g)


def product(lib, w: kernels.BlockWeight, x: np.ndarray, threads: int) -> np.ndarray:
    y = torch.empty(x.shape[0], w.shape[0])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w._small(lib, torch.from_numpy(x), y)
    finally:
        torch.set_num_threads(old)
    return y.numpy()


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.int32)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(qtype=st.sampled_from(TYPES), n=st.integers(1, 70), blocks=st.integers(1, 3), m=st.integers(1, 16),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_stored_kernels_equal_the_int8_reference_bit_for_bit(libs, qtype, n, blocks, m, threads, seed):
    rng = np.random.default_rng(seed)
    per = GGML_QUANT_SIZES[T[qtype]][0]
    k = blocks * max(per, 64) if per == 32 else blocks * per
    raw = random_blocks(rng, qtype, n, k)
    stored, int8 = kernels.StoredWeight(torch.from_numpy(raw), qtype, k), as_int8(raw, qtype, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = product(libs["portable"], int8, x, threads)
    for isa, lib in libs.items():
        assert np.array_equal(bits(product(lib, stored, x, threads)), bits(want)), (isa, qtype)
        assert np.array_equal(bits(product(lib, int8, x, threads)), bits(want)), (isa, qtype)
    # batch invariance: each row alone gives the same bits
    i = int(rng.integers(0, m))
    assert np.array_equal(bits(product(libs[ISAS[-1]], stored, x[i:i + 1].copy(), threads)), bits(want[i:i + 1]))


def test_the_reference_is_the_exact_product_up_to_rounding(libs):
    """The int8 reference itself computes x @ W.T for every type (float64 check), so the equality above
    means something."""
    rng = np.random.default_rng(1)
    for qtype in TYPES:
        raw = random_blocks(rng, qtype, 33, 256)
        w = gguf.quants.dequantize(raw, T[qtype]).reshape(33, 256).astype(np.float64)
        w[~np.isfinite(w)] = 0
        x = rng.standard_normal((5, 256)).astype(np.float32)
        got = product(libs["portable"], as_int8(raw, qtype, 256), x, 1)
        ref = x.astype(np.float64) @ w.T
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(w).max() * 16, err_msg=qtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_dequantized_rows_equal_gguf_dequantize(libs, isa, qtype, monkeypatch):
    rng = np.random.default_rng(3)
    n, k = 37, 512
    raw = random_blocks(rng, qtype, n, k)
    want = gguf.quants.dequantize(raw, T[qtype]).reshape(n, k).astype(np.float32)
    w = kernels.StoredWeight(torch.from_numpy(raw), qtype, k)
    out = torch.full((10, k), float("nan"))
    w._dequant_rows(libs[isa], 20, 30, out)
    assert np.array_equal(out.numpy(), want[20:30])
    monkeypatch.setattr(kernels.weights, "load_library", lambda: libs[isa])
    ids = torch.tensor([[0, 36], [17, 17]])
    assert np.array_equal(w.rows(ids).numpy(), want[ids.numpy()])
    assert torch.equal(w.rows(ids).view(torch.int32), as_int8(raw, qtype, k).rows(ids).view(torch.int32))


def test_portable_fp16_conversion_is_exact(libs):
    """Every finite fp16 value as a block scale (the portable path converts fp16 in C)."""
    h = np.arange(0, 1 << 16, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h)]
    n = h.size
    b = np.zeros((n, 18), np.uint8)
    b[:, :2] = h[:, None].view(np.uint8)
    b[:, 2:] = 0x99  # every value nibble 9: level 1, so W = d
    out = torch.empty(n, 32)
    kernels.Q4_0Weight(torch.from_numpy(b), 32)._dequant_rows(libs["portable"], 0, n, out)
    want = h.astype(np.float32) + np.float32(0)  # d * 1 + 0, as the C dequantizer computes it (-0 becomes +0)
    assert np.array_equal(bits(out[:, 0].numpy()), bits(want))


@pytest.mark.parametrize("m", [1, 5, 16, 17, 40])
def test_weight_classes_agree_for_decode_and_prefill_sizes(m):
    rng = np.random.default_rng(m)
    for qtype in TYPES:
        raw = random_blocks(rng, qtype, 300, 256)
        stored, int8 = kernels.StoredWeight(torch.from_numpy(raw), qtype, 256), as_int8(raw, qtype, 256)
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        got, want = stored(x), int8(x)
        assert got.shape == (m, 300)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), qtype
        assert stored.nbytes == raw.nbytes < int8.nbytes


def test_stacked_weights_equal_their_parts():
    """q, k, v of different types side by side: one kernel call, the parts' own bits, no copy."""
    rng = np.random.default_rng(5)
    parts = [kernels.StoredWeight(torch.from_numpy(random_blocks(rng, t, n, 256)), t, 256)
             for t, n in (("Q5_0", 70), ("Q4_K", 9), ("Q8_0", 64), ("Q6_K", 3))]
    parts.append(as_int8(random_blocks(rng, "Q4_K", 5, 256), "Q4_K", 256))  # int8 with offsets
    stacked = kernels.StackedWeight(parts)
    assert stacked.shape == (151, 256) and stacked.nbytes == sum(p.nbytes for p in parts)
    assert all(a.raw.data_ptr() == b.raw.data_ptr() for a, b in zip(stacked.parts, parts[:4]))
    for m in (1, 3, 8, 16, 20):
        x = torch.randn(m, 256)
        want = torch.cat([p(x) for p in parts], dim=-1)
        assert torch.equal(stacked(x).view(torch.int32), want.view(torch.int32)), m
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(ValueError, match="cannot stack"):
        kernels.StackedWeight([parts[0], as_int8(random_blocks(rng, "Q8_0", 2, 64), "Q8_0", 64)])


def test_without_a_compiler_weights_fall_back_exactly(monkeypatch):
    rng = np.random.default_rng(1)
    for qtype in TYPES:
        raw = random_blocks(rng, qtype, 40, 256)
        w = kernels.StoredWeight(torch.from_numpy(raw), qtype, 256)
        x = torch.randn(3, 256)
        dense = torch.from_numpy(gguf.quants.dequantize(raw, T[qtype]).reshape(40, 256).astype(np.float32))
        monkeypatch.setattr(kernels.weights, "load_library", lambda: None)
        torch.testing.assert_close(w(x), x @ dense.T, rtol=1e-5, atol=1e-5 * float(dense.abs().max()) * 16)
        assert torch.equal(w.rows(torch.tensor([3, 0])), dense[[3, 0]])
        monkeypatch.undo()


def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="Q4_0"):
        kernels.Q4_0Weight(torch.zeros(4, 17, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.StoredWeight(torch.zeros(4, 144, dtype=torch.uint8), "Q4_K", 128)
    with pytest.raises(ValueError, match="Q5_K weights cannot be kept as stored"):
        kernels.StoredWeight(torch.zeros(4, 176, dtype=torch.uint8), "Q5_K", 256)


# the default model's mix: Q8_0 embedding/head, Q5_0 q/k/gate/up, Q8_0 v, Q4_K attn_output, Q6_K ffn_down
MIX = {"token_embd": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K",
       "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q6_K"}
# fp16 scale magnitudes that give weights of about 1/sqrt(K), so activations stay finite
TAME = {"Q4_0": 5e-3, "Q5_0": 3e-3, "Q8_0": 4e-4, "Q4_K": 5e-5, "Q6_K": 1e-5}


def tiny_mixed_weights(mix=MIX):
    """A tiny random Gemma 3 (config, stored weights by GGUF name) with matrices in the types of
    ``mix`` (norms float32)."""
    from gemmaspec.models.config import Gemma3Config
    from gemmaspec.models.gemma3 import required_tensors

    cfg = Gemma3Config(vocab_size=96, hidden_size=256, num_layers=2, intermediate_size=512, num_heads=4,
                       num_kv_heads=1, head_dim=64, sliding_window=8, sliding_window_pattern=2,
                       query_pre_attn_scalar=64.0)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"token_embd": (cfg.vocab_size, h), "attn_q": (cfg.num_heads * hd, h), "attn_k": (hd, h),
              "attn_v": (hd, h), "attn_output": (h, cfg.num_heads * hd), "ffn_gate": (inter, h),
              "ffn_up": (inter, h), "ffn_down": (h, inter), "attn_q_norm": (hd,), "attn_k_norm": (hd,)}
    rng = np.random.default_rng(7)
    weights = {}
    for name in required_tensors(cfg):
        base = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        shape = shapes.get(base, (h,))
        if len(shape) == 1:
            weights[name] = torch.from_numpy((0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        qtype = mix[base]
        raw = random_blocks(rng, qtype, *shape)
        per, size = GGML_QUANT_SIZES[T[qtype]]
        blocks = raw.reshape(shape[0], -1, size)
        for at in F16_AT[qtype]:
            d = (np.abs(rng.standard_normal(blocks.shape[:2])) * TAME[qtype]).astype(np.float16)
            blocks[..., at:at + 2] = d[..., None].view(np.uint8)
        weights[name] = kernels.StoredWeight(torch.from_numpy(raw), qtype, shape[1])
    return cfg, weights


def test_a_model_of_stored_weights_gives_the_int8_models_logits_bit_for_bit():
    from gemmaspec.models.gemma3 import Gemma3Model

    cfg, weights = tiny_mixed_weights()
    as_int8 = {n: w.to_int8() if isinstance(w, kernels.StoredWeight) else w for n, w in weights.items()}
    stored, int8 = Gemma3Model(cfg, weights), Gemma3Model(cfg, as_int8)
    qkv = stored.layers[0].qkv
    assert isinstance(qkv, kernels.StackedWeight)  # q, k, v side by side, each as stored
    assert [p.qtype for p in qkv.parts] == ["Q5_0", "Q5_0", "Q8_0"]
    assert qkv.parts[0].raw.data_ptr() == weights["blk.0.attn_q.weight"].raw.data_ptr()  # not copied
    tokens = torch.arange(20) * 7 % cfg.vocab_size
    logits = []
    for model in (stored, int8):
        cache = model.new_cache(64)
        out = [model.forward(tokens, cache, all_logits=True).logits]  # prefill: more than SMALL_M rows
        for tok in (5, 9, 11):
            out.append(model.forward(torch.tensor([tok]), cache).logits)  # decode: the C kernel
        logits.append(torch.cat(out))
    assert torch.isfinite(logits[0]).all() and logits[0].std() > 0
    assert torch.equal(logits[0].view(torch.int32), logits[1].view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES)
def test_dot_rows_scores_the_chosen_rows(libs, qtype, monkeypatch):
    """``dot_rows`` (the clustered head's candidate scores, ``gs_dot_ids``) equals the float64 dot of the
    dequantized rows to rounding, gives the same bits on every kernel path and thread count, and is each
    id's own value wherever it sits in the list (repeats included)."""
    rng = np.random.default_rng(4)
    n, k = 300, 256
    raw = random_blocks(rng, qtype, n, k)
    dense = gguf.quants.dequantize(raw, T[qtype]).reshape(n, k).astype(np.float64)
    w = kernels.StoredWeight(torch.from_numpy(raw), qtype, k)
    x = torch.from_numpy(rng.standard_normal(k).astype(np.float32))
    ids = torch.from_numpy(rng.integers(0, n, 200))
    want = dense[ids.numpy()] @ x.numpy().astype(np.float64)
    got = {}
    for isa in ISAS:
        monkeypatch.setattr(kernels.weights, "load_library", lambda lib=libs[isa]: lib)
        for threads in (1, 2):
            monkeypatch.setattr(kernels.weights, "threads", lambda t=threads: t)
            got[isa, threads] = w.dot_rows(ids, x)
    first = next(iter(got.values()))
    assert all(torch.equal(g, first) for g in got.values())
    scale = np.abs(dense[ids.numpy()]) @ np.abs(x.numpy().astype(np.float64))
    assert (np.abs(first.numpy() - want) <= 1e-5 * scale + 1e-30).all()
    assert torch.equal(w.dot_rows(ids[50:60].flip(0), x), first[50:60].flip(0))
