"""Q4_0 fake quantization for QAT (training/qat.py): llama.cpp's grid bit for bit, exports that
`quantize --exact` packs 100 % bit-exactly, straight-through gradients, a toy fit that learns."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings, strategies as st

from gemmaspec.quant.q4_0_exact import pack_exact
from gemmaspec.quant.quantize import quantize_exact
from gemmaspec.training.qat import fake_quant_q4_0, q4_0_grid_report


def _weight(seed, rows=8, cols=128):
    """float32 [rows, cols] of mixed scales: ordinary blocks, tiny ones (fp16-subnormal steps), a zero
    block, a block whose peak has a twin of the other sign (argmax tie)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 2, (rows, 1), generator=g).float())
    w[0, :32] = 0.0
    w[1, 32:64] *= 2.0**-16
    w[2, 64], w[2, 70] = 0.5, -0.5
    w[2, 65:96] = w[2, 65:96].clamp(-0.4, 0.4)
    return w


def _pack(values: np.ndarray, mantissa_bits: int):
    r = pack_exact(values.reshape(-1, values.shape[-1]), mantissa_bits)
    return r, (r.d.astype(np.float32)[:, None] * r.levels.astype(np.float32)).reshape(values.shape)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_float32_mode_is_llama_cpp_q4_0_bit_for_bit(seed):
    """The forward values are what gguf-py's (llama.cpp's) Q4_0 quantizer stores for the weight."""
    w = _weight(seed)
    q = fake_quant_q4_0(w)
    ref = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), T.Q4_0), T.Q4_0)
    assert ref.dtype == np.float32 and np.array_equal(q.numpy(), ref)
    assert q4_0_grid_report(q) == 1.0 and q4_0_grid_report(w) < 0.2


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), export=st.sampled_from(["float32", "bfloat16", "float16"]))
def test_export_packs_every_value_bit_exactly(seed, export):
    """A weight through fake_quant_q4_0, written in its export dtype and read back as the packer's
    input, packs with every block on the grid and every value bit-exact; the values are numbers of
    the export dtype; a second pass changes nothing."""
    dt = getattr(torch, export)
    w = _weight(seed)
    q = fake_quant_q4_0(w, export_dtype=dt)
    exported = q.to(dt).float()
    assert torch.equal(exported, q)  # representable in the export dtype
    assert torch.equal(fake_quant_q4_0(q, export_dtype=dt), q) and q4_0_grid_report(q, dt) == 1.0
    r, back = _pack(exported.numpy(), {"float32": 23, "bfloat16": 7, "float16": 10}[export])
    assert r.on_grid.all() and (r.exact == 32).all() and np.array_equal(back, exported.numpy())


def test_float32_mode_is_not_bf16_representable():
    """What the docstring says: ggml's 11-bit step times level 3/5/6/7 is generally no bf16 number, so
    a bf16 export needs export_dtype=torch.bfloat16."""
    q = fake_quant_q4_0(_weight(0))
    assert not torch.equal(q.bfloat16().float(), q)


def _write(path, name, data, raw):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("export", ["float32", "bfloat16"])
def test_quantize_exact_packs_a_qat_export(export, tmp_path):
    """End to end: a fake-quantized weight saved as an F32 / BF16 GGUF, `quantize --exact` → all blocks
    on the grid, all values bit-exact, Q4_0 bytes that dequantize to the trained values."""
    dt = getattr(torch, export)
    q = fake_quant_q4_0(_weight(3, 64, 256), export_dtype=dt)
    if export == "float32":
        _write(tmp_path / "in.gguf", "blk.0.ffn_up.weight", q.numpy(), None)
    else:
        _write(tmp_path / "in.gguf", "blk.0.ffn_up.weight", q.bfloat16().view(torch.int16).numpy().view(np.uint16),
               T.BF16)
    rep = quantize_exact(tmp_path / "in.gguf", tmp_path / "out.gguf", strict=True, progress=False)
    tot = rep.totals()
    assert tot["tensors_q4_0"] == 1 and tot["blocks_on_grid"] == tot["blocks"] == q.numel() // 32
    assert tot["values_exact"] == tot["values"] == q.numel()
    t = gguf.GGUFReader(tmp_path / "out.gguf").tensors[0]
    assert t.tensor_type == T.Q4_0
    assert np.array_equal(gguf.quants.dequantize(t.data, T.Q4_0).reshape(q.shape), q.numpy())


def test_straight_through_gradient():
    w = _weight(1).requires_grad_()
    g = torch.randn(w.shape)
    (fake_quant_q4_0(w) * g).sum().backward()
    assert torch.equal(w.grad, g)  # identity: the gradient passes unchanged
    # clipped: zero exactly where ggml's min(15, ·) clamped the level (values near the opposite extreme)
    w2 = torch.zeros(1, 32)
    w2[0, 0], w2[0, 1], w2[0, 2] = 1.0, -0.99, 0.3  # peak +1 → d = -1/8: -0.99 → level 7.92 → clamped to 7
    w2.requires_grad_()
    (fake_quant_q4_0(w2, ste="clipped") * torch.ones(1, 32)).sum().backward()
    expect = torch.ones(1, 32)
    expect[0, 1] = 0.0
    assert torch.equal(w2.grad, expect)


def test_sgd_on_a_toy_regression_reduces_the_loss():
    """A linear map trained through fake_quant_q4_0 fits targets from a Q4_0-representable teacher."""
    g = torch.Generator().manual_seed(0)
    teacher = fake_quant_q4_0(torch.randn(16, 64, generator=g) * 0.1)
    x = torch.randn(256, 64, generator=g)
    y = x @ teacher.T
    w = (torch.randn(16, 64, generator=g) * 0.1).requires_grad_()
    opt = torch.optim.SGD([w], lr=1.0)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = ((x @ fake_quant_q4_0(w).T - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.01 * losses[0]
    assert q4_0_grid_report(fake_quant_q4_0(w).detach()) == 1.0


def test_bad_input_is_refused_clearly():
    with pytest.raises(TypeError, match="float32"):
        fake_quant_q4_0(torch.zeros(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 32"):
        fake_quant_q4_0(torch.zeros(2, 40))
    with pytest.raises(ValueError, match="export_dtype"):
        fake_quant_q4_0(torch.zeros(2, 32), export_dtype=torch.int8)
    with pytest.raises(ValueError, match="ste"):
        fake_quant_q4_0(torch.zeros(2, 32), ste="sign")
