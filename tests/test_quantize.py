"""`gemmaspec quantize --exact` and `gemmaspec verify` (check_against_source): files, reports, round trips, bad input."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings, strategies as st

from conftest import run_cli
from gemmaspec.errors import InputError, ModelFileError
from gemmaspec.quant.q4_0_exact import pack_exact
from gemmaspec.quant.check import check_against_source
from gemmaspec.quant.quantize import OffGridError, quantize_exact


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bf16 (round to nearest even) as uint16 bits, the way GGUF stores BF16."""
    return (torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).bfloat16().view(torch.int16).numpy()
            .view(np.uint16))


def _widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _qat_bf16(rng, rows, cols, exp=(-8, -3), levels=None):
    """A synthetic QAT weight: bf16(step × level) per 32-value block along a row; returns (bf16 bits, levels)."""
    lv = rng.integers(-8, 8, (rows, cols // 32, 32)) if levels is None else levels
    steps = _widen(_bf16_bits(2.0 ** rng.uniform(*exp, (rows, cols // 32, 1))))
    return _bf16_bits((steps * lv).reshape(rows, cols)), lv.reshape(rows, cols)


def _write_gguf(path, tensors: dict, arch="llama", alignment=None):
    """tensors: name → (numpy data, raw GGML type or None)."""
    w = gguf.GGUFWriter(str(path), arch)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_string("general.name", "synthetic")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tensor(path, name):
    r = gguf.GGUFReader(path)
    return next(t for t in r.tensors if t.name == name), r


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), mbits=st.sampled_from([7, 10, 23]),
       kind=st.sampled_from(["qat_bf16_step", "qat_f32_step", "plain"]))
def test_c_packer_equals_the_numpy_reference(seed, mbits, kind):
    """The C fast path makes exactly the numpy reference's choices, block by block, bit for bit: QAT
    weights whose steps bf16 holds, QAT weights whose steps are float32 numbers (where the search for
    the most values bit-exact after rounding runs), ordinary weights."""
    rng = np.random.default_rng(seed)
    if kind == "qat_bf16_step":
        w = _widen(_qat_bf16(rng, 16, 64, (-26, 2))[0])
    elif kind == "qat_f32_step":
        steps = (2.0 ** rng.uniform(-26, 2, (16, 2, 1))).astype(np.float32)
        w = _widen(_bf16_bits((steps * rng.integers(-8, 8, (16, 2, 32))).reshape(16, 64)))
    else:
        w = rng.standard_normal((16, 64)).astype(np.float32) * 2.0 ** rng.uniform(-20, 5)
    if mbits == 10:
        w = w.astype(np.float16).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    a, b = pack_exact(w, mbits, backend="numpy"), pack_exact(w, mbits, backend="c")
    assert np.array_equal(a.d.view(np.uint16), b.d.view(np.uint16))
    assert np.array_equal(a.levels, b.levels) and np.array_equal(a.exact, b.exact)
    assert np.array_equal(a.exact_src, b.exact_src)
    assert np.array_equal(a.max_err_ulp, b.max_err_ulp) and np.array_equal(a.on_grid, b.on_grid)
    assert np.array_equal(a.q4_0_bytes(), b.q4_0_bytes())
    assert np.allclose(a.sq_err, b.sq_err, rtol=1e-12, atol=0) and np.allclose(a.sq_src, b.sq_src, rtol=1e-12)


def test_q4_0_round_trip_is_byte_identical(tmp_path):
    """A random Q4_0 GGUF → dequantized F32 GGUF → quantize --exact → the original tensor bytes."""
    rng = np.random.default_rng(0)
    src = rng.standard_normal((48, 256)).astype(np.float32)
    q4 = gguf.quants.quantize(src, T.Q4_0)
    _write_gguf(tmp_path / "q4.gguf", {"blk.0.ffn_up.weight": (q4, T.Q4_0)})
    deq = gguf.quants.dequantize(q4, T.Q4_0).astype(np.float32)
    _write_gguf(tmp_path / "f32.gguf", {"blk.0.ffn_up.weight": (deq, None)})
    rep = quantize_exact(tmp_path / "f32.gguf", tmp_path / "out.gguf")
    got, reader = _tensor(tmp_path / "out.gguf", "blk.0.ffn_up.weight")
    assert got.tensor_type == T.Q4_0
    assert np.array_equal(np.asarray(got.data).reshape(q4.shape), q4)
    t = rep.totals()
    assert t["blocks_on_grid"] == t["blocks"] == 48 * 8 and t["values_exact"] == deq.size
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_0
    assert reader.fields["general.name"].contents() == "synthetic"  # metadata kept
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert check_against_source(tmp_path / "out.gguf", tmp_path / "f32.gguf").ok


@pytest.mark.parametrize("name_len", [1, 9, 17, 25])
def test_a_source_alignment_is_kept(tmp_path, name_len):
    """A source written with general.alignment 64 gives an output that records 64 and reads back exactly
    (whatever the header length: the data section's start depends on it)."""
    rng = np.random.default_rng(1)
    q4 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), T.Q4_0)
    deq = gguf.quants.dequantize(q4, T.Q4_0).astype(np.float32)
    _write_gguf(tmp_path / "s.gguf", {"blk.0.ffn_up.weight": (deq, None), "x" * name_len: (np.ones(3, np.float32), None)},
                alignment=64)
    quantize_exact(tmp_path / "s.gguf", tmp_path / "o.gguf")
    got, reader = _tensor(tmp_path / "o.gguf", "blk.0.ffn_up.weight")
    assert reader.alignment == 64 and reader.fields["general.alignment"].contents() == 64
    assert np.array_equal(np.asarray(got.data).reshape(q4.shape), q4)
    assert check_against_source(tmp_path / "o.gguf", tmp_path / "s.gguf").ok


@pytest.fixture
def synthetic(tmp_path):
    """A BF16 GGUF: two QAT weights (one with every trap), a non-QAT weight, a transposed QAT weight,
    a norm, a row length that is not a multiple of 32, and an already-quantized tensor."""
    rng = np.random.default_rng(7)
    qat, lv = _qat_bf16(rng, 32, 128)
    traps = np.stack([
        rng.integers(-5, 6, 32),                         # peak below level 8: amax/8 is wrong here
        np.zeros(32, int),                               # all zero
        np.full(32, 3),                                  # a single value
        -rng.integers(1, 9, 32),                         # only negative levels
        rng.integers(1, 8, 32),                          # only positive levels
        rng.integers(-7, 8, 32),                         # -8 absent
        np.r_[-8, rng.integers(-8, 8, 31)],              # -8 present
        rng.integers(-8, 8, 32),
    ]).reshape(2, 4, 32)
    trap_bits, trap_lv = _qat_bf16(rng, 2, 128, levels=traps)
    plain = _bf16_bits(rng.standard_normal((16, 64)) * 0.02)
    transposed = np.ascontiguousarray(_qat_bf16(rng, 64, 64)[0].T)
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), T.Q8_0)
    path = _write_gguf(tmp_path / "src.gguf", {
        "blk.0.attn_q.weight": (qat, T.BF16),
        "blk.0.attn_k.weight": (trap_bits, T.BF16),
        "blk.0.ffn_up.weight": (plain, T.BF16),
        "blk.0.ffn_down.weight": (transposed, T.BF16),
        "blk.0.attn_norm.weight": (_bf16_bits(1 + rng.standard_normal(64) * 0.1), T.BF16),
        "blk.0.odd.weight": (_bf16_bits(rng.standard_normal((4, 40))), T.BF16),
        "blk.0.ffn_gate.weight": (q8, T.Q8_0),
    })
    return path, {"qat": (qat, lv), "traps": (trap_bits, trap_lv)}


