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
- spread of a speedup: the range (min to max) of its per-repeat ratios, each repeat's figure over the
  same repeat's no-speculation figure (widened to include the median ratio itself).
- within noise: a speedup within :data:`NOISE` of 1.0, or whose spread includes 1.0
  (:func:`within_noise`); the crossover counts only speedups outside noise as paying.
"""

from __future__ import annotations

import statistics

ALL = "all"
ITL_MERGE_S = 0.001
PAYS = 1.0  # speculation pays while aggregate tokens/s with it / without it > PAYS (and outside noise)
NOISE = 0.03  # a speedup within 3% of 1.0 is no measurable difference on a shared machine


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


def _per_user(reqs) -> list[float]:
    return [(r["completion_tokens"] - 1) / r["decode_s"] for r in reqs
            if r["completion_tokens"] > 1 and r["decode_s"] > 0]


def cell(phases) -> dict:
    """Figures of one (target, configuration, kind or all, users) cell from its phases.

    Besides the medians, ``aggregate_tps_by_repeat`` and ``per_user_tps_by_repeat`` (``[[repeat,
    value], ...]``, the spread and the per-repeat speedups come from them) and ``aggregate_tps_range``
    (``[min, max]`` over repeats)."""
    by_rep: dict[int, list] = {}
    for ph in phases:
        by_rep.setdefault(ph["repeat"], []).append(ph)
    agg_rep, pu_rep = [], []
    for rep in sorted(by_rep):  # all kinds of a repeat: total tokens / total wall time
        reps = by_rep[rep]
        toks = sum(r["completion_tokens"] for ph in reps for r in ph["requests"])
        wall = sum(ph["wall_s"] for ph in reps)
        agg_rep.append([rep, toks / wall if wall > 0 else None])
        pu_rep.append([rep, _median(_per_user([r for ph in reps for r in ph["requests"]]))])
    agg = [v for _, v in agg_rep]
    reqs = [r for ph in phases for r in ph["requests"]]
    per_user = _per_user(reqs)
    itl = [x for r in reqs for x in itl_samples(r["arrivals"])]
    ttft = [r["ttft_s"] for r in reqs]
    out = {"phases": len(phases), "requests": len(reqs),
           "completion_tokens": sum(r["completion_tokens"] for r in reqs),
           "aggregate_tps": _median(agg), "per_user_tps": _median(per_user),
           "aggregate_tps_by_repeat": agg_rep, "per_user_tps_by_repeat": pu_rep,
           "aggregate_tps_range": _range([v for v in agg if v is not None]),
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


def _range(xs, include=None):
    xs = [x for x in xs if x is not None] + ([include] if include is not None else [])
    return [min(xs), max(xs)] if xs else None


def _paired(c: dict, base: dict, key: str, median) -> list | None:
    """Spread of a speedup: ``[min, max]`` of the per-repeat ratios (repeats both cells have), widened
    to include ``median`` (the ratio of the medians)."""
    b = {rep: v for rep, v in base.get(key) or []}
    ratios = [_ratio(v, b.get(rep)) for rep, v in c.get(key) or []]
    return _range(ratios, median) if median is not None else None


def within_noise(speedup, spread=None) -> bool:
    """True when ``speedup`` is no measurable difference: within :data:`NOISE` of 1.0, or its spread
    (``[min, max]`` over repeats) includes 1.0."""
    if speedup is None:
        return False
    if abs(speedup - PAYS) <= NOISE + 1e-9:
        return True
    return bool(spread) and spread[0] <= PAYS <= spread[1]


def verdict(speedup, spread=None) -> str | None:
    """``"pays"`` (above 1 and outside noise), ``"noise"`` (:func:`within_noise`) or ``"costs"``
    (below 1 and outside noise); None without a speedup."""
    if speedup is None:
        return None
    if within_noise(speedup, spread):
        return "noise"
    return "pays" if speedup > PAYS else "costs"


def summarize(results: dict) -> dict:
    """``{"cells": [...], "crossover": {...}, "peer": [...]}`` from ``results["phases"]``.

    Each cell: target, config, kind (a suite kind or ``all``), users, the :func:`cell` figures,
    ``speedup_aggregate`` and ``speedup_per_user`` against the target's ``none`` cell of the same kind
    and users (None when that was not measured), and their spreads ``speedup_aggregate_range`` and
    ``speedup_per_user_range`` (``[min, max]``, see :func:`_paired`)."""
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
        for which in ("aggregate", "per_user"):
            c[f"speedup_{which}_range"] = (_paired(c, base, f"{which}_tps_by_repeat", c[f"speedup_{which}"])
                                           if base else None)
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
    best speculative configuration's aggregate speedup is not above :data:`PAYS` outside noise
    (:func:`verdict` is not ``"pays"``) at that count and every larger count measured. A dip that
    recovers at more users is not a crossover.

    Returns ``{kind: {"stops_at": users or None, "never_paid": bool, "users": [...], "best": {users:
    [config, speedup, spread, verdict]}}}`` (``stops_at`` None: it pays outside noise at the largest
    count, or nothing to compare)."""
    out = {}
    kinds = list(dict.fromkeys(c["kind"] for c in cells if c["target"] == target))
    for kind in kinds:
        best: dict[int, list] = {}
        for c in cells:
            if c["target"] != target or c["kind"] != kind or c["config"] == "none" or c["speedup_aggregate"] is None:
                continue
            b = best.get(c["users"])
            if b is None or c["speedup_aggregate"] > b[1]:
                spread = c.get("speedup_aggregate_range")
                best[c["users"]] = [c["config"], c["speedup_aggregate"], spread,
                                    verdict(c["speedup_aggregate"], spread)]
        users = sorted(best)
        stops = None
        for i, u in enumerate(users):
            if all(best[v][3] != "pays" for v in users[i:]):
                stops = u
                break
        out[kind] = {"stops_at": stops, "never_paid": bool(users) and stops == users[0], "best": best,
                     "users": users}
    return out


