"""The C kernel multiplies exactly-dequantized weights with fp32 activations, batch-invariantly."""

import numpy as np
import pytest
import torch

from gemmaspec import kernels
from gemmaspec.kernels import QuantizedWeight


def _x(m, k, seed=0):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _weight(n, k, group, offset, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.01
    o = (torch.rand(n, k // group, generator=g) - 0.5) * 0.01 if offset else None
    return QuantizedWeight(q, s, o, group)


@pytest.mark.parametrize("group,offset", [(32, False), (16, False), (32, True), (16, True)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16])
def test_matches_dense(lib, group, offset, m):
    w = _weight(67, 256, group, offset)  # N not a multiple of the kernel's row tile
    x = _x(m, 256)
    ref = (x.double() @ w.dequantize().double().T)
    got = w(x).double()
    assert got.shape == (m, 67)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-6, rel


def test_batch_invariant(lib):
    """Row 0 comes out bit-identical whatever other rows ride along (the verify step relies on it)."""
    w = _weight(300, 640, 32, False, seed=1)
    x = _x(16, 640)
    alone = w(x[:1])
    for m in range(2, 17):
        assert torch.equal(w(x[:m])[:1], alone), m


def test_large_m_uses_dense_path(lib):
    w = _weight(64, 128, 32, True)
    x = _x(40, 128)
    ref = x.double() @ w.dequantize().double().T
    assert ((w(x).double() - ref).norm() / ref.norm()).item() < 1e-6


def test_embedding_rows():
    w = _weight(50, 64, 16, True)
    ids = torch.tensor([[3, 7], [49, 0]])
    np.testing.assert_array_equal(w.rows(ids).numpy(), w.dequantize()[ids].numpy())
