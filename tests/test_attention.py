"""The C attention kernel (``gs_attention_mt``, kernels/stepops.h): grouped-query attention in blocks of
256 keys on the thread pool.

Speculative verification needs a row's bits to be the same whether it is computed alone (a decode step)
or beside other rows (a verify step), and the same at any thread count; the kernel must also agree with
PyTorch's softmax(q k^T) v, with masks that hide whole blocks (the sliding window's ring after a wrap) and
with the head dims Gemma uses (256 sliding, 512 full)."""

import ctypes

import pytest
import torch

from gemmaspec.models import base


def _run(lib, q, k, v, mask, scale=1.0, softcap=0.0, threads=1):
    t, h, d = q.shape
    L, hkv, _ = k.shape
    out = torch.full((t, h, d), float("nan"))
    m = None if mask is None else mask.to(torch.uint8).contiguous()
    rc = lib.gs_attention_mt(q.data_ptr(), q.stride(0), t, h, hkv, d, k.data_ptr(), v.data_ptr(), L,
                             None if m is None else m.data_ptr(), ctypes.c_float(scale), ctypes.c_float(softcap),
                             out.data_ptr(), threads)
    assert rc == 0
    return out


def _reference(q, k, v, mask, scale, softcap=0.0):
    t, h, d = q.shape
    g = h // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1).double(), v.repeat_interleave(g, dim=1).double()
    s = torch.einsum("thd,lhd->htl", q.double(), kk) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", torch.softmax(s, -1), vv).float()


