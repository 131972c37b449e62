"""A decode or verify step's layers in one C call (``models/decode_step.py``, ``kernels/layers.h``) give
the per-op path's bits: logits and hidden states, for 1 and several rows, both activation modes, with
the sliding-window ring before and after it wraps; and what it writes into the KV cache is the same."""

import pytest
import torch

from gemmaspec import kernels
from gemmaspec.models import decode_step, gemma3


def _run(model, cache, tokens, fast: bool, monkeypatch):
    if not fast:
        monkeypatch.setattr(gemma3, "run_layers", lambda *a: None)
    calls = []
    real = decode_step.run_layers

    def spy(*a):
        out = real(*a)
        calls.append(out is not None)
        return out

    if fast:
        monkeypatch.setattr(gemma3, "run_layers", spy)
    out = model.forward(torch.tensor(tokens), cache, all_logits=True)
    monkeypatch.undo()
    return out, calls


@pytest.mark.parametrize("mode", ["none", "q8_0"])
def test_one_call_step_equals_the_per_op_step(engine, monkeypatch, mode):
    if kernels.load_library() is None:
        pytest.skip("no C compiler: no C step")
    model = engine.model
    before = kernels.act_quant()
    kernels.set_act_quant(mode)
    try:
        prompt = engine.tokenizer.encode("def add(a, b):\n    return a + b\n\n" * 40)[:560]  # past the 512 window
        caches = [model.new_cache(700), model.new_cache(700)]
        for c in caches:
            model.forward(torch.tensor(prompt[:20]), c)  # prefill (the per-op path) of a short prefix
        steps = [[prompt[20]], prompt[21:25], [prompt[25]]]  # a decode row, a 4-row verify, then one more
        steps += [prompt[26:530]]  # a long chunk: per-op (prefill), then rows after the ring wrapped
        steps += [[prompt[530]], prompt[531:537], [prompt[537]]]
        for tokens in steps:
            a, used = _run(model, caches[0], tokens, True, monkeypatch)
            b, _ = _run(model, caches[1], tokens, False, monkeypatch)
            assert used == [len(tokens) <= kernels.SMALL_M]
            assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden), len(tokens)
        assert caches[0].length == caches[1].length == 538
        for la, lb in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(la.k, lb.k) and torch.equal(la.v, lb.v)
    finally:
        kernels.set_act_quant(before)


def test_a_prefill_gives_each_row_the_bits_of_a_decode_step_under_auto(engine):
    """Under ``--act-quant auto`` the default model's products are int8 and batch-invariant and a prefill's
    attention runs 16 query rows at a time through the decode kernel, so a 40-token prefill (one chunk, or
    20 + 20), 4-row verifies and 1-row decode steps give every position the same logits bit for bit: a
    cached prompt's last position equals a fresh one's, and seeded sampling is the same with and without
    speculation on every path."""
    if kernels.load_library() is None:
        pytest.skip("no C compiler")
    before = kernels.act_quant()
    kernels.set_act_quant("auto")
    try:
        model = engine.model
        ids = torch.tensor(engine.tokenizer.encode("def add(a, b):\n    return a + b\n\n" * 4)[:40])
        assert ids.shape[0] == 40

        def run(chunks):
            cache = model.new_cache(128)
            return torch.cat([model.forward(ids[a:b], cache, all_logits=True).logits for a, b in chunks])

        decode = run([(i, i + 1) for i in range(40)])
        assert torch.equal(run([(0, 40)]), decode)
        assert torch.equal(run([(0, 20), (20, 40)]), decode)
        assert torch.equal(run([(i, i + 4) for i in range(0, 40, 4)]), decode)
    finally:
        kernels.set_act_quant(before)
