"""Replay the server's draft-length choice offline: traces of what each drafter would have had accepted
at every position of the bench suite's greedy outputs, the round costs this machine measured, and a
simulation of ``gemmaspec bench``'s rounds (S users on one kind's prompt, 48 tokens each) under the
chooser (``speculative/chooser.py``) or a fixed draft length. Greedy output does not depend on the draft
length, so a round's outcome is a lookup: drafting n tokens at position t keeps ``1 + min(n, L(t))``
tokens, L(t) the accepted prefix of the drafter's longest draft there. What is simulated is the choice
and its estimates; timing noise is drawn around the measured costs, so a rule can be judged on many
seeded runs instead of one noisy bench run.

    python benchmarks/chooser_sim.py trace --out sim-trace            # ~2 min: the suite's traces
    python benchmarks/chooser_sim.py costs --out sim-costs -- BENCH ARGS  # a bench run's raw round costs
    python benchmarks/chooser_sim.py sim --trace sim-trace --costs sim-costs [--runs 8] [--variant V] [--out NAME]

``trace`` decodes each kind's first prompt greedily (as ``gemmaspec bench`` sends it) with a recording
drafter that asks the real drafter for its draft at every position (the default chain and the assistant
alone, up to ``--n-max``) and proposes nothing, so every position is visited. ``costs`` runs
``gemmaspec bench`` in this process and keeps every round's measured verify time per (slots, rows),
every draft step per batch size, and the planning time; the sim uses their medians. ``sim`` replays,
for each drafter, kind and user count in the bench's order (one planner per drafter, its pooled
estimates carried across phases), no speculation, each fixed length 1-3 and the chosen lengths up to
3, and reports the chosen lengths' tokens/s against the best fixed configuration per kind. ``--variant``:
``base`` (the shipped planner), ``before`` (the planner before these replays), ``explore`` (the one
tuned on them before verify rows got cheap), ``ratio`` (the shipped one maximising each round's own
tokens per second instead of weighing seconds at the measured rate), ``oracle`` (each kind's
true acceptance by position, known in advance: the ceiling of a choice from per-position rates), or
``key=value+...`` overriding :data:`VARIANT`. ``--trace a,b`` replays several traces' kinds together.
``--truth-cells N``: a (slots, rows) the costs file measured N times or more costs its own median
instead of lying on its slot count's line (the machine's unevenness kept). ``--mix`` (with ``--trace a,b,c``,
each a trace of another prompt of every kind): a phase's users take those prompts from one queue, cycled up to
a multiple of the users, as ``gemmaspec bench --prompts-per-kind 3`` sends them, instead of all decoding one
prompt in lock-step (where every slot drafts, accepts and chooses alike, and a phase is a few rounds long).
Writes benchmarks/results/<out>.json and .md, the machine named.

Not simulated: Python's time outside the measured parts of a round, prefill, and any dependence of a
round's cost on the context length; the replay's speedups run above ``gemmaspec bench``'s, its ratios
between configurations are what it is for.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random
import statistics
import sys
from pathlib import Path

from common import ROOT, machine, write_results

from gemmaspec.speculative.chooser import (EXPLORE, EXPLORE_SLOTS, LINE_CELL_PRIOR, LINE_CLIP, LINE_DECAY, LINE_PRIOR,
                                           PRIOR_WEIGHT, RATE_DECAY, RATE_MIN_ROUNDS, RATE_NEW_REQUEST, REQUEST_DECAY,
                                           Acceptance, CostModel, SlotView, choose)
from gemmaspec.speculative.options import MAX_DRAFT_TOKENS

SPEC_TYPES = ("ngram-simple,draft-mtp", "draft-mtp")


# ---------------------------------------------------------------- traces
class _Recorder:
    """Asks ``inner`` for its draft at every round and proposes nothing (every position is decoded)."""

    def __init__(self, inner, n_max: int):
        self.inner, self.n_max, self.name = inner, n_max, inner.name
        self.seen: dict[int, tuple[list[int], str]] = {}

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, ctx, n_max):
        from gemmaspec.speculative.drafters import Draft

        got = self.inner.propose(ctx, self.n_max)
        members = getattr(self.inner, "drafters", [self.inner])  # an empty chain draft: its model drafted nothing
        self.seen[len(ctx.tokens)] = (list(got.tokens), got.source or members[-1].name)
        self.last = list(ctx.tokens)
        return Draft()


def trace(args) -> None:
    from gemmaspec.bench.suite import load_suite
    from gemmaspec.loading.engine import load_engine
    from gemmaspec.manage.default_model import default_model_path
    from gemmaspec.request import RequestOptions
    from gemmaspec.sampling import SamplingParams
    from gemmaspec.speculative.config import SpecConfig
    from gemmaspec.speculative.plan import build, plan

    path = default_model_path()
    engine = load_engine(path, ctx_size=2048)
    by_kind = collections.defaultdict(list)
    for p in load_suite("default"):
        by_kind[p.kind].append(p)
    prompts = [ps[args.prompt] for ps in by_kind.values() if len(ps) > args.prompt]
    out = {"model": str(path.name), "n_max": args.n_max, "max_tokens": args.max_tokens, "kinds": {}}
    for st in SPEC_TYPES:
        pl = plan(SpecConfig(st), path)
        make = build(pl, engine)
        for p in prompts:
            tok = engine.tokenizer
            ids = tok.encode_chat(p.message_dicts()) if p.messages else engine.encode_prompt(p.prompt)
            rec = _Recorder(make(engine.cache), args.n_max)
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True).validate()
            opts = RequestOptions(params, n_max=args.n_max)
            for _ in engine.generate(ids, opts, drafter=rec):
                pass
            full = rec.last  # the last round's context: the prompt and every generated token but the last
            seen = {}
            for m, (draft, source) in sorted(rec.seen.items()):
                truth = full[m:m + len(draft)]
                acc = 0
                while acc < min(len(draft), len(truth)) and draft[acc] == truth[acc]:
                    acc += 1
                seen[m - len(ids)] = [len(draft), acc, source]
            out["kinds"].setdefault(p.kind, {})[st] = {"prompt_tokens": len(ids), "positions": seen}
            print(f"{st} {p.kind}: {len(rec.seen)} positions", file=sys.stderr)
    lines = [f"# Draft traces of the default suite ({out['model']}, greedy, {args.max_tokens} tokens, drafts up to "
             f"{args.n_max})", "", f"Machine: {machine().get('cpu', '?')}. Per kind: positions where the drafter "
             "drafted, and the mean accepted prefix there (of the longest draft).", "",
             "| kind | " + " | ".join(f"{st}: drafted / mean accepted" for st in SPEC_TYPES) + " |",
             "|---|" + "---:|" * len(SPEC_TYPES)]
    for kind, by in out["kinds"].items():
        cells = []
        for st in SPEC_TYPES:
            pos = [v for v in by[st]["positions"].values() if v[0] > 0]
            cells.append(f"{len(pos)} / {statistics.mean(v[1] for v in pos):.2f}" if pos else "0 / -")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    write_results(args.out, {"machine": machine(), **out}, "\n".join(lines))


# ---------------------------------------------------------------- costs
def costs(args) -> None:
    from gemmaspec.cli import main as gemmaspec_main

    raw = {"verify": collections.defaultdict(list), "draft": collections.defaultdict(list),
           "overhead": collections.defaultdict(list), "calibration": []}
    init, ov, od, oo = CostModel.__init__, CostModel.observe_verify, CostModel.observe_draft, CostModel.observe_overhead

    def new_init(self, forward_costs, *a, **k):
        raw["calibration"] = [float(c) for c in forward_costs]
        init(self, forward_costs, *a, **k)

    def verify(self, seqs, rows, seconds):
        raw["verify"][f"{seqs},{rows}"].append(seconds)
        ov(self, seqs, rows, seconds)

    def draft(self, source, batch, seconds):
        raw["draft"][f"{source},{batch}"].append(seconds)
        od(self, source, batch, seconds)

    def overhead(self, seqs, drafting, seconds):
        raw["overhead"][f"{seqs},{int(drafting)}"].append(seconds)
        oo(self, seqs, drafting, seconds)

    CostModel.__init__, CostModel.observe_verify = new_init, verify
    CostModel.observe_draft, CostModel.observe_overhead = draft, overhead
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    gemmaspec_main(["bench", *bench])
    med = {k: {key: statistics.median(v) for key, v in raw[k].items()} for k in ("verify", "draft", "overhead")}
    data = {"machine": machine(), "bench_args": bench, "calibration_s": raw["calibration"],
            **{f"{k}_s": v for k, v in med.items()}, "samples": {k: {key: len(v) for key, v in raw[k].items()}
                                                                for k in ("verify", "draft", "overhead")}}
    lines = [f"# Round costs measured by `gemmaspec bench {' '.join(bench)}` (medians, ms)", "",
             f"Machine: {data['machine'].get('cpu', '?')}.", "", "| slots, rows | verify ms | rounds |", "|---|---:|---:|"]
    for key, v in sorted(med["verify"].items(), key=lambda kv: tuple(map(int, kv[0].split(",")))):
        lines.append(f"| {key} | {v * 1e3:.2f} | {len(raw['verify'][key])} |")
    write_results(args.out, data, "\n".join(lines))


# ---------------------------------------------------------------- simulation
class Truth:
    """The machine's round costs for the simulation: per slot count a least-squares line in rows
    through the measured verify medians (rows never measured lie on it), draft steps per batch size
    (linear beyond the measured), planning per slot count."""

    def __init__(self, c: dict, cells: int = 0):
        self.cal = c["calibration_s"]
        # cells > 0: a (slots, rows) measured that many times or more costs its own median, off the line
        # (the machine's real unevenness: a cost model that assumes a line is then judged fairly)
        self.cells = {tuple(map(int, k.split(","))): v for k, v in c["verify_s"].items()
                      if cells and c.get("samples", {}).get("verify", {}).get(k, 0) >= cells}
        by_s = collections.defaultdict(list)
        for key, v in c["verify_s"].items():
            s, r = map(int, key.split(","))
            by_s[s].append((r, v))
        self.line = {}
        for s, pts in by_s.items():
            if len(pts) == 1:
                r, v = pts[0]
                slope = (self.cal[-1] - self.cal[0]) / max(1, len(self.cal) - 1)
                self.line[s] = (v - slope * r, slope)
                continue
            mr = statistics.mean(r for r, _ in pts)
            mv = statistics.mean(v for _, v in pts)
            b = sum((r - mr) * (v - mv) for r, v in pts) / max(1e-12, sum((r - mr) ** 2 for r, _ in pts))
            self.line[s] = (mv - b * mr, max(b, 0.0))
        self.draft = collections.defaultdict(dict)
        for key, v in c["draft_s"].items():
            src, b = key.rsplit(",", 1)
            self.draft[src][int(b)] = v
        self.over = {}
        for key, v in c["overhead_s"].items():
            s, d = map(int, key.split(","))
            self.over[(s, bool(d))] = v

    def verify(self, s: int, rows: int) -> float:
        if (s, rows) in self.cells:
            return self.cells[(s, rows)]
        if s not in self.line:  # the nearest slot count measured, scaled
            near = min(self.line, key=lambda x: abs(x - s))
            a, b = self.line[near]
            return (a * s / near) + b * rows
        a, b = self.line[s]
        return a + b * rows

    def draft_step(self, src: str, batch: int) -> float:
        tab = self.draft.get(src) or {1: 0.1 * self.cal[0]}
        if batch in tab:
            return tab[batch]
        lo = max((b for b in tab if b < batch), default=min(tab))
        hi = min((b for b in tab if b > batch), default=None)
        if hi is None:
            return tab[lo] * batch / lo
        return tab[lo] + (tab[hi] - tab[lo]) * (batch - lo) / (hi - lo)

    def overhead(self, s: int, drafting: bool) -> float:
        keys = [k for k in self.over if k[1] == drafting]
        if not keys:
            return 0.0
        near = min(keys, key=lambda k: abs(k[0] - s))
        return self.over[near]


class SimPlanner:
    """The server planner's bookkeeping (``speculative/planner.py``) over simulated rounds: pooled and
    per-slot acceptance, the cost model learning from the simulated times."""

    def __init__(self, truth: Truth, acceptance=None, cost_model=None):
        self.truth = truth
        self.cost = (cost_model or CostModel)(truth.cal)
        self.make_acc = acceptance or _variant("base")[0]  # default: the shipped planner's estimates
        self.pooled: dict = {}
        self.per_slot: dict = {}
        self.lam_decay, self.lam_min = 0.0, 5.0  # the rate the choice weighs seconds at (variant lam, lmin)
        self.rates: dict = {}  # slots -> [decayed tokens, decayed seconds, decayed rounds]
        self.rate_all = False  # the rate measured over every round (variant lall=1), not the planned ones only
        self.rate_new = RATE_NEW_REQUEST  # the rates' weight kept when a request starts (variant lnew)
        self.pf, self.pf_decay = 0.0, 0.95  # slot weights (mean rate / own rate) ** pf (variant pf, pfd)
        self.slot_rate: dict = {}  # slot -> [decayed tokens, decayed seconds] of its request's rounds

    def rate_for(self, slots: int):
        got = self.rates.get(slots)
        if not self.lam_decay or got is None or got[2] < self.lam_min:
            return None
        return got[0] / got[1]

    def observe_rate(self, slots: int, tokens: float, seconds: float) -> None:
        got = self.rates.setdefault(slots, [0.0, 0.0, 0.0])
        d = self.lam_decay
        got[0], got[1], got[2] = d * got[0] + tokens, d * got[1] + seconds, d * got[2] + 1.0

    def new_request(self, slot: int) -> None:
        """A request starts on ``slot``: its own estimates start afresh and the measured rates weigh less
        (the planner's ``new_request``)."""
        self.per_slot[slot] = {}
        self.slot_rate.pop(slot, None)
        for rec in self.rates.values():
            rec[:3] = [v * self.rate_new for v in rec[:3]]

    def acc(self, slot: int, source: str, what: str = "gain") -> Acceptance:
        mine = self.per_slot.setdefault(slot, {})
        if (source, what) not in mine:
            parent = self.pooled.setdefault((source, what), self.make_acc())
            mine[(source, what)] = self.make_acc(parent)
        return mine[(source, what)]


def slot_weights(rates: list, fairness: float) -> list[float]:
    """Each slot's :attr:`SlotView.weight` from its request's recent tokens per second (None: not yet
    measured, weighed as the mean): ``(mean / rate_i) ** fairness`` over the measured slots, scaled to a
    mean of 1 (variant ``pf``: proportional fairness at 1, each round maximising the sum of the logs of
    the requests' rates to first order; Kelly, Maulloo & Tan, "Rate control for communication
    networks", 1998). All 1 with fewer than two slots, nothing measured, or ``fairness`` 0."""
    known = [r for r in rates if r is not None and r > 0]
    if len(rates) < 2 or not known or not fairness:
        return [1.0] * len(rates)
    mean = sum(known) / len(known)
    w = [(mean / r) ** fairness if r is not None and r > 0 else 1.0 for r in rates]
    m = sum(w) / len(w)
    return [x / m for x in w]


def simulate_phase(pl: SimPlanner, positions: dict | list, users: int, spec_type: str, n_max: int, choose_n: bool,
                   max_tokens: int, rng: random.Random, noise: float, chooser=None,
                   oracle: dict | None = None, explore=EXPLORE,
                   explore_slots=EXPLORE_SLOTS) -> tuple[float, int, dict]:
    """One bench phase: ``users`` closed-loop users decode one kind's prompts (``positions``: one
    prompt's trace, which every user decodes together, or a list of prompts' traces, cycled up to a
    multiple of ``users`` and taken from one queue as ``gemmaspec bench`` does). Returns (seconds,
    tokens, chosen)."""
    if chooser is None:  # the shipped choice: (views, costs, rate) -> Choice
        chooser = lambda views, costs, rate=None: choose(views, costs, rate=rate)  # noqa: E731
    prompts = positions if isinstance(positions, list) else [positions]
    todo = [prompts[i % len(prompts)] for i in range(-(-len(prompts) // users) * users)]  # the bench's requests_for
    mine: list[dict] = [{}] * users
    gen = [max_tokens] * users
    nxt = 0

    def start(s: int) -> None:  # slot s takes the queue's next request (its prefill made the first token)
        nonlocal nxt
        if nxt < len(todo):
            mine[s], gen[s], nxt = todo[nxt], 1, nxt + 1
            pl.new_request(s)
    for s in range(users):
        start(s)
    seconds, tokens, chosen = 0.0, 0, collections.Counter()

    def jitter() -> float:  # a machine's timing noise: lognormal, and a 1.5x stall in 2% of the parts
        return math.exp(rng.gauss(0.0, noise)) * (1.5 if rng.random() < 0.02 else 1.0) if noise > 0 else 1.0
    while True:
        live = [s for s in range(users) if gen[s] < max_tokens]
        if not live:
            break
        S = len(live)
        views, info = [], []
        for s in live:
            room = min(n_max, max_tokens - gen[s] - 1)
            ent = mine[s].get(str(gen[s])) if room > 0 else None
            drafted, acc, source = ent if ent else (0, 0, "")
            if ent and source not in ("ngram-simple", "draft-mtp"):  # traced before empty chain drafts were named
                source = "draft-mtp"
            model = source == "draft-mtp"
            if spec_type == "draft-mtp" or (ent and model):  # the model drafts: asked for n, drafts min(n, drafted)
                cap = room if ent else 0
                source = "draft-mtp"
            else:  # an n-gram copy of `drafted` tokens, free
                cap = min(room, drafted)
            v = SlotView(cap, (), source if model or spec_type == "draft-mtp" else "", True,
                         None if choose_n else min(n_max, cap))
            if choose_n and cap > 0:
                a = pl.acc(s, source)
                v.rates, v.plain = a.rates(cap, explore / len(live) ** explore_slots), a.rates(cap)
                if source == "draft-mtp":
                    v.cont = pl.acc(s, source, "cont").rates(cap)
                if oracle is not None:
                    v.rates = v.plain = oracle[(source, "gain")][:cap]
                    if source == "draft-mtp":
                        v.cont = oracle[(source, "cont")][:cap]
            views.append(v)
            info.append((s, drafted, acc, source, cap))
        planned = choose_n and any(v.cap > 0 for v in views)
        if planned and pl.pf:
            own = [pl.slot_rate.get(s) for s in live]
            for v, w in zip(views, slot_weights([r[0] / r[1] if r and r[1] > 0 else None for r in own], pl.pf)):
                v.weight = w
        if planned:
            ns = chooser(views, pl.cost, pl.rate_for(S)).ns
        else:
            ns = [v.fixed or 0 if v.fixed is not None else 0 for v in views]
        rows, tokens0 = S, tokens
        before = list(gen)
        steps = collections.Counter()
        model_drafted = False
        for (s, drafted, acc, source, cap), n in zip(info, ns):
            n = min(n, cap)
            d = min(n, drafted)
            a = min(d, acc)
            if choose_n and cap > 0:
                chosen[n] += 1
            rows += d
            if source == "draft-mtp" and n > 0:
                model_drafted = True
                for k in range(1, min(n, drafted + 1) + 1):  # step k runs while the slot still drafts
                    steps[k] += 1
            keep = min(a + 1, max_tokens - gen[s])
            gen[s] += keep
            tokens += keep
            if source and n:
                tried = max(d, n) if source == "draft-mtp" else d
                for what, got in (("gain", a), ("cont", d)) if source == "draft-mtp" else (("gain", a),):
                    pl.acc(s, source, what).update(tried, got)
                    pl.pooled[(source, what)].update(tried, got)
                for name, acc_ in pl.per_slot[s].items():
                    if name[0] != source:
                        acc_.tick()
            else:
                for acc_ in pl.per_slot[s].values():
                    acc_.tick()
        t_verify = pl.truth.verify(S, rows) * jitter()
        t_steps = 0.0
        for k, b in sorted(steps.items()):
            t = pl.truth.draft_step("draft-mtp", b) * jitter()
            pl.cost.observe_draft("draft-mtp", b, t)
            t_steps += t
        t_over = pl.truth.overhead(S, model_drafted) * jitter()
        pl.cost.observe_verify(S, rows, t_verify)
        pl.cost.observe_overhead(S, model_drafted, min(t_over, 0.25 * t_verify))
        seconds += t_verify + t_steps + t_over
        for (s, *_), n in zip(info, ns):
            r = pl.slot_rate.setdefault(s, [0.0, 0.0])
            r[0], r[1] = pl.pf_decay * r[0] + (gen[s] - before[s]), pl.pf_decay * r[1] + t_verify + t_steps + t_over
        if planned or pl.rate_all:
            pl.observe_rate(S, tokens - tokens0, t_verify + t_steps + t_over)
        for s in live:
            if gen[s] >= max_tokens:
                start(s)
    return seconds, tokens, chosen


class _FirstOnly(Acceptance):
    """Acceptance with the exploration bound on the first position only (the planner before
    2026-12-05's replays: variant ``ea=0``)."""

    def rates(self, k, explore=0.0):
        out = Acceptance.rates(self, k)
        if out and explore > 0:
            p = out[0]
            out[0] = min(1.0, p + explore * math.sqrt(p * (1.0 - p) / (self.reached[0] + 1.0)))
        return out


class _LineCost(CostModel):
    """verify(S, R): the calibrated shape plus a per-S level learned from every round of S slots."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.level = {}

    def observe_verify(self, seqs, rows, seconds):
        super().observe_verify(seqs, rows, seconds)
        off = seconds - self.calibrated(rows)
        old = self.level.get(seqs)
        self.level[seqs] = off if old is None else 0.9 * old + 0.1 * off

    def verify_seconds(self, seqs, rows):
        if seqs in self.level:
            return max(1e-6, self.calibrated(rows) + self.level[seqs])
        return super().verify_seconds(seqs, rows)


VARIANT = dict(w=PRIOR_WEIGHT, d=REQUEST_DECAY, pw=2.0, pd=0.99, e=EXPLORE, ea=1, es=EXPLORE_SLOTS, tol=0.01, line=0,
               lam=RATE_DECAY, lmin=RATE_MIN_ROUNDS, mono=1, fit=1, ld=LINE_DECAY, lc=LINE_CLIP, lp=LINE_PRIOR,
               lk=LINE_CELL_PRIOR, lall=0, lnew=RATE_NEW_REQUEST, pf=0.0, pfd=0.95, rf=0)
"""The shipped planner's parameters (``speculative/chooser.py``, ``planner.py``); ``before`` is
``w=1+ea=0+es=0+e=1+d=0.95+lam=0``, the planner before the replays; ``explore`` (``e=1+d=0.95+lam=0``) the
one tuned on them before the layers' int8 products made verify rows cheap; ``ratio`` (``lam=0``) each
round's own tokens per second maximised, as before the measured rate (lam: its decay per round, lmin:
rounds before it is used); mono=0: verify costs without the cap by wider rounds measured; fit=0: verify
costs from per-(slots, rows) means instead of each slot count's fitted line (ld, lc, lp, lk: the line's
decay, clip, slope prior and per-width offset prior, ``LINE_*`` in speculative/chooser.py); lall=1: the rate
measured over every round, not only the planned ones; lnew: the rates' weight kept when a request starts
(1: the planner before RATE_NEW_REQUEST); pf: each slot's tokens weighed by :func:`slot_weights` with this
exponent (proportional fairness at 1; 0, the shipped planner: every slot's tokens alike), pfd: the decay
per round of a request's own rate behind the weights; rf=1: the rate floored at the round's own ratio
without drafting (``RATE_FLOOR``)."""


def _variant(name: str):
    """The planner's parameters of a named variant: ``base`` (the shipped values) or ``k=v+k=v``
    overriding :data:`VARIANT`'s keys (w/d: a request's prior weight and decay; pw/pd: the pool's;
    e: exploration; ea: on every position; es: exploration divided by slots**es; tol: the chooser's
    tolerance; line: the per-slot-count level cost model)."""
    v = dict(VARIANT)
    if name == "before":
        name = "w=1+ea=0+es=0+e=1+d=0.95+lam=0"
    elif name == "explore":
        name = "e=1+d=0.95+lam=0"
    elif name == "ratio":
        name = "lam=0"
    if name not in ("base", "oracle"):
        for part in name.split("+"):
            k, val = part.split("=")
            if k not in VARIANT:
                raise KeyError(k)
            v[k] = float(val)
    acc_cls = Acceptance if v["ea"] else _FirstOnly
    cost_cls = _LineCost if v["line"] else CostModel
    if not v["mono"]:
        cost_cls = type("UnboundedCost", (cost_cls,), {"monotone": False})
    if not v["fit"]:
        cost_cls = type("CellCost", (cost_cls,), {"fit": False})
    cost_cls = type("TunedCost", (cost_cls,), {"line_decay": v["ld"], "line_clip": v["lc"], "line_prior": v["lp"],
                                               "line_cell_prior": v["lk"]})
    make = lambda parent=None: (acc_cls(MAX_DRAFT_TOKENS + 1, decay=v["d"], parent=parent, weight=v["w"])  # noqa: E731
                                if parent else Acceptance(MAX_DRAFT_TOKENS + 1, decay=v["pd"], weight=v["pw"]))
    return make, cost_cls, v


def _true_rates(pos: dict, spec_type: str, n: int = 3) -> dict:
    """Per drafter, the trace's conditional acceptance (``gain``: position i accepted given i-1 was; a
    model that stopped drafting counts as not accepted) and a model's continuation (``cont``: it drafted
    position i given it drafted i-1), every position of the output weighted alike: what a chooser that
    knew the text in advance would use (variant ``oracle``)."""
    out = {}
    for src in ("ngram-simple", "draft-mtp"):
        ents = [v for v in pos.values() if v[2] == src or (spec_type == "draft-mtp" and src == "draft-mtp")]
        gain, cont = [], []
        for i in range(n):
            reached = [v for v in ents if v[1] >= i]
            gain.append(sum(v[1] > i for v in reached) / len(reached) if reached else 0.0)
            drafted = [v for v in ents if v[0] >= i]
            cont.append(sum(v[0] > i for v in drafted) / len(drafted) if drafted else 0.0)
        out[(src, "gain")], out[(src, "cont")] = gain, cont
    return out


def _load(name: str, what: str) -> dict:
    """benchmarks/results/<name>.json, or a one-line exit saying which file is missing and what makes it."""
    path = ROOT / "benchmarks" / "results" / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: no {what} {path}: make it with `python benchmarks/chooser_sim.py "
                         f"{'trace' if what == 'trace' else 'costs'} --out {name}`") from None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: cannot read the {what} {path}: {exc}") from None


def sim(args) -> None:
    try:
        _variant(args.variant)
    except (ValueError, KeyError):
        raise SystemExit(f"error: --variant {args.variant!r}: use base, before, explore, ratio, oracle or key=value+... "
                         f"with keys {', '.join(VARIANT)}") from None
    if args.variant == "oracle" and args.mix:
        raise SystemExit("error: --variant oracle knows one prompt's rates: not with --mix")
    if args.truth_cells < 0:
        raise SystemExit(f"error: --truth-cells {args.truth_cells}: use 0 (every round on its line) or a sample count")
    tr = {"kinds": {}}
    for name in args.trace.split(","):  # several traces: their kinds side by side, or with --mix one kind's prompts
        one = _load(name, "trace")
        tr["max_tokens"] = one["max_tokens"]
        for kind, v in one["kinds"].items():
            if args.mix:
                got = tr["kinds"].setdefault(kind, {st: {"positions": []} for st in SPEC_TYPES})
                for st in SPEC_TYPES:
                    got[st]["positions"].append(v[st]["positions"])
            else:
                tr["kinds"][f"{kind}/{name}" if "," in args.trace else kind] = v
    truth = Truth(_load(args.costs, "costs file"), args.truth_cells)
    kinds = list(tr["kinds"])
    users = [int(u) for u in args.users.split(",")]
    configs = [(0, False), (1, False), (2, False), (3, False), (3, True)]
    res = collections.defaultdict(list)  # (spec, users, kind, label) -> [tokens/s per run]
    for run in range(args.runs):
        rng = random.Random(run)
        for st in SPEC_TYPES:
            make, cost, v = _variant(args.variant)
            pl = SimPlanner(truth, make, cost)
            pl.lam_decay, pl.lam_min, pl.rate_all, pl.rate_new = v["lam"], v["lmin"], bool(v["lall"]), v["lnew"]
            pl.pf, pl.pf_decay = v["pf"], v["pfd"]
            chooser = lambda views, c, r=None: choose(views, c, tolerance=v["tol"], rate=r, floor=bool(v["rf"]))  # noqa: E731
            for kind in kinds:
                pos = tr["kinds"][kind][st]["positions"]
                oracle = _true_rates(pos, st) if args.variant == "oracle" else None
                for u in users:
                    for n, ch in configs:
                        sec, tok, _ = simulate_phase(pl, pos, u, st, n, ch, tr["max_tokens"], rng, args.noise,
                                                         chooser, oracle, v["e"], v["es"])
                        res[(st, u, kind, f"choose{n}" if ch else str(n))].append(tok / sec)
    command = (f"python benchmarks/chooser_sim.py sim --trace {args.trace} --costs {args.costs} --runs {args.runs} "
               f"--noise {args.noise} --users {args.users} --variant {args.variant}"
               + (f" --truth-cells {args.truth_cells}" if args.truth_cells else "") + (" --mix" if args.mix else ""))
    lines = [f"# Simulated bench rounds: variant {args.variant} ({args.runs} runs, timing noise {args.noise})", "",
             f"`{command}`", "",
             "| drafter | users | chosen / best fixed (mean over kinds) | min | kinds < 0.97 | chosen vs none "
             "| chosen / best fixed of either drafter (mean, kinds < 0.97) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    summary = {}
    for st in SPEC_TYPES:
        for u in users:
            ratios, speed, overall = [], [], []
            for kind in kinds:
                m = {lab: statistics.mean(res[(st, u, kind, lab)]) for lab in ("0", "1", "2", "3", "choose3")}
                best = max(m[lab] for lab in ("0", "1", "2", "3"))
                ratios.append(m["choose3"] / best)
                speed.append(m["choose3"] / m["0"])
                any_best = max(statistics.mean(res[(t, u, kind, lab)]) for t in SPEC_TYPES for lab in ("0", "1", "2", "3"))
                overall.append(m["choose3"] / any_best)
            summary[f"{st}|{u}"] = {"ratio": ratios, "speedup": speed, "vs_any": overall}
            if args.per_kind:
                print(st, u, " ".join(f"{k}:{r:.2f}" for k, r in zip(kinds, ratios)))
            lines.append(f"| {st} | {u} | {statistics.mean(ratios):.3f} | {min(ratios):.3f} | "
                         f"{sum(r < 0.97 for r in ratios)} | {statistics.mean(speed):.2f}x | "
                         f"{statistics.mean(overall):.3f}, {sum(r < 0.97 for r in overall)} |")
    print("\n".join(lines))
    if args.out:
        write_results(args.out, {"machine": machine(), "command": command, "variant": args.variant,
                                 "trace": args.trace, "costs": args.costs, "runs": args.runs,
                                 "noise": args.noise, "kinds": kinds, "summary": summary}, "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--out", default="sim-trace")
    t.add_argument("--n-max", type=int, default=3)
    t.add_argument("--max-tokens", type=int, default=48)
    t.add_argument("--prompt", type=int, default=0, help="which prompt of each kind (0: the bench's first)")
    c = sub.add_parser("costs")
    c.add_argument("--out", default="sim-costs")
    c.add_argument("bench", nargs=argparse.REMAINDER, help="gemmaspec bench's arguments, after --")
    m = sub.add_parser("sim")
    m.add_argument("--trace", default="sim-trace")
    m.add_argument("--costs", default="sim-costs")
    m.add_argument("--runs", type=int, default=10)
    m.add_argument("--noise", type=float, default=0.05)
    m.add_argument("--users", default="1,2,4,8")
    m.add_argument("--out")
    m.add_argument("--variant", default="base")
    m.add_argument("--truth-cells", type=int, default=0,
                   help="a (slots, rows) measured at least this many times costs its own median (0: every round on "
                        "its slot count's fitted line)")
    m.add_argument("--per-kind", action="store_true")
    m.add_argument("--mix", action="store_true",
                   help="the traces are one kind's prompts each (--trace a,b,c): a phase's users take them from one "
                        "queue, as gemmaspec bench with --prompts-per-kind 3 does, instead of decoding one prompt together")
    a = ap.parse_args()
    {"trace": trace, "costs": costs, "sim": sim}[a.cmd](a)


if __name__ == "__main__":
    main()
