"""Block-quantized weights on a GPU (``gemmaspec.kernels.cuda``), checked on the CPU where possible.

- The device layout, built with torch ops from the stored GGML bytes (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K) or
  from the int8 form, dequantizes bit for bit like ``to_int8_blocks`` (scale * q + offset in float32)
  and ``gguf.quants.dequantize``; its size is the arithmetic's.
- Products (tile path; the Triton kernel under ``TRITON_INTERPRET=1`` or on a GPU) stay within the
  float32 rounding bound of a float64 reference: |y - y64| <= K * 2^-24 * (|x| @ |W|.T) (weights exact,
  one rounding per product and per addition, in any summation order).
- A tiny Gemma 4 whose weights are in the device layout (on the CPU) gives the CPU model's logits.
- Memory arithmetic: tensor shapes equal transformers' modules built on the meta device (real E2B
  dimensions), the KV-cache bytes equal what the model's cache allocates, and an all-Q4_0 E2B target
  with its exact-Q4_0 assistant fits 4 GB at 4,096 context where float32 weights do not.
- CUDA checks skip without a GPU (``benchmarks/cuda_check.py`` runs them on one).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings, strategies as st

from gemmaspec.kernels import BlockWeight, Q4_0Weight, QuantizedWeight
from gemmaspec.kernels import cuda
from gemmaspec.kernels.cuda import DeviceQuantWeight, kernel_matmul, to_device
from gemmaspec.kernels.ggml_blocks import to_int8_blocks
from gemmaspec.kernels.memory import kv_cache_bytes, layout_bytes
from gemmaspec.models.config import Gemma4AssistantConfig, Gemma4Config
from gemmaspec.models.footprint import device_memory, kv_layers, tensor_shapes
from gemmaspec.models.gemma4 import Gemma4Model
from test_ggml_blocks import _random_blocks

TYPES = (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K)
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU here (benchmarks/cuda_check.py runs these on one)")


def _stored(qtype, n, blocks, seed):
    k = gguf.GGML_QUANT_SIZES[qtype][0] * blocks
    return _random_blocks(np.random.default_rng(seed), qtype, n, k), k


def _reference(raw, qtype, n, k) -> torch.Tensor:
    """scale * q + offset in float32, from the int8 conversion (the CPU's exact form)."""
    q, s, o, g = to_int8_blocks(raw, qtype, n, k)
    w = torch.from_numpy(q).float().view(n, k // g, g) * torch.from_numpy(s)[..., None]
    if o is not None:
        w = w + torch.from_numpy(o)[..., None]
    return w.view(n, k)


def _within_bound(y, x, w):
    """The float32 rounding bound of x @ W.T with exact weights (module docstring)."""
    x64, w64 = x.double().cpu(), w.double().cpu()
    ref = x64 @ w64.T
    bound = x.shape[-1] * 2.0 ** -24 * (x64.abs() @ w64.abs().T) * 1.01 + 1e-300
    err = (y.double().cpu() - ref).abs()
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3g}"


# --- layout ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6), blocks=st.integers(1, 3))
def test_layout_dequantizes_bit_for_bit(qtype, seed, n, blocks):
    raw, k = _stored(qtype, n, blocks, seed)
    w = DeviceQuantWeight.from_stored(torch.from_numpy(raw), qtype, k)
    got = w.dequantize()
    assert torch.equal(got, _reference(raw, qtype, n, k))
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)))
    assert w.shape == (n, k) and w.qtype == qtype.name
    assert w.nbytes == layout_bytes(qtype, n, k)
    if qtype != T.Q4_K:  # stored size exactly; Q4_K's 6-bit sub-scales take a byte each here
        assert w.nbytes == raw.size
    else:
        assert raw.size < w.nbytes <= raw.size * 1.03


def test_conversion_in_chunks_is_the_same(monkeypatch):
    raw, k = _stored(T.Q6_K, 9, 2, seed=5)
    whole = DeviceQuantWeight.from_stored(torch.from_numpy(raw), T.Q6_K, k).dequantize()
    monkeypatch.setattr(cuda, "CONVERT_BYTES", 2 * raw.shape[1])  # two rows at a time
    assert torch.equal(DeviceQuantWeight.from_stored(torch.from_numpy(raw), "q6_k", k).dequantize(), whole)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K],
                         ids=lambda t: t.name)
