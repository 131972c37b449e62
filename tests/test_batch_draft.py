"""Batched MTP drafting (speculative/batch.py, kernels/assistant.h's gs_assistant_steps): several slots'
draft steps in one call give each slot exactly its solo draft (bits of the C step, tokens of the
drafter), with slots at different context lengths (one past the sliding window), some drafting and some
not, one stopped early by its p-min; and through the scheduler, with the per-round choice of draft
length or fixed lengths, every request gets exactly its plain output (greedy and seeded sampling, one
finishing mid-round)."""

from __future__ import annotations

import queue

import pytest
import torch

from gemmaspec import kernels
from gemmaspec.engine import RequestState
from gemmaspec.models import assistant_step
from gemmaspec.request import RequestOptions
from gemmaspec.sampling import SamplingParams
from gemmaspec.server.scheduler import Job, Scheduler
import gemmaspec.speculative.planner as planner_mod
from gemmaspec.speculative.batch import mtp_batch, preview
from gemmaspec.speculative.chooser import RATE_MIN_ROUNDS
from gemmaspec.speculative.config import SpecConfig
from gemmaspec.speculative.plan import build, plan

WORDS = " ".join(f"item{i}" for i in range(260))  # ~600 tokens: past the 512-token sliding window
PROMPTS = ["def add(a, b):\n    return", "The capital of France is", "List: " + WORDS,
           "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def factory(engine):
    if kernels.load_library() is None:
        pytest.skip("no C kernel on this machine")
    return build(plan(SpecConfig("draft-mtp", p_min=0.0), engine.model_path), engine)


def _states(engine, factory, steps=(2, 5, 3, 1)):
    """Requests at different points (each prefilled and run a few plain steps in its own cache)."""
    out = []
    for prompt, k in zip(PROMPTS, steps):
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        cache = engine.model.new_cache(engine.ctx_size, engine.max_rollback)
        st = RequestState(engine, engine.tokenizer.encode(prompt), RequestOptions(params), None, cache=cache)
        st.prefill()
        for _ in range(k):
            st.finish_round(engine.model.forward(st.begin_round().tokens, cache))
        out.append((st, factory(cache)))
    return out


@pytest.mark.parametrize("act", ["none", "q8_0"])
def test_batched_steps_give_each_row_its_solo_bits(engine, factory, act):
    kernels.set_act_quant(act)
    try:
        states = _states(engine, factory)
        a = states[0][1].assistant
        rows = []
        for st, d in states:
            ctx = st.draft_context()
            p = len(ctx.tokens) - 1
            rows.append((engine.model.embed_row(ctx.tokens[-1]), ctx.hidden, p, d.target_kv(p), a.rope_at(p)))
        with torch.inference_mode():
            for n in (1, 2, 4):
                part = rows[:n] if n < 4 else rows
                x = torch.stack([r[0] for r in part])
                h = torch.stack([r[1] for r in part])
                got = assistant_step.run_steps(a, x, h, [r[3] for r in part], [r[4] for r in part])
                assert got is not None  # the batched C step applies (reduced Q4_0 head)
                for i, (xe, hi, p, kv, rope) in enumerate(part):
                    hidden, next_h, (tok, prob) = assistant_step.run_step(a, xe, hi, kv, rope, token=True)
                    assert torch.equal(got[0][i], hidden) and torch.equal(got[1][i], next_h), (n, i)
                    assert got[2][i] == tok and got[3][i] == prob, (n, i)
            # a round's rows prepared once, then a step over some of them out of order (slots that
            # stopped drafting leave the batch): each row still gets its solo bits
            prep = a.prepare_steps([r[3] for r in rows], [r[4] for r in rows])
            assert prep is not None and prep.n == 4
            pick = [3, 1]
            x = torch.stack([rows[i][0] for i in pick])
            h = torch.stack([rows[i][1] for i in pick])
            got = assistant_step.run_steps(a, x, h, None, None, pick, prep)
            for j, i in enumerate(pick):
                xe, hi, p, kv, rope = rows[i]
                hidden, next_h, (tok, prob) = assistant_step.run_step(a, xe, hi, kv, rope, token=True)
                assert torch.equal(got[0][j], hidden) and torch.equal(got[1][j], next_h) and got[2][j] == tok, i
        # the round's per-row inputs looked up together are the solo lookups
        ps = [r[2] for r in rows]
        for rope, one in zip(a.ropes_at(ps), [a.rope_at(p) for p in ps]):
            assert all(torch.equal(rope[k][0], one[k][0]) and torch.equal(rope[k][1], one[k][1]) for k in one)
        toks = [st.draft_context().tokens[-1] for st, _ in states]
        assert torch.equal(engine.model.embed_rows(toks), torch.stack([engine.model.embed_row(t) for t in toks]))
        assert max(r[2] for r in rows) > 512  # one row read a wrapped sliding-window ring
    finally:
        kernels.set_act_quant("none")


def test_batched_drafts_equal_solo_drafts(engine, factory):
    states = _states(engine, factory, steps=(1, 4, 2, 6))
    ns = [3, 0, 5, 2]  # one slot does not draft this round
    states[3][1].p_min = 0.6  # and one stops early at its p-min
    solo = [d.propose(st.draft_context(), n).tokens if n else [] for (st, d), n in zip(states, ns)]
    seen = []
    got = mtp_batch([(d, st.draft_context(), n) for (st, d), n in zip(states, ns)],
                    on_step=lambda src, rows, s: seen.append(rows))
    assert [g.tokens for g in got] == solo
    assert seen[0] == 3  # the first step ran the three drafting slots at once


def test_preview_asks_free_drafters_first(engine):
    fac = build(plan(SpecConfig("ngram-simple,draft-mtp", p_min=0.0), engine.model_path), engine)
    cache = engine.model.new_cache(engine.ctx_size, engine.max_rollback)
    d = fac(cache)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    st = RequestState(engine, engine.tokenizer.encode("a b c d a b c"), RequestOptions(params), d, cache=cache)
    st.prefill()
    pv = preview(d, st.draft_context(), 3)
    if pv.draft is not None:  # the n-gram drafter found the repeat: drafted, no model step
        assert pv.source == "ngram-simple" and pv.model is None and 0 < len(pv.draft.tokens) <= 3
    pv = preview(d, type(st.draft_context())([1, 2, 3], st.hidden), 3)  # nothing to copy: the assistant
    assert pv.source == "draft-mtp" and pv.model is not None and pv.batched and pv.draft is None
    assert preview(d, type(st.draft_context())([1, 2, 3], None), 3).source == ""  # no hidden state yet


def _serve(engine, make, jobs_spec, n_slots):
    sched = Scheduler(lambda: (engine, make), n_slots)
    sched.start()
    assert sched.ready.wait(120)
    outs, done = {}, queue.Queue()
    jobs = []
    for i, (prompt, params, opts) in enumerate(jobs_spec):
        outs[i] = []

        def emit(item, i=i):
            if item[0] == "events":
                outs[i].extend(t for e in item[1] for t in e.tokens)
            else:
                done.put(item)

        jobs.append(Job(engine.tokenizer.encode(prompt), RequestOptions(params, **opts), emit))
    for j in jobs:
        sched.submit(j)
    results = [done.get(timeout=600) for _ in jobs]
    sched.close()
    assert all(r[0] == "done" for r in results), results
    return [outs[i] for i in range(len(jobs))], jobs, sched


@pytest.mark.parametrize("choose", [True, False], ids=["chosen-n", "fixed-n"])
def test_scheduler_rounds_equal_plain_output(engine, factory, choose):
    """Three slots, four requests: greedy and seeded, one with few tokens (it ends mid-round while the
    others go on); drafting with the shipped assistant batched across slots, its lengths chosen per
    round or fixed. Every output is the plain output."""
    chain = build(plan(SpecConfig("ngram-simple,draft-mtp"), engine.model_path), engine)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)
    opts = {"n_max": 3, "choose_n": choose}
    spec = [(PROMPTS[0], greedy, opts), (PROMPTS[1], short, opts), (PROMPTS[3], sampled, opts),
            (PROMPTS[2], greedy, {"n_max": 0})]
    a = chain(engine.model.new_cache(16, engine.max_rollback)).drafters[1].assistant
    rows, orig = [], a.draft_steps

    def spy(x, *args, **kw):
        rows.append(x.shape[0])
        return orig(x, *args, **kw)

    a.draft_steps = spy
    rates, orig_choose = [], planner_mod.choose

    def choose_spy(views, costs, **kw):
        rates.append((len(views), kw.get("rate")))
        return orig_choose(views, costs, **kw)

    planner_mod.choose = choose_spy
    try:
        got, jobs, sched = _serve(engine, chain, spec, n_slots=3)
    finally:
        del a.draft_steps
        planner_mod.choose = orig_choose
    plain = [[t for e in engine.generate(engine.tokenizer.encode(p), params) for t in e.tokens]
             for p, params, _ in spec]
    assert got == plain
    assert [len(g) for g in got] == [24, 5, 24, 24]
    if not choose:
        assert rows and max(rows) >= 2  # fixed lengths: the assistant drafted for several slots at once
    else:
        assert all(j.stats.spec.chosen_n for j in jobs[:3]) and not jobs[3].stats.spec.chosen_n
        assert sched.planner.totals.rounds > 0 and sched.planner.totals.predicted_seconds > 0
        # the planning time it learned: rounds with and without the assistant drafting, none of them
        # holding the one-off calibration or a warm-up stall (about a millisecond per round here)
        over = sched.planner.cost.overhead
        assert any(d for _, d in over) and all(v[0] < 0.05 for v in over.values()), over
        # the first rounds of a slot count maximise their own ratio; after RATE_MIN_ROUNDS of them the
        # planner weighs seconds at the rate those rounds made (kept tokens over their seconds)
        assert rates[0][1] is None
        later = [(n, r) for n, r in rates if r is not None]
        assert later and all(1.0 < r < 1e5 for _, r in later), rates
        s = later[-1][0]
        t, sec, n, _ = sched.planner._rates[s]
        assert n >= RATE_MIN_ROUNDS and sched.planner.rate_for(s) == pytest.approx(t / sec)