def _inputs(t, h, hkv, d, L, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    k = torch.randn(L, hkv, d, generator=g) / d ** 0.25
    v = torch.randn(L, hkv, d, generator=g)
    return q, k, v


def _ring_mask(t, L, start, window):
    """Which ring rows each of t queries at positions start.. may see: row i holds the newest position
    p = i (mod L) written so far (the ring of a sliding layer after it wrapped)."""
    newest = start + t - 1
    slot_pos = torch.tensor([newest - ((newest - i) % L) for i in range(L)])
    q_pos = torch.arange(start, start + t)[:, None]
    return (slot_pos[None] <= q_pos) & (slot_pos[None] > q_pos - window) & (slot_pos[None] >= 0)


@pytest.mark.parametrize("h,hkv,d,L", [(8, 1, 256, 13), (8, 1, 256, 700), (8, 1, 512, 257), (4, 2, 16, 256),
                                       (16, 4, 512, 1030), (3, 3, 32, 1)])
def test_matches_the_reference(lib, h, hkv, d, L):
    t = 3
    q, k, v = _inputs(t, h, hkv, d, L, seed=L + d)
    mask = torch.arange(L)[None] <= torch.arange(L - t, L).clamp(min=0)[:, None]  # causal, as verify rows see it
    got = _run(lib, q, k, v, mask, scale=0.7)
    torch.testing.assert_close(got, _reference(q, k, v, mask, 0.7), rtol=2e-5, atol=2e-5)
    got = _run(lib, q, k, v, None, softcap=5.0)
    torch.testing.assert_close(got, _reference(q, k, v, None, 1.0, 5.0), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("L,start", [(512, 600), (512, 1500), (300, 900)])
def test_rows_alone_equal_rows_batched_at_any_thread_count(lib, L, start):
    """Verify rows over a wrapped sliding ring (masks that hide parts of blocks and whole blocks): each
    row alone at 1 thread gives the bits of the batch at 1, 2 and 3 threads."""
    t, h, hkv, d = 8, 8, 1, 256
    q, k, v = _inputs(t, h, hkv, d, L, seed=start)
    mask = _ring_mask(t, L, start, window=L)
    mask[:, : L // 2] &= torch.arange(t)[:, None] % 2 == 0  # odd rows: the whole first half hidden
    alone = torch.cat([_run(lib, q[i:i + 1], k, v, mask[i:i + 1]) for i in range(t)])
    for threads in (1, 2, 3):
        assert torch.equal(_run(lib, q, k, v, mask, threads=threads), alone)
    torch.testing.assert_close(alone, _reference(q, k, v, mask, 1.0), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("L,lo,hi", [(528, 0, 21), (528, 0, 300), (1030, 300, 700), (700, 513, 700)])
def test_keys_outside_the_visible_span_are_never_read(lib, L, lo, hi):
    """A ring not yet full (or a short cache in a long buffer, as the MTP assistant reads the target's)
    costs its visible keys only: keys outside every row's visible span, NaN here, change no bit of the
    result, and whole blocks with no visible key are skipped."""
    t, h, hkv, d = 3, 4, 1, 256
    q, k, v = _inputs(t, h, hkv, d, L, seed=L + lo)
    mask = torch.zeros(t, L, dtype=torch.bool)
    mask[:, lo:hi] = True
    mask[1, hi - 1] = False  # rows see different spans; the union is what is read
    want = _run(lib, q, k, v, mask)
    k2, v2 = k.clone(), v.clone()
    for x in (k2, v2):
        x[:lo] = float("nan")
        x[hi:] = float("nan")
    for threads in (1, 2):
        assert torch.equal(_run(lib, q, k2, v2, mask, threads=threads), want)
    torch.testing.assert_close(want, _reference(q, k, v, mask, 1.0), rtol=2e-5, atol=2e-5)


def test_a_row_that_sees_no_key_gets_zeros(lib):
    q, k, v = _inputs(2, 4, 2, 16, 300, seed=1)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[1] = False
    out = _run(lib, q, k, v, mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0], _run(lib, q[:1], k, v, mask[:1])[0])


def test_the_model_path_uses_the_kernel_and_matches_torch(lib, monkeypatch):
    """``base.attention`` (what every model calls) goes through the kernel for a few rows and agrees with
    its PyTorch path (the path prefill and autograd take)."""
    q, k, v = _inputs(4, 8, 1, 256, 520, seed=3)
    mask = torch.arange(520)[None] <= torch.arange(516, 520)[:, None]
    calls = []
    real = base._attention_c
    monkeypatch.setattr(base, "_attention_c", lambda *a: calls.append(1) or real(*a))
    got = base.attention(q, k, v, mask, 1.0)
    assert calls and torch.equal(got, _run(lib, q, k, v, mask))
    monkeypatch.setattr(base, "_attention_c", lambda *a: None)
    torch.testing.assert_close(got, base.attention(q, k, v, mask, 1.0), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_sequences_in_one_call_get_their_bits_alone(lib, threads, monkeypatch):
    """``base.attention_seqs`` (a batched forward's layer: each sequence against its own cache, one C call)
    gives every sequence's rows the bits ``base.attention`` gives them alone: caches of different lengths,
    masked and not, 1 to 16 rows, across the thread pool; a sequence the C path does not take (17 rows)
    sends the whole call back to one attention per sequence, with the same bits."""
    monkeypatch.setattr(base, "threads", lambda: threads)
    shapes = [(1, 200, True), (4, 13, True), (16, 700, False), (2, 1030, True), (1, 1, None)]
    qs, kvs = [], []
    for i, (t, L, masked) in enumerate(shapes):
        q, k, v = _inputs(t, 4, 1, 256, L, seed=10 + i)
        mask = (torch.arange(L)[None] <= torch.arange(L - t, L)[:, None]) if masked else None
        if masked is None:
            mask = torch.ones(t, L, dtype=torch.bool)
        qs.append(q)
        kvs.append((k, v, mask))
    q = torch.cat(qs)
    bounds = [0]
    for x in qs:
        bounds.append(bounds[-1] + x.shape[0])
    calls = []
    real = lib.gs_attention_seqs
    monkeypatch.setattr(base, "load_library", lambda: type("L", (), {
        "gs_attention_seqs": lambda self, *a: calls.append(1) or real(*a),
        "gs_attention_mt": lib.gs_attention_mt})())
    got = base.attention_seqs(q, bounds, kvs, 0.0625)
    assert calls, "the C path was not taken"
    for j, (k, v, mask) in enumerate(kvs):
        alone = base.attention(qs[j], k, v, mask, 0.0625)
        assert torch.equal(got[bounds[j]:bounds[j + 1]], alone), j
    # a prefill-sized sequence among them: one attention per sequence (the C path chunks it alone)
    q17, k17, v17 = _inputs(17, 4, 1, 256, 40, seed=99)
    calls.clear()
    got = base.attention_seqs(torch.cat([qs[0], q17]), [0, 1, 18], [kvs[0], (k17, v17, None)], 0.0625)
    assert not calls
    assert torch.equal(got[:1], base.attention(qs[0], *kvs[0], 0.0625))
    assert torch.equal(got[1:], base.attention(q17, k17, v17, None, 0.0625))