def test_int8_form_bit_for_bit(qtype):
    raw, k = _stored(qtype, 7, 2, seed=11)
    q, s, o, g = to_int8_blocks(raw, qtype, 7, k)
    qw = QuantizedWeight(torch.from_numpy(q), torch.from_numpy(s), None if o is None else torch.from_numpy(o), g)
    w = DeviceQuantWeight.from_int8(qw.q, qw.scale, qw.offset, qw.group)
    assert torch.equal(w.dequantize(), qw.dequantize())
    span = int(qw.q.max()) - int(qw.q.min())
    planes = (0, 1, 2, 4)  # code bits beyond 4: the fewest that hold the levels' range
    i = planes.index(w.hb)
    assert span < 2 ** (4 + w.hb) and (i == 0 or span >= 2 ** (4 + planes[i - 1]))
    if qtype in (T.Q4_0, T.Q4_1, T.Q4_K):
        assert w.hb == 0 and w.nbytes <= qw.nbytes * 0.67  # 4-bit codes: half a byte, not one


def test_rows_are_the_dequantized_rows():
    raw, k = _stored(T.Q4_K, 12, 1, seed=3)
    w = DeviceQuantWeight.from_stored(torch.from_numpy(raw), T.Q4_K, k)
    ids = torch.tensor([[3, 0, 11], [3, 7, 5]])
    assert torch.equal(w.rows(ids), w.dequantize()[ids])


def test_to_device_takes_every_weight_kind():
    raw, k = _stored(T.Q4_0, 5, 2, seed=1)
    q40 = Q4_0Weight(torch.from_numpy(raw), k)
    w = to_device(q40, "cpu")
    assert isinstance(w, BlockWeight) and w.qtype == "Q4_0" and w.nbytes == q40.nbytes
    assert torch.equal(w.dequantize(), q40.dequantize())
    stored = SimpleNamespace(raw=torch.from_numpy(raw), qtype=T.Q4_0, k=k)  # the StoredWeight shape
    assert torch.equal(to_device(stored, "cpu").dequantize(), q40.dequantize())
    qw = q40.to_int8()
    assert torch.equal(to_device(qw, "cpu").dequantize(), qw.dequantize())
    assert to_device(w, "cpu").nbytes == w.nbytes
    with pytest.raises(TypeError, match="not a block-quantized weight"):
        to_device(torch.zeros(2, 32), "cpu")


def test_to_another_device_keeps_blocks():
    """``.to(device)`` off the CPU gives the device layout, not a float32 matrix (``meta``: shapes only)."""
    raw, k = _stored(T.Q4_0, 64, 4, seed=2)
    q40 = Q4_0Weight(torch.from_numpy(raw), k)
    for w in (q40, q40.to_int8()):
        moved = w.to("meta")
        assert isinstance(moved, DeviceQuantWeight) and moved.lo.device.type == "meta"
        assert moved.nbytes <= 1.12 * q40.nbytes < 64 * k * 4 / 6


def test_bad_input_is_refused():
    raw, k = _stored(T.Q8_0, 2, 1, seed=0)
    with pytest.raises(ValueError, match=r"needs uint8 \[N, 34\]"):
        DeviceQuantWeight.from_stored(torch.from_numpy(raw)[:, :-1], T.Q8_0, k)
    with pytest.raises(ValueError, match="no device layout"):
        DeviceQuantWeight.from_stored(torch.from_numpy(raw), T.IQ4_XS, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        DeviceQuantWeight.from_stored(torch.from_numpy(raw), T.Q4_K, 32)
    w = DeviceQuantWeight.from_stored(torch.from_numpy(raw), T.Q8_0, k)
    with pytest.raises(ValueError, match="input of 31 features"):
        w(torch.zeros(1, 31))
    with pytest.raises(ValueError, match="bad int8 weight"):
        DeviceQuantWeight.from_int8(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 2), None, 32)


