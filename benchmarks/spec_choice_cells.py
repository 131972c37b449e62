"""Per kind and user count, how the draft lengths chosen per round compare with the best fixed
configuration a user could have picked, from a ``gemmaspec bench`` results.json: both the plain ratio
of medians (biased against the chosen lengths: the best of several noisy medians is high) and a
held-out one (the best fixed configuration picked on all repeats but one, judged on that one, each
repeat held out in turn, averaged). The figures behind docs/server.md's per-kind comparison.

And what the run can resolve (``noise floor``): from the run's own repeats, the timing noise of a phase
(log tokens/s = configuration + a shift shared by the phases of one kind, user count and repeat + the
phase's own noise; each pooled per user count), then many simulated runs in which the chosen lengths are
exactly as fast as the best fixed configuration: how many cells such a perfect choice would still put
below the goal by each comparison, and how often none. The measured means stand for the true ones
(their spread is wider than the truth's, which makes the best of several less lucky: the floor is if
anything low).

    python benchmarks/spec_choice_cells.py RESULTS.json [--chosen "ngram-simple,draft-mtp n=choose3"]
                                           [--goal 0.97] [--floor-runs 400] [--out NAME]

Needs at least 2 repeats. Writes benchmarks/results/<out>.json and .md when --out is given.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random
import statistics as st

from common import write_results


def _held_out(chosen: dict, fixed: dict) -> float:
    """Mean over repeats r of chosen[r] / (the fixed configuration with the best mean on the other repeats)[r]."""
    got = []
    for r in chosen:
        pick = max(fixed, key=lambda c: st.mean(v for k, v in fixed[c].items() if k != r))
        got.append(chosen[r] / fixed[pick][r])
    return st.mean(got)


def phase_noise(cells: dict) -> dict:
    """Per user count, the standard deviations (natural log of tokens/s) of a phase's own noise and of
    the shift shared by one (kind, users, repeat)'s phases, from a two-way fit per cell (configuration +
    repeat) pooled over the cells: ``{users: (own, shared)}``. ``cells``: (kind, users) -> config ->
    repeat -> tokens/s, every configuration of a cell on the same repeats (at least 2)."""
    own, shared = collections.defaultdict(list), collections.defaultdict(list)
    for (_, users), cfg in cells.items():
        reps = sorted(next(iter(cfg.values())))
        x = {c: {r: math.log(cfg[c][r]) for r in reps} for c in cfg}
        mu = {c: st.mean(x[c].values()) for c in cfg}
        shift = {r: st.mean(x[c][r] - mu[c] for c in cfg) for r in reps}
        e2 = sum((x[c][r] - mu[c] - shift[r]) ** 2 for c in cfg for r in reps) / ((len(cfg) - 1) * (len(reps) - 1))
        own[users].append(e2)
        # the shifts' spread less what the phases' own noise puts in them (each a mean over len(cfg) phases)
        shared[users].append(sum(v * v for v in shift.values()) / (len(reps) - 1) - e2 / len(cfg))
    out = {}
    for u in own:
        out[u] = (math.sqrt(st.mean(own[u])), math.sqrt(max(0.0, st.mean(shared[u]))))
    return out


def noise_floor(cells: dict, chosen: str, goal: float, runs: int = 400, seed: int = 0) -> dict:
    """A perfect choice's cells below ``goal``: simulated runs (``runs``, seeded) of the same cells,
    configurations and repeats, each phase drawn around its measured mean with :func:`phase_noise`'s
    noise, the chosen configuration drawn around the best fixed one's mean. Returns ``{"medians",
    "held_out"}``: the mean number of cells below by each comparison, ``{"p_none_medians", "p_none_held_out"}``:
    the share of runs with none below, and ``noise``: :func:`phase_noise`'s figures."""
    noise = phase_noise(cells)
    rng = random.Random(seed)
    below_m, below_h = [], []
    for _ in range(runs):
        bm = bh = 0
        for (_, users), cfg in cells.items():
            own, shared = noise[users]
            fixed = [c for c in cfg if _is_fixed(c)]
            reps = sorted(cfg[chosen])
            mu = {c: st.mean(math.log(v) for v in cfg[c].values()) for c in fixed}
            best = max(fixed, key=mu.get)
            shift = {r: rng.gauss(0.0, shared) for r in reps}
            draw = {c: {r: math.exp(mu[c] + shift[r] + rng.gauss(0.0, own)) for r in reps} for c in fixed}
            perfect = {r: math.exp(mu[best] + shift[r] + rng.gauss(0.0, own)) for r in reps}
            bm += st.median(perfect.values()) / max(st.median(d.values()) for d in draw.values()) < goal
            bh += _held_out(perfect, draw) < goal
        below_m.append(bm)
        below_h.append(bh)
    return {"medians": st.mean(below_m), "held_out": st.mean(below_h),
            "p_none_medians": sum(b == 0 for b in below_m) / runs, "p_none_held_out": sum(b == 0 for b in below_h) / runs,
            "noise": {u: {"own": round(a, 4), "shared": round(b, 4)} for u, (a, b) in sorted(noise.items())}}


