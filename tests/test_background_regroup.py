"""The fp32 products' regrouped layout built on a background thread (``kernels.regroup_in_background``):
products run while it works read the weights as stored, finished copies are put in use between steps by
patching the kernel-argument arrays in place, and the logits are the same bits at every step as with
the regroup done at first use."""

import time

import pytest
import torch

from gemmaspec import kernels
from gemmaspec.loading import load_checkpoint, product_weights

PROMPT = torch.tensor([2, 818, 5279, 529, 7001, 563], dtype=torch.long)


@pytest.fixture(autouse=True)
def fp32_activations():
    """The background regroup builds the fp32 products' layout; under ``auto`` the default model's head
    multiplies int8 activations and is left out of it, so these tests ask for fp32 everywhere
    (``--act-quant none``; conftest restores the mode)."""
    kernels.set_act_quant("none")


@pytest.fixture(scope="module")
def lib():
    lib = kernels.load_library()
    if lib is None or lib.gs_isa().decode() not in kernels._R8_ISAS:
        pytest.skip("this kernel path reads only the stored layout")
    return lib


def _greedy(model, steps):
    """Logits of the prompt's last position and of ``steps`` greedy decode steps."""
    cache = model.new_cache(256)
    out = [model.forward(PROMPT, cache).logits[-1].clone()]
    for _ in range(steps):
        tok = torch.tensor([int(out[-1].argmax())], dtype=torch.long)
        out.append(model.forward(tok, cache).logits[-1].clone())
    return out


def test_steps_during_and_after_a_background_regroup_give_first_use_bits(lib, model_path, monkeypatch):
    monkeypatch.setenv("GEMMASPEC_REGROUP", "first-use")
    want = _greedy(load_checkpoint(model_path, role="target").model, 24)

    model = load_checkpoint(model_path, role="target").model  # first-use: nothing started at load
    head = model.head
    assert head.__dict__.get("_r8") is None and not head.__dict__.get("_bg")
    monkeypatch.setenv("GEMMASPEC_REGROUP", "background")
    thread = kernels.regroup_in_background(product_weights(model))
    assert thread is not None and head._bg
    cache = model.new_cache(256)
    got = [model.forward(PROMPT, cache).logits[-1].clone()]
    stored_first = head.__dict__.get("_r8") is None  # the prefill ran before the head's copy was done
    for _ in range(12):
        tok = torch.tensor([int(got[-1].argmax())], dtype=torch.long)
        got.append(model.forward(tok, cache).logits[-1].clone())
    for _ in range(12):
        tok = torch.tensor([int(got[-1].argmax())], dtype=torch.long)
        got.append(model.forward(tok, cache).logits[-1].clone())
    # a copy finished after the last step is put in use by the next product: keep running products (on
    # a scratch cache) until every copy is in use and the worker ends (on a loaded machine the copies can
    # take longer than the 25 steps; the worker then waits for the next product, which is by design)
    scratch, deadline = model.new_cache(256), time.monotonic() + 120
    while thread.is_alive() and time.monotonic() < deadline:
        model.forward(PROMPT, scratch)
        scratch.reset()
        thread.join(timeout=0.2)
    assert not thread.is_alive()  # the copies are done and in use, the stored pages released
    assert torch.equal(model.forward(PROMPT, model.new_cache(256)).logits[-1], want[0])  # after: the same bits
    assert stored_first
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}"
    # every regroupable weight is now read regrouped, through the arrays the cached plans point into
    (ns, fmts, ws, *_), _, _ = head.kernel_args(lib, False)
    assert head._r8 is not None and not head._bg
    assert fmts[0] == kernels._R8[head.qtype] and ws[0] == head._r8.data_ptr()
    regrouped = [w for w in product_weights(model) if isinstance(w, kernels.StoredWeight) and w._regroups(lib)]
    assert regrouped and all(w.__dict__.get("_r8") is not None for w in regrouped)
    assert not any(w in kernels._bg_ready for w in regrouped)


def test_load_starts_it_and_first_use_turns_it_off(lib, model_path, monkeypatch):
    monkeypatch.delenv("GEMMASPEC_REGROUP", raising=False)
    head = load_checkpoint(model_path, role="target").model.head
    assert head._bg
    deadline = time.monotonic() + 120
    while head not in kernels._bg_ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert head in kernels._bg_ready and head._bg  # finished, put in use at its next product
    assert head.__dict__.get("_r8") is None
    monkeypatch.setenv("GEMMASPEC_REGROUP", "first-use")
    model = load_checkpoint(model_path, role="target").model
    assert not model.head.__dict__.get("_bg")
    assert kernels.regroup_in_background(product_weights(model)) is None


def test_a_dropped_model_is_not_kept_alive_by_its_regroup(lib, model_path, monkeypatch):
    import gc
    import weakref

    monkeypatch.delenv("GEMMASPEC_REGROUP", raising=False)
    model = load_checkpoint(model_path, role="target").model
    ref = weakref.ref(model.head)
    del model
    deadline = time.monotonic() + 120
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    assert ref() is None


def test_no_background_regroup_when_the_copies_would_crowd_memory(lib, model_path, monkeypatch):
    monkeypatch.setenv("GEMMASPEC_REGROUP", "first-use")
    model = load_checkpoint(model_path, role="target").model
    monkeypatch.setenv("GEMMASPEC_REGROUP", "background")
    monkeypatch.setattr(kernels.regroup, "_mem_available", lambda: 4 * model.head.nbytes)  # the copies: > 1/4 of it
    assert kernels.regroup_in_background(product_weights(model)) is None
    assert not model.head.__dict__.get("_bg")  # regrouped at first use, as before


def test_an_int8_head_is_left_out_under_auto(lib, model_path, monkeypatch):
    """Under ``auto`` the default model's head multiplies int8 activations (its own repacked layout), so the
    background regroup never builds its fp32 layout: no second copy of its 170 MiB."""
    kernels.set_act_quant("auto")
    monkeypatch.delenv("GEMMASPEC_REGROUP", raising=False)
    model = load_checkpoint(model_path, role="target").model
    head = model.head
    assert head.auto_q8 and not head.__dict__.get("_bg")
    kernels.sync_layouts([head])
    assert head.__dict__.get("_r8") is None
