"""Batched forwards: every sequence's rows come out bit-identical to running it alone, which is what
lets the server batch users without changing anyone's tokens."""

import pytest
import torch

from gemmaspec.engine import RequestState
from gemmaspec.request import RequestOptions
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.drafters import NgramDrafter

PROMPTS = ["The capital of France is", "def fib(n):\n    return", "Once upon a time, in a small village",
           'JSON: {"a": 1, "b":', "Q: what is 2+2?\nA:", "List: apples, pears,"]


def _prefilled(engine, prompt):
    cache = engine.model.new_cache(engine.ctx_size, 16)
    engine.model.forward(torch.tensor(engine.tokenizer.encode(prompt)), cache)
    return cache


@pytest.mark.parametrize("rows", [[1, 1], [4, 1, 3, 4], [4, 4, 4, 4], [1, 2, 3, 4, 5, 6], [20, 1], [3, 40, 2, 17],
                                  [-20, 1, -17]])
def test_forward_batch_rows_equal_solo_forward(engine, rows):
    """Up to 6 sequences × up to 6 rows (36 rows, past the kernel's 16-row dispatch limit), and prefill
    chunks of more than 16 rows beside decode rows (their solo forward takes the many-row products); a
    negative count: that many rows with the last row's logits only."""
    gen = torch.Generator().manual_seed(len(rows))
    flags = [r > 1 for r in rows]
    rows = [abs(r) for r in rows]
    toks = [torch.randint(0, 5000, (r,), generator=gen) for r in rows]
    solo_caches = [_prefilled(engine, p) for p in PROMPTS[:len(rows)]]
    batch_caches = [_prefilled(engine, p) for p in PROMPTS[:len(rows)]]
    solo = [engine.model.forward(t, c, all_logits=f) for t, c, f in zip(toks, solo_caches, flags)]
    batch = engine.model.forward_batch(list(zip(toks, batch_caches)), flags)
    assert len(batch) == len(rows)
    for s, b, sc, bc in zip(solo, batch, solo_caches, batch_caches, strict=True):
        assert torch.equal(s.logits, b.logits)
        assert torch.equal(s.hidden, b.hidden)
        assert sc.length == bc.length
        for ls, lb in zip(sc.layers, bc.layers):
            assert torch.equal(ls.k, lb.k) and torch.equal(ls.v, lb.v)


def test_forward_batch_refuses_a_shared_cache(engine):
    cache = _prefilled(engine, "Hi")
    with pytest.raises(ValueError, match="distinct cache"):
        engine.model.forward_batch([(torch.tensor([5]), cache), (torch.tensor([6]), cache)])


def test_interleaved_request_states_equal_generate(engine):
    """Three requests whose rounds run in shared forwards produce exactly what generate() gives each alone."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    alone = [[t for ev in engine.generate(i, params, NgramDrafter(), n_max=3) for t in ev.tokens] for i in ids]
    states = [RequestState(engine, i, RequestOptions(params, n_max=3), NgramDrafter()) for i in ids]
    got = [[t for ev in s.prefill() for t in ev.tokens] for s in states]
    while any(not s.done for s in states):
        live = [(j, s) for j, s in enumerate(states) if not s.done]
        rounds = [s.begin_round() for _, s in live]
        outs = engine.model.forward_batch([(r.tokens, s.cache) for r, (_, s) in zip(rounds, live)],
                                          [r.all_logits for r in rounds])
        for (j, s), out in zip(live, outs):
            got[j] += [t for ev in s.finish_round(out) for t in ev.tokens]
    assert got == alone
    assert all(s.stats.generated_tokens == 24 and s.stats.stop_reason == "length" for s in states)