def _is_fixed(config: str) -> bool:
    return "choose" not in config and config != "auto" and not config.endswith("n=auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--chosen", default="ngram-simple,draft-mtp n=choose3", help="the configuration judged")
    ap.add_argument("--goal", type=float, default=0.97)
    ap.add_argument("--floor-runs", type=int, default=400, help="simulated runs behind the noise floor (0: none)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    data = json.loads(open(a.results).read())
    cells = collections.defaultdict(lambda: collections.defaultdict(dict))  # (kind, users) -> config -> repeat -> tok/s
    for p in data["phases"]:
        tokens = sum(r["completion_tokens"] for r in p["requests"])
        cells[(p["kind"], p["users"])][p["config"]][p["repeat"]] = tokens / p["wall_s"]
    rows = []
    for (kind, users), cfg in sorted(cells.items()):
        if a.chosen not in cfg:
            raise SystemExit(f"{a.results} has no configuration {a.chosen!r}: it has {', '.join(sorted(cfg))}")
        fixed = [c for c in cfg if _is_fixed(c)]
        if "none" not in fixed or len(fixed) < 2:
            raise SystemExit(f"{a.results}: {kind} at {users} user(s) needs no speculation and a fixed draft length "
                             f"to compare with (--spec-draft-n-max 0,1,...,chooseN); it has {', '.join(sorted(cfg))}")
        reps = sorted(cfg[a.chosen])
        if len(reps) < 2:
            raise SystemExit("the held-out comparison needs at least 2 repeats (--repeats in gemmaspec bench)")
        if any(sorted(cfg[c]) != reps for c in fixed):
            raise SystemExit(f"{a.results}: {kind} at {users} user(s) lacks a repeat of some configuration "
                             "(an interrupted run?): compare complete runs")
        med = {c: st.median(cfg[c].values()) for c in fixed + [a.chosen]}
        best = max(fixed, key=lambda c: med[c])
        rows.append({"kind": kind, "users": users, "chosen_vs_none": med[a.chosen] / med["none"],
                     "best_fixed": best, "best_vs_none": med[best] / med["none"],
                     "median_ratio": med[a.chosen] / med[best],
                     "held_out_ratio": _held_out(cfg[a.chosen], {c: cfg[c] for c in fixed})})
    below_m = sum(r["median_ratio"] < a.goal for r in rows)
    below_h = sum(r["held_out_ratio"] < a.goal for r in rows)
    lines = [f"# {a.chosen} against the best fixed configuration, per kind ({a.results})", "",
             "| kind | users | chosen vs none | best fixed | its vs none | chosen / best (medians) | chosen / best (held out) |",
             "|---|---:|---:|---|---:|---:|---:|"]
    lines += [f"| {r['kind']} | {r['users']} | {r['chosen_vs_none']:.2f}x | {r['best_fixed']} | {r['best_vs_none']:.2f}x | "
              f"{r['median_ratio']:.3f} | {r['held_out_ratio']:.3f} |" for r in rows]
    lines += ["", f"Cells below {a.goal}: {below_m} of {len(rows)} by medians, {below_h} by the held-out comparison "
              f"(mean {st.mean(r['held_out_ratio'] for r in rows):.3f})."]
    floor = None
    if a.floor_runs > 0:
        floor = noise_floor({k: {c: v for c, v in cfg.items() if _is_fixed(c) or c == a.chosen}
                             for k, cfg in cells.items()}, a.chosen, a.goal, a.floor_runs)
        sig = ", ".join(f"{u} user(s) {100 * v['own']:.1f}% + {100 * v['shared']:.1f}%" for u, v in floor["noise"].items())
        lines += ["", f"Noise floor: a choice exactly as fast as the best fixed configuration would put "
                  f"{floor['medians']:.1f} of {len(rows)} cells below {a.goal} by medians and {floor['held_out']:.1f} "
                  f"held out, and no cell below in {100 * floor['p_none_medians']:.1f}% / {100 * floor['p_none_held_out']:.1f}% "
                  f"of {a.floor_runs} simulated runs (this run's noise per phase, own + shared by a kind's "
                  f"repeat: {sig})."]
    table = "\n".join(lines)
    if a.out:
        write_results(a.out, {"results": a.results, "chosen": a.chosen, "cells": rows, "noise_floor": floor}, table)
    else:
        print(table)


if __name__ == "__main__":
    main()