def test_cat_stacks_rows():
    parts = [DeviceQuantWeight.from_stored(torch.from_numpy(_stored(T.Q6_K, n, 1, seed=n)[0]), T.Q6_K, 256)
             for n in (3, 5)]
    both = DeviceQuantWeight.cat(parts)
    assert torch.equal(both.dequantize(), torch.cat([p.dequantize() for p in parts]))
    other = DeviceQuantWeight.from_stored(torch.from_numpy(_stored(T.Q4_K, 2, 1, seed=0)[0]), T.Q4_K, 256)
    assert DeviceQuantWeight.cat([parts[0], other]) is None


# --- products -------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 5, 17, 40])
def test_tile_product_within_float32_bound(qtype, m, monkeypatch):
    monkeypatch.setenv("GEMMASPEC_CUDA_KERNEL", "tiles")
    raw, k = _stored(qtype, 37, 2, seed=m)
    w = DeviceQuantWeight.from_stored(torch.from_numpy(raw), qtype, k)
    monkeypatch.setattr(cuda, "TILE_BYTES", 4 * k * 8)  # tiles of 8 rows: 5 tiles, the last one short
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = w(x.view(1, m, k))
    assert y.shape == (1, m, 37)
    _within_bound(y[0], x, _reference(raw, qtype, 37, k))


def _kernel_device():
    if HAS_CUDA:
        return "cuda"
    if INTERPRET and cuda.triton_kernel() is not None:
        return "cpu"
    pytest.skip("no GPU and not under TRITON_INTERPRET=1 (test_kernel_in_triton_interpreter runs these)")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,split", [(1, 67, None), (3, 130, 2), (8, 33, None), (16, 70, 3)])