def test_synthetic_checkpoint_report_and_types(synthetic, tmp_path):
    path, truth = synthetic
    rep = quantize_exact(path, tmp_path / "out.gguf", fallback="q8_0")
    by = {t.name: t for t in rep.tensors}
    assert by["blk.0.attn_q.weight"].type == by["blk.0.attn_k.weight"].type == "Q4_0"
    assert by["blk.0.ffn_up.weight"].type == "Q8_0"  # ordinary weights fit no grid
    assert by["blk.0.ffn_down.weight"].type == "Q8_0"  # grid along the output dimension is not a Q4_0 grid
    assert by["blk.0.attn_norm.weight"].type == "F32" and by["blk.0.odd.weight"].type == "F32"
    assert by["blk.0.ffn_gate.weight"].type == "Q8_0" and by["blk.0.ffn_gate.weight"].note == "copied"
    q = by["blk.0.attn_q.weight"]
    assert (q.blocks, q.blocks_on_grid, q.values) == (128, 128, 4096)
    assert q.exact.max_err_ulp <= 1.0
    # values whose level is 0 or ±2^n are bf16 numbers themselves: bit-exact at least there
    assert q.values_exact >= np.isin(np.abs(truth["qat"][1]), [0, 1, 2, 4, 8]).sum()
    assert q.exact.rel_err < q.q8_0.rel_err < q.q4_0_amax.rel_err
    k = by["blk.0.attn_k.weight"]
    assert k.blocks_on_grid == k.blocks == 8 and k.exact.max_err_ulp <= 1.0
    up = by["blk.0.ffn_up.weight"]
    assert up.blocks_on_grid < up.blocks and "off grid" in up.note
    # a fallback tensor reports the error of what was stored (Q8_0 here: the same as the Q8_0 figure),
    # not of the rejected grid fit
    assert up.stored.rel_err == pytest.approx(up.q8_0.rel_err) and up.stored.rel_err < up.exact.rel_err
    assert "fallback: not on a grid" in rep.table()
    # totals compare like with like: Q8_0 and amax/8 over the exact-Q4_0 tensors only
    t = rep.totals()
    pair = (by["blk.0.attn_q.weight"], by["blk.0.attn_k.weight"])
    want = np.sqrt(sum(x.q8_0.sq_err for x in pair) / sum(x.q8_0.sq_src for x in pair))
    assert t["q8_0"]["rel_err"] == pytest.approx(want)
    tot = rep.totals()
    assert tot["tensors_q4_0"] == 2 and tot["tensors_fallback"] == 2
    assert tot["bit_exact_fraction_q4_0"] == 1.0  # bf16 steps: every value comes back after bf16 rounding
    assert tot["bytes"]["q8_0"] - tot["bytes"]["exact_q4_0"] == 136 * 16
    # the levels written are the trained ones
    got, _ = _tensor(tmp_path / "out.gguf", "blk.0.attn_k.weight")
    raw = np.asarray(got.data).reshape(-1, 18)
    q_lo, q_hi = raw[:, 2:] & 0x0F, raw[:, 2:] >> 4
    levels = np.concatenate([q_lo, q_hi], axis=1).astype(int) - 8
    d = raw[:, :2].copy().view(np.float16).astype(np.float32).ravel()
    want = truth["traps"][1].reshape(-1, 32)
    nz = np.abs(want).max(axis=1) > 0
    same = (levels == want).all(axis=1) | (levels == -want).all(axis=1)  # the sign of d is free
    same[2] = True  # a block of one repeated value has no single true level (3·s = 6·s/2): verify bounds it
    assert same[nz].all() and (d[~nz] == 0).all()
    res = check_against_source(tmp_path / "out.gguf", path)
    assert res.ok, res.failures
    assert 0 < res.worst_ulp_q4_0 <= 1.0


