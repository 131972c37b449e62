"""The server's scheduler in-process: batched slots give each request exactly its solo tokens (greedy
and seeded sampling, mixed draft lengths), the queue is FIFO and drops nothing, a model without
forward_batch is served one forward per slot, and a cancelled request frees its slot."""

from __future__ import annotations

import queue
import threading

import pytest

from gemmaspec.engine import Engine
from gemmaspec.request import RequestOptions
from gemmaspec.sampling import SamplingParams
from gemmaspec.server.scheduler import Job, Scheduler
from gemmaspec.speculative.drafters import NgramDrafter

PROMPTS = ["Rewrite: red, green, blue, red, green,", "def add(a, b):\n    return", "The capital of France is",
           "1, 2, 3, 4, 5,", "Once upon a time"]


class _Unbatched:
    """The same model without forward_batch (like Gemma 4 today)."""

    def __init__(self, model):
        self._m = model
        self.config, self.device = model.config, model.device

    def new_cache(self, *a, **k):
        return self._m.new_cache(*a, **k)

    def forward(self, *a, **k):
        return self._m.forward(*a, **k)


def _run(engine, jobs_spec, n_slots, batched=True):
    eng = engine if batched else Engine(_Unbatched(engine.model), engine.tokenizer, engine.ctx_size)
    sched = Scheduler(lambda: (eng, lambda cache: NgramDrafter(4, 1)), n_slots)
    sched.start()
    assert sched.ready.wait(60)
    assert sched.batched == batched
    outs, done = {}, queue.Queue()
    admitted = []  # job indices in the order the scheduler first emitted for them (its admission order)
    jobs = []
    for i, (prompt, params, n_max) in enumerate(jobs_spec):
        outs[i] = []

        def emit(item, i=i):
            if i not in admitted:
                admitted.append(i)
            if item[0] == "events":
                outs[i].extend(t for e in item[1] for t in e.tokens)
            else:
                done.put(item)

        job = Job(engine.tokenizer.encode(prompt), RequestOptions(params, n_max=n_max), emit)
        jobs.append(job)
    for j in jobs:
        sched.submit(j)
    results = [done.get(timeout=300) for _ in jobs]
    sched.close()
    assert all(r[0] == "done" for r in results), results
    return [outs[i] for i in range(len(jobs))], admitted, jobs


def _solo(engine, prompt, params, n_max):
    ids = engine.tokenizer.encode(prompt)
    return [t for e in engine.generate(ids, params, NgramDrafter(4, 1), n_max=n_max) for t in e.tokens]


@pytest.mark.parametrize("batched", [True, False], ids=["forward_batch", "one-forward-per-slot"])
def test_slots_give_each_request_its_solo_tokens(engine, batched):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True)
    spec = [(PROMPTS[0], greedy, 3), (PROMPTS[1], sampled, 2), (PROMPTS[2], greedy, 0), (PROMPTS[3], sampled, 0),
            (PROMPTS[4], greedy, 4)]
    got, admitted, jobs = _run(engine, spec, n_slots=3, batched=batched)
    assert got == [_solo(engine, p, params, n) for p, params, n in spec]
    assert all(len(g) == 20 for g in got)
    # FIFO: the first three get the slots, the other two wait and are admitted in arrival order
    assert [j.slot for j in jobs[:3]] == [0, 1, 2]
    assert admitted == [0, 1, 2, 3, 4]


def test_cancelled_request_frees_its_slot(engine):
    events = queue.Queue()
    sched = Scheduler(lambda: (engine, lambda cache: NgramDrafter()), 1)
    sched.start()
    assert sched.ready.wait(60)
    long = Job(engine.tokenizer.encode(PROMPTS[2]),
               RequestOptions(SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)), events.put)
    got_one = threading.Event()
    short_out = queue.Queue()
    long.emit = lambda item: (events.put(item), got_one.set())
    short = Job(engine.tokenizer.encode(PROMPTS[3]),
                RequestOptions(SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)), short_out.put)
    sched.submit(long)
    sched.submit(short)
    assert got_one.wait(60)
    assert sched.queued() == 1
    sched.cancel(long)
    while True:  # the short request now runs to its end in the freed slot
        item = short_out.get(timeout=60)
        if item[0] != "events":
            break
    assert item[0] == "done" and short.stats.generated_tokens == 3
    assert long.cancelled and long.stats.stop_reason == "cancelled" and long.stats.generated_tokens < 1000
    sched.close()
