"""The kernel's thread pool (pool.h) and the small C ops of a decode step (rms_norm, norm_rope).

The pool must give every task exactly once whatever the thread count and timing (results equal to one
thread's, bit for bit), survive thousands of back-to-back jobs with changing thread counts, and work
again in a forked child (which inherits no worker threads). The C norms must match PyTorch's ops and
keep a row's bits whatever rows ride along (batch invariance)."""

import os

import pytest
import torch

from gemmaspec import kernels
from gemmaspec.kernels import QuantizedWeight
from gemmaspec.models import base
from gemmaspec.models.base import apply_rope, norm_rope, rms_norm, rope_cos_sin


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, k // 32, generator=g) * 0.01
    return QuantizedWeight(q, s, None, 32)


def _product(w, x, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return w(x)
    finally:
        torch.set_num_threads(before)


def test_many_jobs_any_thread_count_same_bits(lib):
    """3,000 products back to back (the pattern of a decode step: small jobs, short gaps), thread counts
    cycling 1..4 (more than this machine's cores: workers get descheduled mid-job): every result equals
    the one-thread result bit for bit."""
    ws = [_weight(n, 256, seed) for seed, n in enumerate((64, 300, 1000))]
    xs = [torch.randn(m, 256, generator=torch.Generator().manual_seed(m)) for m in (1, 3, 16)]
    ref = {(i, j): _product(w, x, 1) for i, w in enumerate(ws) for j, x in enumerate(xs)}
    for it in range(3000):
        i, j, t = it % 3, (it // 3) % 3, 1 + it % 4
        assert torch.equal(_product(ws[i], xs[j], t), ref[i, j]), (it, t)


@pytest.mark.parametrize("nthreads", [2, 3, 4])
def test_every_task_runs_once_before_the_job_returns(lib, nthreads):
    """1,000,000 jobs of 2-8 tiny tasks back to back through the pool (gs_pool_check counts each task's
    runs): none may run twice and none may still be running when the job returns. A pool that let a
    worker claim a task of the next job under the previous job's state word (while the caller was
    writing the job) ran that task twice and returned with another unfinished: ~1,100 bad tasks per
    million jobs at 3 threads on a 2-core Zen 4 (more threads than cores: workers are preempted
    mid-claim), which gave rare wrong or NaN logits in long test runs. About 1 s per thread count."""
    assert lib.gs_pool_check(1_000_000, nthreads) == 0


def test_pool_works_in_a_forked_child(lib):
    """A child forked after the pool started inherits none of its workers (pthread_atfork resets the
    count, so the child starts its own): its products still come out right, bit for bit."""
    w = _weight(2000, 256, 7)
    x = torch.randn(2, 256)
    ref = _product(w, x, 1)
    _product(w, x, 2)  # the parent's pool is running
    pid = os.fork()
    if pid == 0:  # child: exit code 0 only when the product is right
        ok = False
        try:
            ok = torch.equal(_product(w, x, 2), ref)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("d", [8, 256, 640, 1152])
def test_rms_norm_matches_torch_and_is_row_invariant(lib, d):
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(9, d, generator=g) * 3, torch.randn(d, generator=g)
    ref = torch.nn.functional.rms_norm(x.double(), (d,), w.double(), 1e-6)
    got = rms_norm(x, w, 1e-6)
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
    for r in range(9):
        assert torch.equal(rms_norm(x[r:r + 1], w, 1e-6), got[r:r + 1])
    assert ((rms_norm(x, None, 1e-6).double() - torch.nn.functional.rms_norm(x.double(), (d,), None, 1e-6))
            .abs().max()).item() < 1e-5


def test_rms_norm_with_autograd_uses_torch(lib):
    x = torch.randn(2, 64, requires_grad=True)
    w = torch.randn(64)
    rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("hq,hk,d", [(4, 1, 256), (8, 2, 64), (2, 2, 128)])
def test_norm_rope_matches_the_ops_it_replaces(lib, hq, hk, d):
    """Bit for bit the C rms_norm followed by PyTorch's rotate-half RoPE, per head, with q|k|v fused
    rows as input (strided: the values are skipped); each row alone gives the same bits."""
    t = 5
    g = torch.Generator().manual_seed(hq * d)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)
    wq, wk = torch.randn(d, generator=g), torch.randn(d, generator=g)
    cos, sin = rope_cos_sin(torch.arange(3, 3 + t), d, 10000.0)
    got = norm_rope(qkv, hq, hk, d, wq, wk, cos, sin, 1e-6)
    q = apply_rope(rms_norm(qkv[:, :hq * d].reshape(t, hq, d), wq, 1e-6), cos, sin)
    k = apply_rope(rms_norm(qkv[:, hq * d:(hq + hk) * d].reshape(t, hk, d), wk, 1e-6), cos, sin)
    assert torch.equal(got, torch.cat([q, k], dim=1))
    for r in range(t):
        assert torch.equal(norm_rope(qkv[r:r + 1], hq, hk, d, wq, wk, cos[r:r + 1], sin[r:r + 1], 1e-6), got[r:r + 1])
    ref = torch.cat([apply_rope(torch.nn.functional.rms_norm(qkv[:, :hq * d].reshape(t, hq, d), (d,), wq, 1e-6), cos, sin),
                     apply_rope(torch.nn.functional.rms_norm(qkv[:, hq * d:(hq + hk) * d].reshape(t, hk, d), (d,), wk,
                                                             1e-6), cos, sin)], dim=1)
    assert (got - ref).abs().max().item() < 1e-5


def test_ops_on_one_thread_keeps_kernel_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with kernels.ops_on_one_thread():
            assert torch.get_num_threads() == 1 and kernels.threads() == 2
            with kernels.ops_on_one_thread():
                assert kernels.threads() == 2
        assert torch.get_num_threads() == 2 and kernels.threads() == 2
    finally:
        torch.set_num_threads(before)


def test_products_from_several_python_threads_at_once(lib):
    """ctypes releases the GIL, so threads (a server's) can call the kernel together: each product is
    still right (the pool runs one job; a caller that finds it busy runs its own on its own thread)."""
    import threading

    ws = [_weight(n, 256, seed) for seed, n in enumerate((500, 700, 900))]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    ref = [_product(w, x, 1) for w in ws]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    errors = []

    def work(i):
        for _ in range(300):
            if not torch.equal(ws[i](x), ref[i]):
                errors.append(i)
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.set_num_threads(before)
    assert not errors


@pytest.mark.parametrize("head_dim, theta, scaling, rotary_dim",
                         [(256, 10000.0, 1.0, None), (256, 1e6, 8.0, None), (512, 1e6, 1.0, 128)])
def test_rope_table_gives_the_computed_bits(head_dim, theta, scaling, rotary_dim):
    """The CPU RoPE table returns exactly what the formula computes for those positions, for one
    position (decode), a run of them (prefill), a batch's mixed positions, and past the table."""
    base._rope_tables.clear()
    cases = [torch.tensor([p]) for p in (0, 1, 255, 256, 300, 4095, base._ROPE_TABLE_ROWS - 1,
                                         base._ROPE_TABLE_ROWS + 5)]
    cases += [torch.arange(40, 47), torch.arange(1000, 1256), torch.tensor([9, 3, 700, 3])]
    for pos in cases:
        want = base._rope_compute(pos, head_dim, theta, scaling, rotary_dim)
        got = rope_cos_sin(pos, head_dim, theta, scaling, rotary_dim)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), pos
    assert base._rope_tables  # the table path was taken
