"""Each round's draft lengths for a whole batch, from measured costs (the server's default).

With several slots sharing one target forward, a draft token costs more than its own verify row: it
makes every slot's round wait for the wider forward. So the draft length n of each slot is chosen per
round for the batch, not per request: :func:`choose` picks ``n_i`` (0 included) for every slot to
maximise the batch's expected tokens per second,

    tokens(n) = sum_i E_i(n_i),   E_i(n) = 1 + sum_{j=1..n} prod_{k<=j} a_{i,k}
    seconds(n) = verify(S, S + sum_i n_i) + drafting(n) + overhead(S, any model drafts)

Over many rounds, not one: the server's tokens per second is the sum of the rounds' tokens over the
sum of their seconds, so a round's extra draft pays when what it adds, d tokens / d seconds, beats the
rate the server makes of a second (``rate``: measured over the recent rounds of this many slots), not
this round's own average. The planner passes that rate once it has one and :func:`choose` then
maximises ``tokens(n) - rate * seconds(n)`` (the renewal-reward criterion; Dinkelbach's method for a
ratio of sums): a round whose slots draft well drafts longer, a poor one less, than each round's own
ratio would have them. Replayed on held-out prompts (``benchmarks/chooser_sim.py``; variant ``ratio`` is
the old criterion) this lifted the default list drafter from 0.976 / 0.980 / 0.976 of the best fixed
length at 2 / 4 / 8 users to 0.977 / 0.990 / 0.982 (docs/server.md, "Weighing a round's seconds").

where ``a_{i,k}`` is slot i's chance of gaining draft position k given it gained k-1
(:class:`Acceptance`: a position its drafter was asked for but did not draft, stopped by its p-min,
counts as not gained), ``verify(S, R)`` the seconds of a round of S slots and R rows (forward,
verification and stop checks; :class:`CostModel`) and ``drafting`` the draft steps it needs: a
batched drafter (the MTP assistant) runs step k once for the B_k slots still drafting,
``sum_k d(B_k)``; a drafter that does not batch pays ``d(1)`` per token; a draft already made (n-gram
lookup: nearly free) costs nothing more. ``overhead`` is what a round spends planning and drafting
outside those timed steps (the views, this choice, a model drafter's setup), learned per slot count,
apart for rounds where some slot drafts with a model: a fixed cost of drafting at all. A model drafter with a p-min drafts fewer tokens than asked
in some rounds: its rows and steps are counted by their expected number (``SlotView.cont``). At one slot this is the adaptive draft length of
:mod:`.adaptive` with a per-step drafting cost; under load it drafts less, or not at all, by itself.

Choosing n never changes output: every n is verified exactly (greedy, and seeded sampling through
per-position draws), so only speed depends on it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

PRIOR_FIRST = 0.85
"""Prior acceptance of a first draft token (the adaptive controller's), before anything is measured."""

EXPLORE = 2.0
"""Width of the upper confidence bound on a request's acceptance the planner chooses with at one slot
(:meth:`Acceptance.rates`'s ``explore``); with S slots it is ``EXPLORE / S ** EXPLORE_SLOTS``
(:func:`explore_width`). 2 since verify rows got cheap (the layers' int8 products): a test of a longer
draft costs less, and the replays on those costs gain from testing more (docs/server.md)."""

EXPLORE_SLOTS = 1.5
"""How fast exploration narrows with the slots of a round: a slot's extra rows cost the whole batch's
round while its tokens are one slot's share, so what a test of a longer draft is worth falls with
the load faster than its price (chosen with ``benchmarks/chooser_sim.py``'s replays of the bench's
rounds; docs/server.md, "Replaying the choice offline")."""

PRIOR_WEIGHT = 2.0
"""Weight, in rounds, of the pooled estimate in a request's own (:class:`Acceptance`'s ``weight``):
one missed draft moves a position's estimate by a third, not a half."""

RATE_DECAY = 0.95
"""Decay per planned round of the tokens and seconds behind the planner's measured rate for a slot count
(:func:`choose`'s ``rate``): about the last 20 rounds of that many slots, so the rate follows the text
being served (what a second is worth is what the next rounds would make of it). Replays over 16 seeds,
mean of the 16 (drafter, users) cells on the bench's / held-out prompts: decay 0.85 0.983 / 0.982, 0.9
0.983 / 0.983, 0.95 0.983 / 0.983, 0.98 0.981 / 0.983, no rate 0.980 / 0.981; 0.95 left the fewest
held-out cells below 0.97 (38 of 320; 41 at 0.98, 45 without)."""

RATE_MIN_ROUNDS = 5.0
"""Decayed rounds of a slot count before its measured rate is used (before: each round's own ratio)."""

RATE_NEW_REQUEST = 0.7
"""Weight the measured rates keep when a request starts (:meth:`~.planner.RoundPlanner.new_request`).
Seen in a round log (math at 4 users right after JSON): the first ~10 rounds of the new kind weighed a
second at JSON's 414 tokens/s against math's ~290 and drafted nothing. With 0.7, four or more new
requests at once (a batch turning over) leave a steady rate's 20 decayed rounds below
:data:`RATE_MIN_ROUNDS` (the rounds' own ratio until the new
requests' rounds measure it); one new request among several running keeps most of it. Replayed over 16
seeds (bench's / held-out prompts, costs on lines / at their medians): fewer kinds below 0.97 of the best
fixed length in all four (17 / 37 / 18 / 49 of 320 -> 16 / 31 / 13 / 41), the means 0.985 / 0.986 /
0.984 / 0.979 -> 0.985 / 0.985 / 0.985 / 0.981 (0.85 replayed the same)."""

LINE_DECAY = 0.97
"""Decay per round of a slot count's verify line (:meth:`CostModel.line`): about its last 30 rounds."""

LINE_PRIOR = 4.0
"""Weight of the calibrated slope in a verify line, in rounds times rows squared (a round one row off
the others' mean weighs 1): it decides until rounds of different widths are seen."""

LINE_CLIP = 1.3
"""A round's verify time enters its line at most this factor from the line's prediction (after
:data:`LINE_CLIP_AFTER` decayed rounds): a stall, 1.5x and more, moves it by a bounded step."""

LINE_CLIP_AFTER = 3.0
"""Decayed rounds a verify line needs before rounds are clipped to it (and their offsets kept per width)."""

LINE_CELL_PRIOR = 2.0
"""A (slots, rows) seen often keeps its own offset from its line (the kernels' uneven row counts), shrunk
towards the line by this many rounds; 0: the line alone."""

LINE_CELL_DECAY = 0.8
"""Decay per visit of a width's offset from its line: about its last 5 visits."""

REQUEST_DECAY = 0.9
"""Decay per round of a request's own counts (:class:`Acceptance`'s ``decay``): its estimates follow
the text's current stretch (a list, then prose) within ~10 rounds."""


RATE_FLOOR = False
"""Whether :func:`choose` floors the rate at the round's own ratio without drafting. Off: within noise in
the bench, 0.002-0.007 under in replays (variant ``rf=1``; docs/server.md, "A floor under the rate")."""


def explore_width(slots: int) -> float:
    """The exploration bound's width for a round of ``slots`` slots (see :data:`EXPLORE_SLOTS`)."""
    return EXPLORE / max(1, slots) ** EXPLORE_SLOTS


class Acceptance:
    """Acceptance by draft position of one drafter, from exponentially decayed counts.

    ``rate(i)`` = (accepted at i + w · prior_i) / (tested at i + w): position i is tested when
    positions 0..i-1 were accepted. The prior is the ``parent``'s estimate at i when there is one
    (a request's counts shrink towards the pooled counts of its drafter), else position i-1's own
    estimate (position 0: :data:`PRIOR_FIRST`), as :class:`~.adaptive.AdaptiveDraftLength` does.

    Args:
        n_cap: positions tracked (draft lengths up to this).
        decay: weight kept by old counts per update or :meth:`tick` (0..1).
        parent: the pooled estimate this one shrinks towards, or None.
        weight: the prior's weight, in rounds.
    """

    def __init__(self, n_cap: int = 16, decay: float = 0.95, parent: "Acceptance | None" = None,
                 weight: float = 1.0):
        self.n_cap, self.decay, self.parent, self.weight = n_cap, decay, parent, weight
        self.reached = [0.0] * n_cap
        self.acc = [0.0] * n_cap

    def rates(self, k: int, explore: float = 0.0) -> list[float]:
        """Estimated acceptance at positions 0..k-1 (k capped at ``n_cap``).

        ``explore`` > 0 raises each position's estimate p by ``explore * sqrt(p (1 - p) / (t + 1))``, t
        that position's own (decayed) tests, capped at 1: an upper confidence bound, as bandit
        algorithms use, so that a request whose own record is thin drafts (and drafts long enough)
        to learn instead of inheriting a low pooled estimate forever (a round that drafts nothing
        tests nothing, one that drafts 1 token never tests position 2). It fades as its own tests
        accumulate, and returns when they fade (:meth:`tick`)."""
        k = min(k, self.n_cap)
        prior = self.parent.rates(k) if self.parent is not None else None
        out, prev = [], PRIOR_FIRST
        for i in range(k):
            p = prior[i] if prior is not None else prev
            prev = (self.acc[i] + self.weight * p) / (self.reached[i] + self.weight)
            out.append(prev)
        if explore > 0:
            out = [min(1.0, p + explore * math.sqrt(p * (1.0 - p) / (t + 1.0))) for p, t in zip(out, self.reached)]
        return out

    def tick(self) -> None:
        """A round without a draft from this drafter: old counts fade (the estimate drifts back to
        the prior, so a drafter turned off is tried again once its bad record has faded)."""
        for i in range(self.n_cap):
            self.reached[i] *= self.decay
            self.acc[i] *= self.decay

    def update(self, n_drafted: int, n_accepted: int) -> None:
        """Record a round that drafted ``n_drafted`` tokens and accepted the first ``n_accepted``."""
        self.tick()
        for i in range(min(n_drafted, n_accepted + 1, self.n_cap)):
            self.reached[i] += 1.0
            if i < n_accepted:
                self.acc[i] += 1.0


def expected_tokens(rates: Sequence[float]) -> list[float]:
    """``E(n)`` for n = 0..len(rates): tokens a round keeps on average when it drafts n (the target's
    own token included)."""
    out, total, prob = [1.0], 1.0, 1.0
    for a in rates:
        prob *= a
        total += prob
        out.append(total)
    return out


@dataclass
class SlotView:
    """What :func:`choose` knows of one slot this round.

    Attributes:
        cap: most draft tokens it may verify (context, ``max_tokens``, its ``n_max``, the length of a
            draft already made); 0: it cannot draft this round.
        rates: acceptance at draft positions 0..cap-1 (:meth:`Acceptance.rates`).
        source: the drafter whose steps cost time (a key of :meth:`Costs.draft_seconds`), or "" when
            the draft costs nothing more (already made, e.g. n-gram lookup).
        batched: its draft steps run once for all slots of the same source that still draft.
        fixed: the slot's draft length when it does not choose (``--spec-draft-n-fixed``, a request's
            ``speculative.n_fixed``), else None.
        n_min: a draft shorter than this is not verified (``--spec-draft-n-min``): n is 0 or >= it.
        cont: a model drafter's chance of drafting position k given it drafted k-1 (its p-min stops a
            round early), positions 0..cap-1; empty: it always drafts what it is asked. A round asked
            for n tokens verifies and drafts only what was drafted, so rows and draft steps are priced
            by their expected number.
        plain: the acceptance estimates without an exploration bound (``rates`` may carry one, see
            :meth:`Acceptance.rates`): the choice's reported tokens use these; empty: ``rates``.
        weight: multiplies the slot's expected tokens in the choice (not in the reported ones); the
            server leaves it 1 (replay variant ``pf``; docs/server.md, "Fair shares: tried, not kept").
    """

    cap: int
    rates: Sequence[float] = ()
    source: str = ""
    batched: bool = True
    fixed: int | None = None
    n_min: int = 0
    cont: Sequence[float] = ()
    plain: Sequence[float] = ()
    weight: float = 1.0


@dataclass
class Choice:
    """The draft length per slot (``ns``, in the order given), the batch's expected tokens and the
    predicted seconds of the round (drafting included)."""

    ns: list[int] = field(default_factory=list)
    tokens: float = 0.0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Predicted tokens per second of the round."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Costs(Protocol):
    """What :func:`choose` asks of a cost model (:class:`CostModel`, or a fake in tests)."""

    def verify_seconds(self, seqs: int, rows: int) -> float:
        """Seconds of a round of ``seqs`` slots running ``rows`` rows in one target forward."""
        ...

    def draft_seconds(self, source: str, batch: int) -> float:
        """Seconds of one draft step of ``source`` for ``batch`` slots at once."""
        ...

    # optional: ``overhead_seconds(seqs, drafting) -> float``, the seconds a round of ``seqs`` slots
    # spends planning and drafting outside the timed draft steps (``drafting``: some slot drafts with a
    # model); :func:`choose` adds it when the cost model has it (:meth:`CostModel.overhead_seconds`).


def choose(slots: Sequence[SlotView], costs: Costs, tolerance: float = 0.01, rate: float | None = None,
           floor: bool | None = None) -> Choice:
    """Each slot's draft length for this round: the ``n`` that maximises expected tokens per second
    of the whole batch (with ``rate``: ``tokens - rate * seconds``; see the module docstring),
    searched from the best uniform length by
    per-slot improvement; a change must promise more than ``tolerance`` (relative) more tokens per
    second, so near-ties go to drafting less (estimates are noisy, and a draft that barely pays on
    paper is not worth its variance). A pure function of its inputs.

    Args:
        slots: one :class:`SlotView` per slot in the round.
        costs: the cost model (:class:`Costs`).
        tolerance: relative gain a change must bring.
        rate: tokens per second the server makes of a second at this load (measured), or None: then
            the round's own ratio is maximised; with it, ``tokens - rate * seconds`` is, and a change
            must add more than ``tolerance * rate`` times the round's seconds.
        floor: raise ``rate`` to this round's ratio without drafting where it is below (None:
            :data:`RATE_FLOOR`).

    Returns:
        :class:`Choice` with ``ns[i]`` in ``{0} ∪ [n_min_i, cap_i]`` (``fixed_i`` for a fixed slot,
        capped at ``cap_i``); its ``tokens`` from each slot's ``plain`` estimates where given.
    """
    n = len(slots)
    if n == 0:
        return Choice()
    caps = [max(0, s.cap) for s in slots]

    def padded(rates, c: int) -> list[float]:  # rates at positions 0..c-1, 0 where none is known
        return list(rates[:c]) + [0.0] * (c - len(rates[:c]))

    gain = [expected_tokens(padded(s.rates, c)) for s, c in zip(slots, caps)]
    fixed = [None if s.fixed is None else min(max(0, s.fixed), c) for s, c in zip(slots, caps)]
    # reach[i][j]: probability slot i's drafter produces j tokens when asked for more (its p-min stops)
    reach = []
    for s, c in zip(slots, caps):
        r = [1.0]
        for j in range(c):
            r.append(r[-1] * (s.cont[j] if j < len(s.cont) else 1.0))
        reach.append(r)
    rows_max = n + sum(caps)
    verify = [0.0] * (rows_max + 2)
    for r in range(n, rows_max + 1):
        verify[r] = costs.verify_seconds(n, r)
    verify[rows_max + 1] = verify[rows_max]
    over = getattr(costs, "overhead_seconds", None)
    over_idle, over_draft = (over(n, False), over(n, True)) if over is not None else (0.0, 0.0)
    step = {src: [0.0] + [costs.draft_seconds(src, b) for b in range(1, n + 1)] + [0.0]
            for src in dict.fromkeys(s.source for s in slots if s.source)}
    for tab in step.values():
        tab[-1] = tab[-2]

    def at(tab: list, x: float) -> float:  # tab at a fractional index (expected rows or slots)
        lo = int(x)
        return tab[lo] + (x - lo) * (tab[lo + 1] - tab[lo])

    # per slot and length k: expected draft rows sum(reach[1:k+1]) and draft steps sum(reach[:k])
    rows_k = [[sum(r[1:k + 1]) for k in range(len(r))] for r in reach]
    steps_k = [[sum(r[:k]) for k in range(len(r))] for r in reach]
    sources = [s.source for s in slots]

    def seconds(ns) -> float:
        total = at(verify, n + sum(rows_k[i][k] for i, k in enumerate(ns)))
        drafting = [i for i, k in enumerate(ns) if k and sources[i]]
        total += over_draft if drafting else over_idle
        by_source: dict[str, list[int]] = {}
        for i in drafting:
            if slots[i].batched:
                by_source.setdefault(sources[i], []).append(i)
            else:
                total += steps_k[i][ns[i]] * step[sources[i]][1]
        for src, rows in by_source.items():
            for j in range(1, max(ns[i] for i in rows) + 1):  # step j runs for the slots that drafted j - 1
                total += at(step[src], sum(reach[i][j - 1] for i in rows if ns[i] >= j))
        return max(total, 1e-9)

    def score(ns) -> tuple[float, float, float]:
        t = sum(v.weight * g[k] for v, g, k in zip(slots, gain, ns))
        s = seconds(ns)
        return (t / s if rate is None else t - rate * s), t, s

    def better(got, old) -> bool:  # by more than the tolerance
        if rate is None:
            return got[0] > old[0] * (1 + tolerance)
        return got[0] > old[0] + tolerance * rate * got[2]

    def allowed(i: int, k: int) -> bool:
        return k == 0 or k >= slots[i].n_min

    best = [f if f is not None else 0 for f in fixed]
    if rate is not None and (RATE_FLOOR if floor is None else floor):  # the best rate >= a plain round's
        rate = max(rate, sum(g[k] for g, k in zip(gain, best)) / seconds(best))
    best_score = score(best)
    for k in range(1, max(caps) + 1):  # the best uniform length first: the search's starting point
        trial = [f if f is not None else (min(k, c) if allowed(i, min(k, c)) else 0)
                 for i, (f, c) in enumerate(zip(fixed, caps))]
        got = score(trial)
        if better(got, best_score):
            best, best_score = trial, got
    for _ in range(3):  # then each slot's own length, the others held
        changed = False
        for i in range(n):
            if fixed[i] is not None or caps[i] == 0:
                continue
            for k in range(caps[i] + 1):
                if k == best[i] or not allowed(i, k):
                    continue
                trial = list(best)
                trial[i] = k
                got = score(trial)
                if better(got, best_score):
                    best, best_score, changed = trial, got, True
        if not changed:
            break
    tokens = sum(g[k] for g, k in zip(gain, best))
    if any(s.plain for s in slots):  # the prediction reported: the estimates without the exploration bound
        tokens = sum(expected_tokens(padded(s.plain or s.rates, c))[k] for s, c, k in zip(slots, caps, best))
    return Choice(best, tokens, best_score[2])


class CostModel:
    """Seconds of a round's parts on this machine: calibrated at start, then learned online.

    ``verify_seconds(S, R)``: a line in the draft rows R - S fitted to the recent rounds of S slots
    (:meth:`line`: decayed least squares, each round clipped to :data:`LINE_CLIP` x the line's
    prediction, the slope shrunk towards the calibration's), plus the (S, R)'s own offset from it where
    that width was seen (shrunk by :data:`LINE_CELL_PRIOR` rounds) and at most a wider width seen; for
    an S never seen (or not within the ``horizon``), the nearest S's line at the same draft rows plus
    the calibrated difference; before any round, the calibration alone. Every round of S slots informs
    every width, so a width nobody drafted lately is priced from the others instead of from its last
    visit: before (``fit = False``, per-(S, R) decayed means, each capped by the cheapest wider one;
    kept for ``benchmarks/chooser_sim.py``'s comparison) one stall caught in a rarely seen (S, R) priced
    every draft through it out for as long as nobody drafted that long again (seen at 8 slots: 13 and
    14 rows at 42-43 ms beside 15 and 16 at 34-37). Replayed over 16 seeds on the bench's and held-out
    prompts, with the measured costs on their lines or at their own medians, the lines lifted the
    choice from 0.983 / 0.983 / 0.981 / 0.977 of the best fixed length (mean over drafters and user
    counts) to 0.985 / 0.986 / 0.984 / 0.979, with fewer kinds below 0.97 in all four (docs/server.md). ``draft_seconds(source, B)``: the measured
    mean of one draft step of B rows, else the nearest B's scaled by B / B' for a B above it (a safe
    over-estimate), else ``draft_prior`` × the calibrated 1-row forward. ``overhead_seconds(S,
    drafting)``: the measured mean of a round's planning and drafting time outside the timed draft
    steps, for S slots, with or without a model drafting (nearest S scaled by S / S' above it; 0 before
    any round).

    Args:
        forward_costs: seconds of one target forward over 1, 2, ... rows (one sequence; see
            :meth:`gemmaspec.engine.Engine.forward_costs`); at least one entry.
        horizon: rounds after which an unrepeated measurement is ignored (the machine's load changes).
        draft_prior: a model drafter's step before one is measured, as a share of a 1-row forward.
    """

    def __init__(self, forward_costs: Sequence[float], horizon: int = 200, draft_prior: float = 0.1):
        if not forward_costs:
            raise ValueError("the cost model needs at least one calibrated forward")
        self.cal = [float(c) for c in forward_costs]
        self.horizon, self.draft_prior = horizon, draft_prior
        self.verify: dict[tuple[int, int], list[float]] = {}  # (S, R) -> [mean s, round seen]
        self.draft: dict[tuple[str, int], list[float]] = {}  # (source, B) -> [mean s, round seen]
        self.overhead: dict[tuple[int, bool], list[float]] = {}  # (S, drafting) -> [mean s, round seen]
        self.lines: dict[int, list[float]] = {}  # S -> decayed [W, Wx, Wxx, Wy, Wxy, round seen], x = R - S
        self.cells: dict[int, dict[int, list[float]]] = {}  # S -> R -> decayed [residual sum, weight, round]
        self.round = 0
        self._memo: dict = {}  # this round's lines and widths (they change only when a round is observed)
        self._memo_round = -1

    def _cached(self) -> dict:
        """This round's memo (:meth:`line`, :meth:`_wider`): the chooser asks for every width of a round
        (25 at 8 slots) and the lines move only in :meth:`observe_verify`, which empties it."""
        if self._memo_round != self.round:
            self._memo, self._memo_round = {}, self.round
        return self._memo

    def calibrated(self, rows: int) -> float:
        """Calibrated seconds of one forward over ``rows`` rows (linear beyond the calibration)."""
        c = self.cal
        if rows <= len(c):
            return c[max(rows, 1) - 1]
        lo = len(c) // 2
        slope = (c[-1] - c[lo - 1]) / (len(c) - lo) if len(c) > 1 else c[0]
        return c[-1] + max(slope, 0.0) * (rows - len(c))

    def _fresh(self, table: dict) -> dict:
        return {k: v[0] for k, v in table.items() if self.round - v[1] <= self.horizon}

    monotone = True
    """Whether a round of S slots and R rows is priced at most as a round of the same S and more rows
    measured (see :meth:`verify_seconds`)."""

    fit = True
    """Whether ``verify_seconds`` comes from each slot count's fitted line in rows (:meth:`line`) rather
    than per-(S, R) means (see the class docstring)."""

    # the line's tunables (module constants; benchmarks/chooser_sim.py replays others in a subclass)
    line_decay, line_prior, line_clip, line_cell_prior = LINE_DECAY, LINE_PRIOR, LINE_CLIP, LINE_CELL_PRIOR

    def prior_slope(self) -> float:
        """Seconds per extra row of one forward from the calibration (its mean slope; >= 0)."""
        c = self.cal
        return max(0.0, (c[-1] - c[0]) / (len(c) - 1)) if len(c) > 1 else 0.0

    def line(self, seqs: int) -> tuple[float, float] | None:
        """``(a, b)``: a round of ``seqs`` slots and R rows costs ``a + b (R - seqs)`` seconds, fitted
        by decayed least squares over that slot count's recent rounds with the slope shrunk towards
        :meth:`prior_slope` (weight :data:`LINE_PRIOR`; it decides while the rounds seen span few row
        counts) and kept >= 0; None when no fresh round of ``seqs`` slots was seen."""
        memo = self._cached()
        key = ("line", seqs)
        if key in memo:
            return memo[key]
        st = self.lines.get(seqs)
        if st is None or self.round - st[5] > self.horizon or st[0] <= 0:
            got = None
        else:
            w, wx, wxx, wy, wxy = st[:5]
            sxx, sxy = wxx - wx * wx / w, wxy - wx * wy / w
            b = max(0.0, (sxy + self.line_prior * self.prior_slope()) / (max(sxx, 0.0) + self.line_prior))
            got = ((wy - b * wx) / w, b)
        memo[key] = got
        return got

    def _wider(self, seqs: int, rows: int, ln: tuple[float, float]) -> float | None:
        """The cheapest width wider than ``rows`` seen for ``seqs`` slots, priced on line ``ln`` with its
        own offset (None when none was seen): from a per-round table of suffix minima."""
        memo = self._cached()
        key = ("wider", seqs)
        got = memo.get(key)
        if got is None:
            widths = sorted(self.cells.get(seqs, ()))
            mins = [self._width(ln, seqs, r) for r in widths]
            for i in range(len(mins) - 2, -1, -1):
                mins[i] = min(mins[i], mins[i + 1])
            got = memo[key] = (widths, mins)
        widths, mins = got
        i = bisect.bisect_right(widths, rows)
        return mins[i] if i < len(widths) else None

    def _width(self, ln: tuple[float, float], seqs: int, rows: int) -> float:
        """Seconds of ``rows`` rows of ``seqs`` slots on line ``ln`` plus that width's own offset."""
        return max(1e-6, ln[0] + ln[1] * (rows - seqs) + self._cell(seqs, rows))

    def _line_seconds(self, seqs: int, rows: int) -> float | None:
        got = self.line(seqs)
        if got is not None:
            return self._width(got, seqs, rows)
        near = [s for s in self.lines if self.line(s) is not None]
        if not near:
            return None
        s = min(near, key=lambda x: (abs(x - seqs), x))  # the nearest slot count, the same draft rows
        a, b = self.line(s)
        r = rows - seqs + s
        return max(1e-6, a + b * (r - s) + self.calibrated(rows) - self.calibrated(r))

    def _cell(self, seqs: int, rows: int) -> float:
        """This (S, R)'s own offset from its line: its decayed mean residual, shrunk towards 0 by
        :data:`LINE_CELL_PRIOR` rounds (0 when not seen within the horizon)."""
        c = self.cells.get(seqs, {}).get(rows)
        if c is None or not self.line_cell_prior or self.round - c[2] > self.horizon:
            return 0.0
        return c[0] / (c[1] + self.line_cell_prior)

    def verify_seconds(self, seqs: int, rows: int) -> float:
        if self.fit:
            got = self._line_seconds(seqs, rows)
            if got is None:
                return self.calibrated(rows)
            ln = self.line(seqs) if self.monotone and self.line_cell_prior else None
            if ln is not None:  # a width's offset must not make it dearer than a wider width seen
                wider = self._wider(seqs, rows, ln)
                if wider is not None:
                    got = min(got, wider)
            return got
        seen = self._fresh(self.verify)
        if (seqs, rows) in seen:
            got = seen[(seqs, rows)]
        elif seen:
            s, r = min(seen, key=lambda k: (abs(k[0] - seqs), abs(k[1] - rows), k[1]))
            got = max(1e-6, seen[(s, r)] + self.calibrated(rows) - self.calibrated(r))
        else:
            return self.calibrated(rows)
        if self.monotone:  # no dearer than a wider round measured: a stall kept in a rarely seen entry
            wider = [v for (s, r), v in seen.items() if s == seqs and r > rows]  # must not wall off longer drafts
            if wider:
                got = min(got, min(wider))
        return got

    def draft_seconds(self, source: str, batch: int) -> float:
        seen = {b: v for (src, b), v in self._fresh(self.draft).items() if src == source}
        if batch in seen:
            return seen[batch]
        if seen:
            b = min(seen, key=lambda x: (abs(x - batch), x))
            return seen[b] * max(1.0, batch / b)
        return self.draft_prior * self.calibrated(1) * batch

    def overhead_seconds(self, seqs: int, drafting: bool) -> float:
        seen = {s: v for (s, d), v in self._fresh(self.overhead).items() if d == drafting}
        if not seen:
            return 0.0
        if seqs in seen:
            return seen[seqs]
        s = min(seen, key=lambda x: (abs(x - seqs), x))
        return seen[s] * max(1.0, seqs / s)

    def observe_overhead(self, seqs: int, drafting: bool, seconds: float) -> None:
        """A round of ``seqs`` slots spent ``seconds`` planning and drafting outside its timed draft
        steps (``drafting``: some slot drafted with a model)."""
        self._observe(self.overhead, (seqs, drafting), max(0.0, seconds))

    def observe_verify(self, seqs: int, rows: int, seconds: float) -> None:
        """A round of ``seqs`` slots and ``rows`` rows took ``seconds`` (drafting excluded)."""
        self.round += 1
        self._observe(self.verify, (seqs, rows), seconds)
        pred = self.line(seqs)
        st = self.lines.get(seqs) if pred is not None else None
        if st is None:
            st = self.lines[seqs] = [0.0] * 6
        elif st[0] >= LINE_CLIP_AFTER:  # one stall (or one lucky round) moves the line by a bounded step
            p = max(1e-6, pred[0] + pred[1] * (rows - seqs))
            seconds = min(max(seconds, p / self.line_clip), p * self.line_clip)
            mine = self.cells.setdefault(seqs, {})
            c = mine.get(rows)
            if c is None or self.round - c[2] > self.horizon:
                c = mine[rows] = [0.0, 0.0, 0]
            c[0], c[1], c[2] = LINE_CELL_DECAY * c[0] + (seconds - p), LINE_CELL_DECAY * c[1] + 1.0, self.round
        x, d = float(rows - seqs), self.line_decay
        for i, v in enumerate((1.0, x, x * x, seconds, x * seconds)):
            st[i] = d * st[i] + v
        st[5] = self.round
        self._memo_round = -1  # the line and the widths just moved

    def observe_draft(self, source: str, batch: int, seconds: float) -> None:
        """One draft step of ``source`` over ``batch`` rows took ``seconds``."""
        self._observe(self.draft, (source, batch), seconds)

    def _observe(self, table: dict, key, seconds: float) -> None:
        old = table.get(key)
        fresh = old is not None and self.round - old[1] <= self.horizon
        table[key] = [0.7 * old[0] + 0.3 * seconds if fresh else seconds, self.round]
