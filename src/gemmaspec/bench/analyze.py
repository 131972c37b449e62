"""Figures from the raw runs of ``results.json``: speed, latency, acceptance, speedup, crossover,
lossless check. Pure functions of the recorded data (no timing here), so a report can be redrawn
from a results file alone.

Definitions (every figure in the report):

- aggregate tokens/s of a phase: completion tokens of all its requests / the phase's wall time (from
  the first request sent to the last answer); over repeats, the median.
- per-user tokens/s of a request: (completion tokens - 1) / (last token's arrival - first token's),
  the decode speed one user sees; the median over the requests.
- TTFT: request sent → first token. ITL (inter-token latency): tokens arriving within 1 ms of each
  other count as one delivery (a speculative round delivers several at once); each token of a
  delivery gets (time since the previous delivery) / (tokens in it); p50 / p95 over tokens.
- acceptance rate: accepted draft tokens / drafted; mean accepted length: 1 + accepted / verify
  steps (tokens per target forward that had drafts); acceptance at draft position i: rounds that
  kept the draft at i / rounds that drafted one at i (from ``/metrics``: / verify steps, vLLM's
  definition).
- speedup: a configuration's figure / the same target's no-speculation (``none``) figure for the same
  kind and user count; peer ratio: ours / the peer's, same configuration, kind and users.
"""

from __future__ import annotations

import statistics

ALL = "all"
ITL_MERGE_S = 0.001
PAYS = 1.0  # speculation pays while aggregate tokens/s with it / without it > PAYS