def test_cli_quantize_report_verify_and_strict(synthetic, tmp_path):
    path, _ = synthetic
    out, report = tmp_path / "o.gguf", tmp_path / "r.json"
    res = run_cli("quantize", "--exact", str(path), str(out), "--report", str(report), "--fallback", "f16")
    assert res.returncode == 0, res.stderr
    assert "blocks on the grid" in res.stderr and "closer than Q8_0" in res.stderr
    data = json.loads(report.read_text())
    assert data["total"]["tensors_q4_0"] == 2 and data["fallback"] == "f16"
    assert {t["name"]: t["type"] for t in data["tensors"]}["blk.0.ffn_up.weight"] == "F16"
    ok = run_cli("verify", str(out), "--against", str(path))
    assert ok.returncode == 0 and ok.stderr.startswith("OK"), ok.stderr
    again = run_cli("quantize", "--exact", str(path), str(out))
    assert again.returncode == 1 and "--force" in again.stderr
    strict = run_cli("quantize", "--exact", "--strict", str(path), str(tmp_path / "s.gguf"))
    assert strict.returncode == 1 and "blk.0.ffn_up.weight" in strict.stderr and "block 0 of row 0" in strict.stderr
    assert not list(tmp_path.glob("*s.gguf*"))  # nothing left behind