def _users(u: int) -> str:
    return f"{u} user{'s' if u != 1 else ''}"


def _say(c: dict | None) -> str | None:
    """What speculation does for one kind, in words (grouped across kinds by the sentence)."""
    if not c or not c["users"]:
        return None
    us = c["users"]
    verdicts = [c["best"][u][3] for u in us]
    if c["stops_at"] is None:
        return f"pays at {_users(us[0])}" if len(us) == 1 else f"pays at every count measured (up to {max(us)})"
    if all(v == "noise" for v in verdicts):
        return (f"is within noise at {_users(us[0])} (no measurable difference)" if len(us) == 1 else
                f"is within noise at every count measured (up to {max(us)})")
    if c["never_paid"]:
        if len(us) == 1:
            return f"costs at {_users(us[0])}"
        return "never paid, even for one user" if us[0] == 1 else f"never paid, even at {_users(us[0])}"
    return f"stops paying at {c['stops_at']} concurrent users"


def _best_by_count(c: dict) -> str:
    """``(best: 1.90x at 1 user, ~0.98x at 8 users)``: the best speedup at each count, ``~`` within noise."""
    parts = []
    for u in c["users"]:
        b = c["best"][u]
        parts.append(f"{'~' if b[3] == 'noise' else ''}{b[1]:.2f}x at {_users(u)}")
    return f" (best: {', '.join(parts)})"


def crossover_sentence(cross: dict, target: str) -> str:
    """One sentence: at how many users speculation stops paying, overall and per kind. Only a speedup
    outside noise (:func:`verdict`) counts as paying; ``~`` marks a best speedup within noise."""
    overall = _say(cross.get(ALL))
    groups: dict[str, list] = {}
    for kind, c in cross.items():
        if kind != ALL and _say(c):
            groups.setdefault(_say(c), []).append(kind)
    if overall is None and not groups:
        return f"{target}: no speculative run to compare with a no-speculation run, so no crossover."
    s = f"For {target}, speculation (the best draft length at each user count) "
    s += f"{overall} over all kinds{_best_by_count(cross[ALL])}" if overall else "was compared per kind only"
    if groups:
        s += "; by kind, it " + "; it ".join(f"{what} for {', '.join(ks)}" for what, ks in groups.items())
    return s + "."


def chosen_where_it_stops(cells: list[dict], cross: dict, target: str) -> str:
    """One sentence: where speculation stops paying (:func:`crossover`'s ``stops_at`` and every larger
    user count, per kind and over all kinds), what each configuration that chooses its draft lengths per
    round (``n=choose...``, the server's default way) gave against no speculation there, and whether it
    lost outside noise (:func:`verdict` ``"costs"``). "" when speculation pays at every count or nothing
    chose its lengths."""
    chosen = list(dict.fromkeys(c["config"] for c in cells if c["target"] == target and "n=choose" in c["config"]))
    spots = [(kind, u) for kind, c in cross.items() if c.get("stops_at") is not None
             for u in c["users"] if u >= c["stops_at"]]
    if not chosen or not spots:
        return ""
    by = {(c["config"], c["kind"], c["users"]): c for c in cells if c["target"] == target}
    parts = []
    for cfg in chosen:
        said, lost = [], []
        for kind, u in spots:
            c = by.get((cfg, kind, u))
            if c is None or c.get("speedup_aggregate") is None:
                continue
            v = verdict(c["speedup_aggregate"], c.get("speedup_aggregate_range"))
            where = f"{'all kinds' if kind == ALL else kind} at {_users(u)}"
            said.append(f"{'~' if v == 'noise' else ''}{c['speedup_aggregate']:.2f}x for {where}")
            if v == "costs":
                lost.append(where)
        if said:
            parts.append(f"{cfg} gave {', '.join(said)}: "
                         + (f"slower than no speculation outside noise for {', '.join(lost)}" if lost else
                            "never slower than no speculation outside noise"))
    if not parts:
        return ""
    return ("Where speculation stops paying, the draft lengths chosen per round (against no speculation; "
            "~: within noise): " + "; ".join(parts) + ".")


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