def test_kernel_within_float32_bound(qtype, m, n, split):
    dev = _kernel_device()
    raw, k = _stored(qtype, n, 3 if qtype.name.endswith("_0") else 2, seed=n)
    w = DeviceQuantWeight.from_stored(torch.from_numpy(raw), qtype, k, device=dev)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dev)
    y = kernel_matmul(w, x, split=split)
    assert y.shape == (m, n) and y.device.type == dev
    _within_bound(y, x, _reference(raw, qtype, n, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_rebuilds_every_weight_exactly(qtype):
    """One-hot rows pick single columns of W, so every product is exact: the kernel's in-register
    unpacking must give W's values bit for bit (a product test alone cannot see a small weight error)."""
    dev = _kernel_device()
    raw, k = _stored(qtype, 45, 2, seed=4)
    w = DeviceQuantWeight.from_stored(torch.from_numpy(raw), qtype, k, device=dev)
    ref = _reference(raw, qtype, 45, k)
    for cols in (torch.arange(0, k, k // 16)[:16] + torch.arange(16) % 7, torch.randperm(k)[:16]):
        x = torch.zeros(16, k)
        x[torch.arange(16), cols] = 1.0
        for split in (None, 2):
            assert torch.equal(kernel_matmul(w, x.to(dev), split=split).cpu(), ref[:, cols].T)


def test_kernel_int8_form_with_offsets():
    dev = _kernel_device()
    raw, k = _stored(T.Q5_K, 40, 2, seed=9)
    q, s, o, g = to_int8_blocks(raw, T.Q5_K, 40, k)
    w = DeviceQuantWeight.from_int8(torch.from_numpy(q), torch.from_numpy(s), torch.from_numpy(o), g, device=dev)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(0)).to(dev)
    _within_bound(kernel_matmul(w, x), x, _reference(raw, T.Q5_K, 40, k))


@pytest.mark.parametrize("variant", ["Q6_K rows 1", "Q4_K rows 16", "int8 fp32 scales rows 4"])
def test_kernel_compiles_for_cuda(variant):
    """The kernel compiles to a cubin for sm_75 (Turing, the small GPUs' generation) with Triton's own
    ptxas, no GPU needed: catches what the interpreter lets through (types, layouts, constexprs)."""
    triton = pytest.importorskip("triton", reason="Triton not installed (it comes with PyTorch's CUDA builds)")
    if INTERPRET:
        pytest.skip("the kernel is built for the interpreter in this process")
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = cuda.triton_kernel()
    params = list(inspect.signature(kern.fn).parameters)
    name, rows = variant.split()[0], int(variant.split()[-1])
    fmt = cuda.FORMATS.get(name, cuda._Format(32, 0, 4, -128, 32, 32, False, True))
    scale_t = "*fp32" if name == "int8" else "*fp16"
    sig = {"x_ptr": "*fp32", "lo_ptr": "*u8", "hi_ptr": "*u8", "d_ptr": scale_t, "sc_ptr": "*i8", "dm_ptr": scale_t,
           "m_ptr": "*i8", "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "K_PER": "i32"}
    bm, bn, bk = cuda._blocks(rows)
    const = dict(BIAS=fmt.bias, HB=fmt.hb, G=fmt.group, S=fmt.superblock, HAS_SC=fmt.sub_scales, HAS_DM=fmt.offsets,
                 HAS_M=fmt.offsets and name != "int8", BM=bm, BN=bn, BK=bk)
    sig.update({c: "constexpr" for c in const})
    src = ASTSource(fn=kern, signature=sig, constexprs={(params.index(c),): v for c, v in const.items()})
    out = triton.compile(src, target=GPUTarget("cuda", 75, 32))
    assert len(out.asm["cubin"]) > 1000 and ".target sm_75" in out.asm["ptx"]


def test_kernel_in_triton_interpreter():
    """Without a GPU, the kernel tests above run in Triton's CPU interpreter (a fresh process: the
    interpreter is chosen when the kernel is built)."""
    if HAS_CUDA or INTERPRET:
        pytest.skip("the kernel tests run directly here")
    pytest.importorskip("triton", reason="Triton not installed (it comes with PyTorch's CUDA builds)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                          "-k", "(kernel or device_model) and not interpreter and not compiles"], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).parent.parent, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout.splitlines()[-1], res.stdout[-1000:]


# --- a whole model --------------------------------------------------------------------------------

TINY = dict(vocab_size=96, hidden_size=64, num_layers=6, intermediate_size=96, num_heads=4, num_kv_heads=2,
            head_dim=32, global_head_dim=64, sliding_window=8, layer_types=("sliding", "sliding", "full") * 2,
            hidden_size_per_layer_input=32, vocab_size_per_layer_input=96, num_kv_shared_layers=2,
            use_double_wide_mlp=True)


def _tiny_weights(cfg, seed=0):
    """Random weights for every tensor of ``cfg`` as the loader makes them: matrices as Q4_0Weight
    (rows of a multiple of 32) or int8-form QuantizedWeight from Q8_0, Q4_K, Q6_K blocks (rows of a
    multiple of 256 alternate Q4_K and Q6_K), norms around 1; and ``{name: (raw bytes, qtype)}``."""
    rng = np.random.default_rng(seed)
    weights, stored, turn = {}, {}, {32: 0, 256: 0}
    for name, shape in sorted(tensor_shapes(cfg).items()):
        if len(shape) != 2 or shape[1] % 32:
            weights[name] = torch.from_numpy(1.0 + 0.1 * rng.standard_normal(shape).astype(np.float32))
            continue
        wide = shape[1] % 256 == 0
        qtype = ((T.Q4_K, T.Q6_K) if wide else (T.Q4_0, T.Q8_0))[turn[256 if wide else 32] % 2]
        turn[256 if wide else 32] += 1
        raw = _random_blocks(rng, qtype, *shape)
        b = raw.reshape(shape[0], -1, gguf.GGML_QUANT_SIZES[qtype][1])
        unit = {T.Q4_0: 8, T.Q8_0: 127, T.Q4_K: 15 * 63, T.Q6_K: 32 * 127}[qtype]  # weights ~ 1/sqrt(K)
        d = (rng.uniform(0.5, 1.0, b.shape[:2]) / (unit * shape[1] ** 0.5)).astype(np.float16)
        at = 208 if qtype == T.Q6_K else 0
        b[..., at:at + 2] = d.view(np.uint8).reshape(*b.shape[:2], 2)
        if qtype == T.Q4_K:
            b[..., 2:4] = (d * 4).view(np.uint8).reshape(*b.shape[:2], 2)
        stored[name] = (raw, qtype)
        if qtype == T.Q4_0:
            weights[name] = Q4_0Weight(torch.from_numpy(raw.copy()), shape[1])
        else:
            q, s, o, g = to_int8_blocks(raw, qtype, *shape)
            weights[name] = QuantizedWeight(torch.from_numpy(q), torch.from_numpy(s),
                                            None if o is None else torch.from_numpy(o), g)
    assert {t for _, t in stored.values()} == {T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K}
    return weights, stored


def test_device_model_matches_cpu_model():
    """A tiny Gemma 4 (PLE, KV sharing, double-wide MLP; Q4_0, Q8_0, Q4_K, Q6_K matrices) with its
    weights in the device layout (kept on the CPU) gives the CPU kernels' logits: prefill of 20 tokens
    (tile path), then decode steps (the kernel under TRITON_INTERPRET=1, else tiles)."""
    cfg = Gemma4Config(**TINY)
    weights, _ = _tiny_weights(cfg)
    ref = Gemma4Model(cfg, dict(weights))
    dev = "cuda" if HAS_CUDA else "cpu"
    moved = {k: to_device(v, dev) if isinstance(v, BlockWeight) else v.to(dev) for k, v in weights.items()}
    assert all(isinstance(moved[k], DeviceQuantWeight) for k, v in weights.items() if isinstance(v, BlockWeight))
    model = Gemma4Model(cfg, moved, dev)
    c_ref, c_dev = ref.new_cache(64), model.new_cache(64)
    prompt = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(1))
    steps = [prompt] + [torch.tensor([t]) for t in (5, 17, 80)] + [torch.tensor([3, 9, 4])]
    for tokens in steps:
        a = ref.forward(tokens, c_ref, all_logits=True)
        b = model.forward(tokens.to(dev), c_dev, all_logits=True)
        scale = float(a.logits.abs().max())
        assert scale > 1e-3
        assert float((b.logits.cpu() - a.logits).abs().max()) <= 2e-5 * scale
        assert float((b.hidden.cpu() - a.hidden).abs().max()) <= 2e-5 * float(a.hidden.abs().max())


# --- memory arithmetic ----------------------------------------------------------------------------

# Gemma 4 E2B's text model. Source: google/gemma-4-E2B-it config.json (text_config), as quoted in
# public repositories' config-parsing tests: 35 layers of width 1,536, 8 query heads, 1 KV head,
# head dims 256 (sliding) / 512 (full), 4 sliding : 1 full, window 512, MLP 6,144 (doubled on the 20
# KV-shared layers: use_double_wide_mlp), per-layer inputs of 256 over a 262,144 vocabulary, tied
# head; google/gemma.cpp PR 919 gives the same (35 layers, model_dim 1536, FFN 6144/12288).
E2B_HF = dict(vocab_size=262144, hidden_size=1536, num_hidden_layers=35, intermediate_size=6144,
              num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
              layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, hidden_size_per_layer_input=256,
              vocab_size_per_layer_input=262144, num_kv_shared_layers=20, use_double_wide_mlp=True,
              final_logit_softcapping=30.0, max_position_embeddings=131072)
# Its assistant: 4 layers of width 256 (the E2B assistant's shapes in benchmarks/mtp_drafter.py).
E2B_ASSISTANT_HF = dict(vocab_size=262144, hidden_size=256, num_hidden_layers=4, intermediate_size=2048,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, global_head_dim=512,
                        sliding_window=512, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=4,
                        max_position_embeddings=131072)
GB4 = 4 * 10**9


def _hf_shapes(model, n_layers):
    from gemmaspec.models.gemma4 import hf_to_gguf_name

    named = list(model.named_parameters()) + list(model.named_buffers())
    return {g: tuple(t.shape) for name, t in named if (g := hf_to_gguf_name(name, n_layers))}


def _e2b():
    return Gemma4Config.from_hf(E2B_HF)


def _e2b_assistant():
    return Gemma4AssistantConfig.from_hf({"text_config": E2B_ASSISTANT_HF, "backbone_hidden_size": 1536,
                                          "use_ordered_embeddings": True, "num_centroids": 2048,
                                          "centroid_intermediate_top_k": 32})


def test_shapes_are_transformers_shapes():
    from transformers import Gemma4AssistantConfig as HFAssistantConfig, Gemma4AssistantForCausalLM
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    with torch.device("meta"):
        target = Gemma4ForCausalLM(Gemma4TextConfig(**E2B_HF))
        assistant = Gemma4AssistantForCausalLM(HFAssistantConfig(
            text_config=Gemma4TextConfig(**E2B_ASSISTANT_HF), backbone_hidden_size=1536,
            use_ordered_embeddings=True, num_centroids=2048, centroid_intermediate_top_k=32))
    assert tensor_shapes(_e2b()) == _hf_shapes(target, 35)
    ours = tensor_shapes(_e2b_assistant())
    theirs = _hf_shapes(assistant, 4)
    assert ours == theirs, (set(ours) ^ set(theirs), [n for n in ours if n in theirs and ours[n] != theirs[n]])


@pytest.mark.parametrize("context", [20, 64, 300])
def test_kv_bytes_are_what_the_cache_allocates(context):
    cfg = Gemma4Config(**TINY)
    model = Gemma4Model(cfg, {n: torch.empty(s) for n, s in tensor_shapes(cfg).items()})
    cache = model.new_cache(context)
    allocated = sum(2 * layer.k.numel() * layer.k.element_size() for layer in cache.layers if layer is not None)
    assert kv_cache_bytes(kv_layers(cfg), context) == allocated
    assert device_memory(cfg, context).kv_cache == allocated
    assert sum(layer is not None for layer in cache.layers) == len(kv_layers(cfg)) == 4


def test_weight_bytes_are_the_layouts_bytes():
    cfg = Gemma4Config(**TINY)
    weights, stored = _tiny_weights(cfg, seed=4)
    actual = sum(DeviceQuantWeight.from_stored(torch.from_numpy(raw), qtype, raw.shape[1] // (
        gguf.GGML_QUANT_SIZES[qtype][1]) * gguf.GGML_QUANT_SIZES[qtype][0]).nbytes for raw, qtype in stored.values())
    actual += sum(4 * w.numel() for name, w in weights.items() if name not in stored)
    types = {name: stored[name][1].name if name in stored else "F32" for name in weights}
    assert device_memory(cfg, 64, types=types).weights == actual


def test_e2b_q4_0_with_assistant_fits_4gb_at_4096():
    target, assistant = device_memory(_e2b(), 4096, "Q4_0"), device_memory(_e2b_assistant(), 4096, "Q4_0")
    both = target + assistant
    assert both.total < GB4, json.dumps({k: getattr(both, k) for k in ("weights", "kv_cache", "work", "runtime")})
    # what is counted: 4.6 G weights at 4.5 bits, a float32 cache for 12 + 3 unshared layers
    assert 2.4e9 < target.weights < 2.7e9 and 40e6 < assistant.weights < 50e6
    assert 55 << 20 < target.kv_cache < 65 << 20 and assistant.kv_cache == 0
    dense = device_memory(_e2b(), 4096, dense=True) + device_memory(_e2b_assistant(), 4096, dense=True)
    assert dense.total > 4 * GB4  # float32 weights: about 18 GiB


# --- on a GPU ---------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cuda_layout_bit_for_bit(qtype):
    raw, k = _stored(qtype, 33, 2, seed=7)
    cpu = DeviceQuantWeight.from_stored(torch.from_numpy(raw), qtype, k)
    gpu = DeviceQuantWeight.from_stored(torch.from_numpy(raw), qtype, k, device="cuda")
    assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())
    ids = torch.tensor([0, 32, 5])
    assert torch.equal(gpu.rows(ids).cpu(), cpu.dequantize()[ids])


@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 16, 40])
def test_cuda_products_within_bound(m):
    raw, k = _stored(T.Q4_0, 1000, 48, seed=m)
    w = Q4_0Weight(torch.from_numpy(raw), k).to("cuda")
    assert isinstance(w, DeviceQuantWeight) and w.nbytes == raw.size
    x = torch.randn(m, k, device="cuda")
    _within_bound(w(x), x, _reference(raw, T.Q4_0, 1000, k))