def test_report_per_tensor_bit_exact_fraction_and_ratio_to_q8_0(tmp_path):
    """A QAT weight whose steps are float32 numbers: the report's per-tensor bit-exact fraction is the
    share of values the written file gives back after bf16 rounding, and "vs Q8_0" is llama.cpp's
    Q8_0 relative error over the file's (both recomputed here from the file, with gguf.quants); the
    CLI prints them in the tensor's row."""
    rng = np.random.default_rng(21)
    steps = (2.0 ** rng.uniform(-9, -4, (64, 8, 1))).astype(np.float32)
    src = _bf16_bits((steps * rng.integers(-8, 8, (64, 8, 32))).reshape(64, 256))
    path = _write_gguf(tmp_path / "f32step.gguf", {"blk.0.attn_q.weight": (src, T.BF16)})
    out, report = tmp_path / "o.gguf", tmp_path / "r.json"
    res = run_cli("quantize", "--exact", str(path), str(out), "--report", str(report), "--compare-all")
    assert res.returncode == 0, res.stderr
    w = _widen(src).astype(np.float64)
    got, _ = _tensor(out, "blk.0.attn_q.weight")
    deq = gguf.quants.dequantize(np.asarray(got.data), T.Q4_0).reshape(w.shape).astype(np.float32)
    bit_exact = (_widen(_bf16_bits(deq)) == w).mean()
    q8 = gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), T.Q8_0), T.Q8_0)
    ratio = np.linalg.norm(q8 - w) / np.linalg.norm(deq - w)
    data = json.loads(report.read_text())
    t = data["tensors"][0]
    assert t["type"] == "Q4_0" and t["bit_exact_fraction"] == pytest.approx(bit_exact, abs=1e-12)
    assert data["total"]["bit_exact_fraction_q4_0"] == pytest.approx(bit_exact, abs=1e-12)
    assert f"give back {bit_exact:.1%} of their values" in res.stderr
    assert t["closer_than_q8_0"] == pytest.approx(ratio, rel=1e-6) and ratio > 2
    assert bit_exact > 0.98  # the trained steps are float32 numbers: no fp16 step reproduces every block
    row = next(line for line in res.stderr.splitlines() if line.startswith("blk.0.attn_q.weight"))
    assert f"{bit_exact:.1%}" in row and f"{ratio:.1f}x" in row


def test_verify_catches_a_changed_value(synthetic, tmp_path):
    path, _ = synthetic
    out = tmp_path / "o.gguf"
    quantize_exact(path, out)
    got, _ = _tensor(out, "blk.0.attn_q.weight")
    data = bytearray(out.read_bytes())
    data[got.data_offset + 5] ^= 0x11  # two levels one step off
    out.write_bytes(bytes(data))
    res = run_cli("verify", str(out), "--against", str(path))
    assert res.returncode == 1 and "blk.0.attn_q.weight" in res.stderr and "ulp off" in res.stderr


def test_bad_inputs_leave_nothing_behind(synthetic, tmp_path):
    path, _ = synthetic
    with pytest.raises(ModelFileError, match="does not exist"):
        quantize_exact(tmp_path / "nope.gguf", tmp_path / "o.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        quantize_exact(tmp_path / "junk.gguf", tmp_path / "o.gguf")
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 3000])
    with pytest.raises(ModelFileError, match="truncated"):
        quantize_exact(tmp_path / "cut.gguf", tmp_path / "o.gguf")
    with pytest.raises(InputError, match="fallback"):
        quantize_exact(path, tmp_path / "o.gguf", fallback="q2_k")
    bad = np.zeros((4, 64), np.float32)
    bad[2, 7] = np.inf
    _write_gguf(tmp_path / "inf.gguf", {"blk.0.ffn_up.weight": (bad, None)})
    with pytest.raises(InputError, match="NaN or Inf"):
        quantize_exact(tmp_path / "inf.gguf", tmp_path / "o.gguf")
    with pytest.raises(OffGridError):
        quantize_exact(path, tmp_path / "o.gguf", strict=True)
    with pytest.raises(InputError, match="does not exist"):
        quantize_exact(path, tmp_path / "no" / "such" / "o.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "inf.gguf", "junk.gguf", "src.gguf"]


def test_an_already_quantized_input_is_copied_and_said_so(tmp_path):
    rng = np.random.default_rng(5)
    q4 = gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), T.Q4_0)
    _write_gguf(tmp_path / "q.gguf", {"blk.0.ffn_up.weight": (q4, T.Q4_0)})
    rep = quantize_exact(tmp_path / "q.gguf", tmp_path / "o.gguf")
    assert rep.totals()["tensors_q4_0"] == 0 and "no BF16/F16/F32 weight to pack" in rep.table()
    assert check_against_source(tmp_path / "o.gguf", tmp_path / "q.gguf").ok


