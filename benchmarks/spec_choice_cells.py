"""Per kind and user count, how the draft lengths chosen per round compare with the best fixed
configuration a user could have picked, from a ``gemmaspec bench`` results.json: both the plain ratio
of medians (biased against the chosen lengths: the best of several noisy medians is high) and a
held-out one (the best fixed configuration picked on all repeats but one, judged on that one, each
repeat held out in turn, averaged). The figures behind docs/server.md's per-kind comparison.

    python benchmarks/spec_choice_cells.py RESULTS.json [--chosen "ngram-simple,draft-mtp n=choose3"]
                                           [--goal 0.97] [--out NAME]

Needs at least 2 repeats. Writes benchmarks/results/<out>.json and .md when --out is given.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics as st

from common import write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--chosen", default="ngram-simple,draft-mtp n=choose3", help="the configuration judged")
    ap.add_argument("--goal", type=float, default=0.97)
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
        fixed = [c for c in cfg if "choose" not in c and c != "auto" and not c.endswith("n=auto")]
        reps = sorted(cfg[a.chosen])
        if len(reps) < 2:
            raise SystemExit("the held-out comparison needs at least 2 repeats (--repeats in gemmaspec bench)")
        med = {c: st.median(cfg[c].values()) for c in fixed + [a.chosen]}
        best = max(fixed, key=lambda c: med[c])
        held = []
        for r in reps:
            pick = max(fixed, key=lambda c: st.mean(v for k, v in cfg[c].items() if k != r))
            held.append(cfg[a.chosen][r] / cfg[pick][r])
        rows.append({"kind": kind, "users": users, "chosen_vs_none": med[a.chosen] / med["none"],
                     "best_fixed": best, "best_vs_none": med[best] / med["none"],
                     "median_ratio": med[a.chosen] / med[best], "held_out_ratio": st.mean(held)})
    below_m = sum(r["median_ratio"] < a.goal for r in rows)
    below_h = sum(r["held_out_ratio"] < a.goal for r in rows)
    lines = [f"# {a.chosen} against the best fixed configuration, per kind ({a.results})", "",
             "| kind | users | chosen vs none | best fixed | its vs none | chosen / best (medians) | chosen / best (held out) |",
             "|---|---:|---:|---|---:|---:|---:|"]
    lines += [f"| {r['kind']} | {r['users']} | {r['chosen_vs_none']:.2f}x | {r['best_fixed']} | {r['best_vs_none']:.2f}x | "
              f"{r['median_ratio']:.3f} | {r['held_out_ratio']:.3f} |" for r in rows]
    lines += ["", f"Cells below {a.goal}: {below_m} of {len(rows)} by medians, {below_h} by the held-out comparison "
              f"(mean {st.mean(r['held_out_ratio'] for r in rows):.3f})."]
    table = "\n".join(lines)
    if a.out:
        write_results(a.out, {"results": a.results, "chosen": a.chosen, "cells": rows}, table)
    else:
        print(table)


if __name__ == "__main__":
    main()
