"""Large product outputs on kept memory (gemmaspec.kernels.outbuf): reused only when nothing uses them."""

import threading

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from gemmaspec import kernels
from gemmaspec.kernels import outbuf


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(outbuf, "_pool", [])
    return outbuf


def test_a_buffer_in_use_is_never_handed_out_again(pool):
    rows = pool.MIN_BYTES // (4 * 1024)  # the smallest output the pool serves, 1024 columns wide
    a = pool.output(rows, 1024)
    b = pool.output(rows, 1024)  # a is alive: b must be other memory
    pa, pb = a.data_ptr(), b.data_ptr()
    view = a[3:5]  # a view keeps a's buffer in use after a is gone
    del a
    c = pool.output(rows, 1024)
    pc, pv = c.data_ptr(), view.data_ptr()
    assert len({pa, pb, pc}) == 3
    assert pv == pa + 3 * 1024 * 4
    del view, b, c
    d = pool.output(rows // 2, 2048)  # all free now: a kept buffer (another shape), not fresh memory
    pd, kept = d.data_ptr(), [buf.data_ptr() for buf in pool._pool]
    assert pd in kept and len(kept) <= pool.POOL_BUFFERS


def test_small_outputs_are_plain_tensors(pool):
    y = pool.output(8, 1024)
    assert y.shape == (8, 1024) and y.dtype == torch.float32 and not pool._pool


def test_threads_never_share_a_buffer(pool):
    rows = pool.MIN_BYTES // (4 * 1024)
    got, lock, start = [], threading.Lock(), threading.Barrier(4)

    def take():
        start.wait()
        for _ in range(50):
            y = pool.output(rows, 1024)
            y[0, 0] = threading.get_ident()
            with lock:
                got.append(y)  # kept: every output handed out stays in use
    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({y.data_ptr() for y in got}) == len(got)


def test_a_kept_result_is_not_overwritten_by_the_next_product(pool, monkeypatch):
    """The case the pool exists for (a verify round's logits), made small: the first product's result
    is still held when the second runs, and stays what it was; once released its memory is reused."""
    monkeypatch.setattr(pool, "MIN_BYTES", 4096)  # 16 rows x 64 columns: 4 KiB
    rng = np.random.default_rng(0)
    per, size = GGML_QUANT_SIZES[T.Q8_0]
    raw = rng.integers(0, 256, (64, 4 * size), dtype=np.uint8)
    raw[:, ::size] = 0  # the fp16 scales: small and finite
    raw[:, 1::size] = 0x20
    w = kernels.StoredWeight(torch.from_numpy(raw), "Q8_0", 4 * per)
    x1, x2 = torch.randn(16, 128, generator=torch.Generator().manual_seed(1)), torch.randn(16, 128)
    first = w(x1)
    kept = first.clone()
    second = w(x2)
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, kept)
    assert torch.equal(second, w(x2.clone()))
    ptr = first.data_ptr()
    del first
    third = w(x1)  # the first's memory is free again (the second's is held): reused, same values
    assert third.data_ptr() == ptr
    assert torch.equal(third, kept)