def _snap(model, seed):
    """Put every 2-D weight of a transformers model on a bf16 4-bit grid along its input dimension."""
    g = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 or p.shape[-1] % 32 or "norm" in name:
                continue
            a = p.detach().float().numpy()
            blocks = a.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / g.integers(5, 9, (blocks.shape[0], 1))
            step = _widen(_bf16_bits(np.maximum(step, 1e-4)))
            lv = np.clip(np.rint(blocks / step), -8, 7)
            p.copy_(torch.from_numpy(_widen(_bf16_bits(step * lv)).reshape(a.shape)))
    return model


@pytest.mark.reference
def test_tiny_gemma4_target_and_assistant_from_hf(tmp_path):
    """HF QAT-layout directories → exact Q4_0 GGUF: llama.cpp's types, same logits as the bf16
    checkpoint within the packing bound, the assistant's clustered head kept."""
    from test_gemma4_gguf import _SmallBPE, _with_tokenizer
    from tiny_gemma4 import TARGET, randomize, tiny_assistant
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from gemmaspec.loading.gguf import load_gguf
    from gemmaspec.loading import load_checkpoint

    tok = _SmallBPE()
    target = _snap(randomize(Gemma4ForCausalLM(Gemma4TextConfig(**TARGET)).eval(), 1), 1).to(torch.bfloat16)
    target.save_pretrained(tmp_path / "t")
    _with_tokenizer(tmp_path / "t", tok)
    asst = _snap(tiny_assistant(clustered=True), 2).to(torch.bfloat16)
    asst.save_pretrained(tmp_path / "a")
    _with_tokenizer(tmp_path / "a", tok)

    rep = quantize_exact(tmp_path / "t", tmp_path / "t.gguf")
    tot = rep.totals()
    assert tot["tensors_q4_0"] > 10 and tot["blocks_on_grid"] == tot["blocks"], rep.table()
    reader = gguf.GGUFReader(tmp_path / "t.gguf")
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == T.Q4_0 and types["blk.0.attn_norm.weight"] == T.F32
    assert reader.fields["general.architecture"].contents() == "gemma4"
    assert check_against_source(tmp_path / "t.gguf", tmp_path / "t").ok

    ref = load_checkpoint(tmp_path / "t").model  # the bf16 checkpoint, float32 maths
    ours = load_gguf(tmp_path / "t.gguf", use_cache=False).model
    ids = torch.tensor([2, 17, 45, 99, 3, 250, 18, 7, 77, 120])
    from gemmaspec.loading.convert import convert

    convert(tmp_path / "t", tmp_path / "t8.gguf", "q8_0")  # what llama.cpp's converter would store
    q8 = load_gguf(tmp_path / "t8.gguf", use_cache=False).model

    def logits(m):
        return m.forward(ids, m.new_cache(32), all_logits=True).logits

    def rel(x):
        return float(torch.linalg.norm(x - logits(ref)) / torch.linalg.norm(logits(ref)))

    # every weight within one bf16 ulp of the checkpoint: logits within ~2 %, and closer than Q8_0's
    assert rel(logits(ours)) < 0.03
    assert rel(logits(ours)) < rel(logits(q8)), (rel(logits(ours)), rel(logits(q8)))

    arep = quantize_exact(tmp_path / "a", tmp_path / "a.gguf")
    assert any("clustered-head" in n for n in arep.notes)
    names = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "a.gguf").tensors}
    assert "masked_embd_centroids.weight" in names and names["masked_embd_ordering"] == T.I32
    assert names["nextn.pre_projection.weight"] == T.Q4_0
    assert check_against_source(tmp_path / "a.gguf", tmp_path / "a").ok
    assert load_gguf(tmp_path / "a.gguf", use_cache=False).model.has_clustered_head
