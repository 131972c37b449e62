"""``gemmaspec generate --compare``: the same prompt decoded plainly and then with speculation, in one
process (the model loaded once), to show what speculation buys: both decode speeds, the speedup, and
whether the two texts are identical.

They must be: the drafters propose one-hot drafts and a token at position p is drawn from p's own
random stream (:mod:`gemmaspec.sampling`), so with one seed plain and speculative decoding give the
same tokens, greedy or sampled. Both runs use one seed (``-s``, else one picked for both). A short
warm-up of each kind comes first, so neither run pays for cold caches.

stdout: the speculative run's text, streamed (``--json``: then one JSON line, the speculative run's
record with ``plain`` (the plain run's record), ``speedup`` and ``identical`` added). stderr: each run's
stats line, the acceptance lines, then the verdict. Exit status 1 when the texts differ.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import numpy as np

from ..errors import InputError

WARMUP_TOKENS = 4
"""Tokens each warm-up run generates (one plain, one speculative) before the measured runs."""


def check(args) -> None:
    """Refuse ``--compare`` where there is nothing to compare, before anything is loaded.

    Raises:
        InputError: ``--spec-type none`` (plain decoding compared with itself).
    """
    if args.spec_type == "none":
        raise InputError("--compare decodes the prompt plainly and with speculation: drop --spec-type none")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter one's length when one is a
    prefix of the other), or None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def speedup(plain, spec) -> float | None:
    """Speculative decode tokens/s over plain decode tokens/s; None when either has no decode speed
    (fewer than two tokens generated)."""
    if plain.decode_tps <= 0 or spec.decode_tps <= 0:
        return None
    return spec.decode_tps / plain.decode_tps


def _decode(engine, ids, params, drafter, plan, args, out=None):
    """One generation of ``ids``: ``(stats, token ids)``, the text streamed to ``out`` when given."""
    from ..engine import RequestStats

    stats = RequestStats()
    tokens: list[int] = []
    for ev in engine.generate(ids, params, drafter=drafter, stats=stats, n_max=plan.spec.n_max, n_min=plan.spec.n_min,
                              context_shift=args.context_shift, n_keep=args.keep):
        tokens.extend(ev.tokens)
        if out is not None:
            out.write(ev.text)
            out.flush()
    return stats, tokens


def run(args, engine, drafter, plan, load_s: float, ids: list[int], params) -> int:
    """Decode ``ids`` plainly, then with ``drafter``; print as the module says. Returns the exit status
    (0: identical texts, 1: they differ)."""
    from ..report import stats_line, stats_record

    if params.seed < 0:  # one seed for both runs, so sampled runs are comparable too
        params = replace(params, seed=int(np.random.SeedSequence().entropy % (2**31)))
    warm = replace(params, max_tokens=WARMUP_TOKENS)
    for d in (None, drafter):
        _decode(engine, ids, warm, d, plan, args)
    err, out = sys.stderr, sys.stdout
    print("compare: the prompt decoded plainly first (its text is compared, not shown), then with speculation "
          "(the text below)", file=err, flush=True)
    plain, plain_ids = _decode(engine, ids, params, None, plan, args)
    print(f"plain       | {stats_line(plain, load_s)}", file=err, flush=True)
    spec, spec_ids = _decode(engine, ids, params, drafter, plan, args, out=out)
    out.write("\n")
    diff = first_difference(plain_ids, spec_ids)
    gain = speedup(plain, spec)
    if args.json:
        rec = stats_record(spec, load_s, plan.spec_type, plan.spec.n_max)
        rec |= {"plain": stats_record(plain, load_s, "none", 0), "speedup": None if gain is None else round(gain, 3),
                "identical": diff is None}
        out.write(json.dumps(rec) + "\n")
    out.flush()
    print(f"speculative | {stats_line(spec)}", file=err)
    print(spec.spec.llama_line(), file=err)
    for line in spec.spec.drafter_lines():
        print(line, file=err)
    ratio = "n/a (fewer than two tokens)" if gain is None else f"{gain:.2f}x"
    head = f"speedup {ratio} in decode tokens/s with {plan.spec_type}, n-max {plan.spec.n_max}"
    if diff is None:
        print(f"{head}; the two texts are identical ({len(spec_ids)} tokens, seed {spec.seed})", file=err)
        return 0
    print(f"{head}; the texts DIFFER from token {diff} (plain {len(plain_ids)} tokens, speculative "
          f"{len(spec_ids)}, seed {spec.seed})", file=err)
    return 1