def percentile(xs, q: float):
    """Nearest-rank percentile (q in 0..1) of a non-empty list; None for an empty one."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def itl_samples(arrivals) -> list[float]:
    """Per-token inter-token latencies (seconds) from ``[[t, n], ...]`` arrivals (see module doc)."""
    merged = []
    for t, n in arrivals:
        if merged and t - merged[-1][0] < ITL_MERGE_S:
            merged[-1][1] += n
            merged[-1][0] = t
        else:
            merged.append([t, n])
    out = []
    for (t0, _), (t1, n) in zip(merged, merged[1:]):
        out += [(t1 - t0) / n] * n
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def _spec_totals(phases) -> dict | None:
    """Pooled acceptance counters of phases (per-request counters, else the phases' /metrics deltas)."""
    d = a = 0.0
    steps = 0.0
    steps_known = True
    dpos: list[float] = []
    apos: list[float] = []
    pos_by_steps = False
    seen = False
    for ph in phases:
        reqs = [r["spec"] for r in ph["requests"] if r.get("spec")]
        if reqs:
            seen = True
            for s in reqs:
                d += s.get("draft_n", 0)
                a += s.get("draft_n_accepted", 0)
                if "verify_steps" in s:
                    steps += s["verify_steps"]
                else:
                    steps_known = False
                for lst, key in ((dpos, "drafted_per_pos"), (apos, "accepted_per_pos")):
                    for i, v in enumerate(s.get(key) or []):
                        while len(lst) <= i:
                            lst.append(0.0)
                        lst[i] += v
        elif ph.get("metrics_delta"):
            m = ph["metrics_delta"]
            seen = True
            d += m.get("draft_n", 0)
            a += m.get("draft_n_accepted", 0)
            if "verify_steps" in m:
                steps += m["verify_steps"]
                for i, v in enumerate(m.get("accepted_per_pos") or []):
                    while len(apos) <= i:
                        apos.append(0.0)
                    apos[i] += v
                pos_by_steps = True
            else:
                steps_known = False
    if not seen:
        return None
    if pos_by_steps and not dpos:
        per_pos = [v / steps if steps else None for v in apos]
    else:
        per_pos = [apos[i] / dpos[i] if i < len(apos) and dpos[i] else 0.0 for i in range(len(dpos))]
    return {"draft_n": d, "draft_n_accepted": a, "acceptance_rate": a / d if d else None,
            "mean_accepted_length": (1 + a / steps if steps else None) if steps_known else None,
            "acceptance_per_pos": per_pos}


def cell(phases) -> dict:
    """Figures of one (target, configuration, kind or all, users) cell from its phases."""
    by_rep: dict[int, list] = {}
    for ph in phases:
        by_rep.setdefault(ph["repeat"], []).append(ph)
    agg = []
    for reps in by_rep.values():  # all kinds of a repeat: total tokens / total wall time
        toks = sum(r["completion_tokens"] for ph in reps for r in ph["requests"])
        wall = sum(ph["wall_s"] for ph in reps)
        agg.append(toks / wall if wall > 0 else None)
    reqs = [r for ph in phases for r in ph["requests"]]
    per_user = [(r["completion_tokens"] - 1) / r["decode_s"] for r in reqs
                if r["completion_tokens"] > 1 and r["decode_s"] > 0]
    itl = [x for r in reqs for x in itl_samples(r["arrivals"])]
    ttft = [r["ttft_s"] for r in reqs]
    out = {"phases": len(phases), "requests": len(reqs),
           "completion_tokens": sum(r["completion_tokens"] for r in reqs),
           "aggregate_tps": _median(agg), "per_user_tps": _median(per_user),
           "ttft_p50_ms": _ms(percentile(ttft, 0.5)), "ttft_p95_ms": _ms(percentile(ttft, 0.95)),
           "itl_p50_ms": _ms(percentile(itl, 0.5)), "itl_p95_ms": _ms(percentile(itl, 0.95)),
           "spec": _spec_totals(phases)}
    mem = [ph.get("memory", {}).get("peak_rss_mib") for ph in phases]
    if any(m is not None for m in mem):
        out["peak_rss_mib"] = max(m for m in mem if m is not None)
    gpu = [ph.get("memory", {}).get("gpu_peak_mib") for ph in phases]
    if any(g is not None for g in gpu):
        out["gpu_peak_mib"] = max(g for g in gpu if g is not None)
    return out


def _ms(s):
    return s * 1e3 if s is not None else None


def summarize(results: dict) -> dict:
    """``{"cells": [...], "crossover": {...}, "peer": [...]}`` from ``results["phases"]``.

    Each cell: target, config, kind (a suite kind or ``all``), users, the :func:`cell` figures,
    ``speedup_aggregate`` and ``speedup_per_user`` against the target's ``none`` cell of the same kind
    and users (None when that was not measured)."""
    phases = results.get("phases", [])
    kinds = {ph["kind"] for ph in phases}
    covered: dict[tuple, set] = {}  # an interrupted repeat that lacks some kinds stays out of "all"
    for ph in phases:
        covered.setdefault((ph["target"], ph["config"], ph["users"], ph["repeat"]), set()).add(ph["kind"])
    groups: dict[tuple, list] = {}
    for ph in phases:
        groups.setdefault((ph["target"], ph["config"], ph["kind"], ph["users"]), []).append(ph)
        if covered[(ph["target"], ph["config"], ph["users"], ph["repeat"])] == kinds:
            groups.setdefault((ph["target"], ph["config"], ALL, ph["users"]), []).append(ph)
    cells = {k: cell(v) | {"target": k[0], "config": k[1], "kind": k[2], "users": k[3]} for k, v in groups.items()}
    for key, c in cells.items():
        base = cells.get((key[0], "none", key[2], key[3]))
        c["speedup_aggregate"] = _ratio(c["aggregate_tps"], base["aggregate_tps"]) if base else None
        c["speedup_per_user"] = _ratio(c["per_user_tps"], base["per_user_tps"]) if base else None
    out = sorted(cells.values(), key=lambda c: (c["target"], c["kind"] != ALL, c["kind"], c["users"],
                                                c["config"] != "none", c["config"]))
    peer = []
    targets = list(dict.fromkeys(ph["target"] for ph in phases))
    if len(targets) > 1:
        ours = targets[0]
        for other in targets[1:]:
            for (t, cfg, kind, users), c in cells.items():
                o = cells.get((other, cfg, kind, users))
                if t == ours and o:
                    peer.append({"config": cfg, "kind": kind, "users": users, "peer": other,
                                 "aggregate_ratio": _ratio(c["aggregate_tps"], o["aggregate_tps"]),
                                 "per_user_ratio": _ratio(c["per_user_tps"], o["per_user_tps"])})
    return {"cells": out, "crossover": {t: crossover(out, t) for t in targets}, "peer": peer}


def crossover(cells: list[dict], target: str) -> dict:
    """Per kind (and ``all``): the smallest user count from which speculation stops paying, i.e. the
    best speculative configuration's aggregate tokens/s is at most :data:`PAYS` times the
    no-speculation run's at that count and every larger count measured.

    Returns ``{kind: {"stops_at": users or None, "never_paid": bool, "best": {users: [config, speedup]}}}``
    (``stops_at`` None: it paid at every count measured, or nothing to compare)."""
    out = {}
    kinds = list(dict.fromkeys(c["kind"] for c in cells if c["target"] == target))
    for kind in kinds:
        best: dict[int, list] = {}
        for c in cells:
            if c["target"] != target or c["kind"] != kind or c["config"] == "none" or c["speedup_aggregate"] is None:
                continue
            b = best.get(c["users"])
            if b is None or c["speedup_aggregate"] > b[1]:
                best[c["users"]] = [c["config"], c["speedup_aggregate"]]
        users = sorted(best)
        stops = None
        for i, u in enumerate(users):
            if all(best[v][1] <= PAYS for v in users[i:]):
                stops = u
                break
        out[kind] = {"stops_at": stops, "never_paid": bool(users) and stops == users[0], "best": best,
                     "users": users}
    return out


def crossover_sentence(cross: dict, target: str) -> str:
    """One sentence: at how many users speculation stops paying, overall and per kind."""
    def say(c) -> str | None:
        if not c or not c["users"]:
            return None
        if c["never_paid"]:
            return "never paid, even for one user"
        if c["stops_at"] is None:
            return f"pays at every count measured (up to {max(c['users'])})"
        return f"stops paying at {c['stops_at']} concurrent users"

    overall = say(cross.get(ALL))
    groups: dict[str, list] = {}
    for kind, c in cross.items():
        if kind != ALL and say(c):
            groups.setdefault(say(c), []).append(kind)
    if overall is None and not groups:
        return f"{target}: no speculative run to compare with a no-speculation run, so no crossover."
    s = f"For {target}, speculation (the best draft length at each user count) "
    s += f"{overall} over all kinds" if overall else "was compared per kind only"
    if groups:
        s += "; by kind, it " + "; it ".join(f"{what} for {', '.join(ks)}" for what, ks in groups.items())
    return s + "."


def lossless(results: dict, margin=None) -> list[dict]:
    """At temperature 0, every output against the target's no-speculation output of the same prompt
    (its first ``none`` request). Returns the mismatches, one per (target, config, users, kind,
    prompt index, first differing position), with ``count`` (repeats that showed it), ``unit``
    (``token`` where ids are known, else ``char``) and, when ``margin(target, kind, index, prefix)``
    is given and ids are known, the no-speculation run's top-2 logit margin at that position."""
    ref: dict[tuple, dict] = {}
    for ph in results.get("phases", []):
        if ph["config"] == "none":
            for r in ph["requests"]:
                ref.setdefault((ph["target"], ph["kind"], r["index"]), r)
    found: dict[tuple, dict] = {}
    for ph in results.get("phases", []):
        for r in ph["requests"]:
            b = ref.get((ph["target"], ph["kind"], r["index"]))
            if b is None or b is r:
                continue
            unit = "token" if r.get("tokens") is not None and b.get("tokens") is not None else "char"
            x, y = (r["tokens"], b["tokens"]) if unit == "token" else (r["text"], b["text"])
            pos = first_difference(x, y)
            if pos is None:
                continue
            key = (ph["target"], ph["config"], ph["users"], ph["kind"], r["index"], pos)
            if key in found:
                found[key]["count"] += 1
                continue
            m = {"target": ph["target"], "config": ph["config"], "users": ph["users"], "kind": ph["kind"],
                 "index": r["index"], "position": pos, "unit": unit, "count": 1,
                 "got": _piece(x, pos), "expected": _piece(y, pos)}
            if margin is not None and unit == "token":
                m["top2_margin"] = margin(ph["target"], ph["kind"], r["index"], y[:pos])
            found[key] = m
    return list(found.values())


def _piece(seq, pos):
    return seq[pos] if pos < len(seq) else None


def first_difference(a, b) -> int | None:
    """First index where two sequences differ (the shorter one's length when one is a prefix of the
    other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
