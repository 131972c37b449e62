"""The int8-block conversion is exact: scale*q + offset == gguf.quants.dequantize, bit for bit."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings, strategies as st

from gemmaspec.kernels import QuantizedWeight
from gemmaspec.kernels.ggml_blocks import SUPPORTED_QUANT, to_int8_blocks


def _random_blocks(rng, qtype, n_rows, row_len):
    per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_rows, row_len // per_block, nbytes), dtype=np.uint8)
    fp16_at = [208] if qtype == T.Q6_K else [0]
    if qtype in (T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K):
        fp16_at.append(2)
    for off in fp16_at:  # finite fp16 scales, of both signs and many magnitudes
        vals = (rng.standard_normal(raw.shape[:2]) * 10.0 ** rng.integers(-6, 1, raw.shape[:2])).astype(np.float16)
        raw[..., off:off + 2] = vals.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n_rows, -1)


@pytest.mark.parametrize("qtype", SUPPORTED_QUANT, ids=lambda t: t.name)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_rows=st.integers(1, 5), blocks=st.integers(1, 3))
def test_exact_against_gguf_dequantize(qtype, seed, n_rows, blocks):
    rng = np.random.default_rng(seed)
    row_len = gguf.GGML_QUANT_SIZES[qtype][0] * blocks
    raw = _random_blocks(rng, qtype, n_rows, row_len)
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    q, s, o, g = to_int8_blocks(raw, qtype, n_rows, row_len)
    w = QuantizedWeight(torch.from_numpy(q), torch.from_numpy(s), None if o is None else torch.from_numpy(o), g)
    ours = w.dequantize().numpy()
    np.testing.assert_array_equal(ours, ref)


def test_rejects_wrong_byte_count():
    with pytest.raises(ValueError, match="needs"):
        to_int8_blocks(np.zeros(33, np.uint8), T.Q8_0, 1, 32)
    with pytest.raises(ValueError, match="not supported"):
        to_int8_blocks(np.zeros(10, np.uint8), T.IQ4_XS, 1, 256)
