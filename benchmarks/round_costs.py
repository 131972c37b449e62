"""Where a planned server round's time goes: each part of ``RoundPlanner.begin`` (the slots' views, the
choice of draft lengths, the model drafters' batched drafting and its timed steps) and the target's
forward, per number of slots and per whether a model drafted, while ``gemmaspec bench`` runs in this
process; then the cost model each scheduler learned (calibration, verify table, draft steps, planning
time). The figures behind docs/server.md's "planning" term and "drafting as the server sees it".

    python benchmarks/round_costs.py --out NAME -- BENCH ARGS...
    e.g. python benchmarks/round_costs.py --out round-costs -- --spec-type draft-mtp \\
         --kinds chat,translate,story,qa --prompts-per-kind 1 --max-tokens 48 --repeats 1 --users 1,8 \\
         --spec-draft-n-max 3 --no-progress

Writes benchmarks/results/<out>.json and .md (machine: CPU model and SIMD flags); the bench's own
report goes where its ``--out`` says.
"""

from __future__ import annotations

import argparse
import collections
import time

from common import machine, write_results

import gemmaspec.speculative.planner as planner_mod
from gemmaspec.cli import main as gemmaspec_main

PARTS = collections.defaultdict(lambda: collections.defaultdict(float))  # (slots, drafted) -> part -> s
_cur: dict[str, float] = {}
_planners: dict[int, object] = {}


def _timed(obj, name: str, key: str) -> None:
    f = getattr(obj, name)

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            _cur[key] = _cur.get(key, 0.0) + time.perf_counter() - t

    setattr(obj, name, g)


def _instrument() -> None:
    RP = planner_mod.RoundPlanner
    _timed(RP, "_view", "view")
    _timed(planner_mod, "choose", "choose")
    _timed(RP, "_draft", "draft")
    observe, begin, finish = RP._observe_draft, RP.begin, RP.finish

    def observe_draft(self, source, rows, seconds, steps=1):
        _cur["steps"] = _cur.get("steps", 0.0) + seconds * steps
        return observe(self, source, rows, seconds, steps)

    def timed_begin(self, slots):
        _cur.clear()
        t = time.perf_counter()
        out = begin(self, slots)
        _cur["begin"] = time.perf_counter() - t
        _cur["to_drafted"] = self._t_drafted - self._t0
        part = PARTS[(len(slots), self._model_drafted)]
        part["rounds"] += 1
        for k, v in _cur.items():
            part[k] += v
        return out

    def timed_finish(self, seconds, finished):
        _planners[id(self)] = self
        PARTS[(len(self._plans), self._model_drafted)]["forward"] += seconds
        return finish(self, seconds, finished)

    RP._observe_draft, RP.begin, RP.finish = observe_draft, timed_begin, timed_finish


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="round_costs")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="gemmaspec bench's arguments, after --")
    a = ap.parse_args()
    bench = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    _instrument()
    try:
        gemmaspec_main(["bench", *bench])
    finally:
        rows, learned = [], []
        for (slots, drafted), p in sorted(PARTS.items()):
            n = p.pop("rounds")
            rows.append({"slots": slots, "model_drafted": drafted, "rounds": int(n),
                         **{k: v / n * 1e3 for k, v in p.items()}})
        for pl in _planners.values():
            c = pl._cost
            if c is not None:
                learned.append({"calibration_ms": [x * 1e3 for x in c.cal],
                                "verify_ms": {f"{s},{r}": v[0] * 1e3 for (s, r), v in sorted(c.verify.items())},
                                "draft_ms": {f"{s},{b}": v[0] * 1e3 for (s, b), v in sorted(c.draft.items())},
                                "planning_ms": {f"{s},{d}": v[0] * 1e3 for (s, d), v in sorted(c.overhead.items())}})
        m = machine()
        lines = [f"# Where a planned round's time goes (gemmaspec bench {' '.join(bench)})", "",
                 f"Machine: {m.get('cpu', '?')}. Milliseconds per round, means over the rounds of each kind: "
                 "`to drafted` is the round's start to the end of drafting (what the cost model's planning "
                 "term learns, less `steps`); `begin` all of ``RoundPlanner.begin`` (the requests' round setup "
                 "too); `forward` the target's forward and verification.", "",
                 "| slots | a model drafted | rounds | views | choice | drafting | of it, timed steps | to drafted | begin | forward |",
                 "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['slots']} | {'yes' if r['model_drafted'] else 'no'} | {r['rounds']} | "
                         f"{r.get('view', 0):.3f} | {r.get('choose', 0):.3f} | {r.get('draft', 0):.3f} | "
                         f"{r.get('steps', 0):.3f} | {r.get('to_drafted', 0):.3f} | {r.get('begin', 0):.3f} | "
                         f"{r.get('forward', 0):.2f} |")
        write_results(a.out, {"machine": m, "bench_args": bench, "rounds": rows, "learned": learned},
                      "\n".join(lines))


if __name__ == "__main__":
    main()
