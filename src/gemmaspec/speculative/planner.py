"""The server's rounds: who drafts how many tokens, for the whole batch (:class:`RoundPlanner`).

Each round the scheduler hands the planner its active requests; the planner asks every slot's
drafter for what it drafts at no cost (:func:`~.batch.preview`), chooses each slot's draft length
from measured costs (:func:`~.chooser.choose`; a request that does not choose drafts its own fixed
length), drafts with the models for all slots at once (:func:`~.batch.draft_batch`) and starts each
request's round with its draft. After the target forward and verification it learns the round's
time and each slot's acceptance (:meth:`RoundPlanner.finish`). Its figures (last choice per slot,
predicted and measured tokens per second) feed ``/slots``, ``/metrics`` and ``gemmaspec bench``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .batch import Preview, draft_batch, preview
from .chooser import (PRIOR_WEIGHT, RATE_DECAY, RATE_MIN_ROUNDS, RATE_NEW_REQUEST, REQUEST_DECAY, Acceptance, Choice,
                      CostModel, SlotView, choose, explore_width)
from .drafters import Draft, NoDrafter
from .options import MAX_DRAFT_TOKENS


@dataclass
class PlanTotals:
    """Running totals over planned rounds (Prometheus counters and ``gemmaspec bench``'s figures).

    Attributes:
        rounds: rounds planned with at least one choosing slot.
        predicted_tokens, predicted_seconds: the cost model's expected tokens and seconds of them.
        tokens, seconds: the tokens those rounds kept and the seconds they took (drafting included).
        chosen: slot-rounds by chosen draft length ``{n: count}``.
    """

    rounds: int = 0
    predicted_tokens: float = 0.0
    predicted_seconds: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    chosen: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "predicted_tokens": self.predicted_tokens,
                "predicted_seconds": self.predicted_seconds, "tokens": self.tokens, "seconds": self.seconds,
                "chosen_n": {str(k): v for k, v in sorted(self.chosen.items())}}


@dataclass
class SlotPlan:
    """One slot's part of the current round: its preview, its view for the chooser, the n chosen."""

    key: int
    state: object
    preview: Preview
    view: SlotView
    n: int = 0
    choosing: bool = False
    chose: bool = False  # choosing, and it could draft this round (a length was chosen for it)
    generated: int = 0  # the request's generated tokens when the round began


class RoundPlanner:
    """Plans the server's batched rounds (see the module docstring).

    Args:
        engine: the :class:`~gemmaspec.engine.Engine` (its ``forward_costs`` calibrate the cost model,
            measured on first need).
        n_cap: longest draft the calibration covers (rows per slot - 1).
    """

    def __init__(self, engine, n_cap: int = MAX_DRAFT_TOKENS):
        self.engine, self.n_cap = engine, n_cap
        self._cost: CostModel | None = None
        self.pooled: dict[tuple, Acceptance] = {}  # (source, "gain" | "cont") -> pooled over slots
        self.per_slot: dict[int, dict[tuple, Acceptance]] = {}
        self.last: dict[int, dict] = {}  # slot key -> {"n", "source", "rates"} of its last planned round
        self.totals = PlanTotals()
        self.last_rate = (0.0, 0.0)  # (predicted, measured) tokens/s of the last planned round
        self._plans: list[SlotPlan] = []
        self._done: list[SlotPlan] = []
        self._choice = Choice()
        self._t0 = self._t_drafted = 0.0
        self._step_s = 0.0  # this round's timed draft steps (seconds)
        self._model_drafted = False  # some slot of this round drafted with a model
        self._rates: dict[int, list[float]] = {}  # slots -> decayed [tokens, seconds, rounds, last round]

    @property
    def cost(self) -> CostModel:
        """The cost model, calibrated on first use (a target forward over 1..n_cap+1 rows)."""
        if self._cost is None:
            self._cost = CostModel(self.engine.forward_costs(self.n_cap))
        return self._cost

    def rate_for(self, slots: int) -> float | None:
        """Tokens per second of the recent planned rounds of ``slots`` slots (kept tokens over their
        seconds, drafting included; decayed by :data:`~.chooser.RATE_DECAY` per round), or None before
        :data:`~.chooser.RATE_MIN_ROUNDS` of them or when the last was more than the cost model's
        horizon of rounds ago (the load and the text have changed)."""
        got = self._fresh_rate(slots)
        if got is None or got[2] < RATE_MIN_ROUNDS or got[1] <= 0:
            return None
        return got[0] / got[1]

    def _fresh_rate(self, slots: int) -> list | None:
        """The decayed sums behind :meth:`rate_for`, or None when none or stale (past the horizon)."""
        got = self._rates.get(slots)
        horizon = self._cost.horizon if self._cost is not None else 200
        return None if got is None or self.totals.rounds - got[3] > horizon else got

    def _observe_rate(self, slots: int, tokens: int, seconds: float) -> None:
        got = self._fresh_rate(slots) or [0.0, 0.0, 0.0, 0]  # a stale record starts again
        d = RATE_DECAY
        self._rates[slots] = [d * got[0] + tokens, d * got[1] + seconds, d * got[2] + 1.0, self.totals.rounds]

    def new_request(self, key: int) -> None:
        """Slot ``key`` starts a request: its own acceptance counts start from the pooled ones, and the
        measured rates weigh :data:`~.chooser.RATE_NEW_REQUEST` of what they did (they were measured on
        the requests before: once a whole batch has turned over, its rounds measure the rate afresh
        instead of inheriting one from another kind of text)."""
        self.per_slot[key] = {}
        self.last.pop(key, None)
        for got in self._rates.values():
            got[:3] = [v * RATE_NEW_REQUEST for v in got[:3]]

    def _acceptance(self, key: int, source: str, what: str = "gain") -> Acceptance:
        """Slot ``key``'s estimates for drafter ``source``: ``gain`` (a position gained given the one
        before was) or ``cont`` (a model drafter drafted a position given it drafted the one before)."""
        mine = self.per_slot.setdefault(key, {})
        name = (source, what)
        if name not in mine:
            parent = self.pooled.setdefault(name, Acceptance(MAX_DRAFT_TOKENS + 1, decay=0.99, weight=2.0))
            mine[name] = Acceptance(MAX_DRAFT_TOKENS + 1, decay=REQUEST_DECAY, parent=parent, weight=PRIOR_WEIGHT)
        return mine[name]

    def begin(self, slots: list[tuple[int, object]]) -> list:
        """Start a round for ``slots`` = ``(key, RequestState)``: returns, per slot, its
        :class:`~gemmaspec.engine.RoundInput` or the exception its drafting raised (that slot only;
        a batched draft step that fails fails the slots it drafted for)."""
        self._t0 = time.perf_counter()
        self._step_s, self._model_drafted = 0.0, False
        plans: list[SlotPlan | None] = []
        results: list = [None] * len(slots)
        for i, (key, st) in enumerate(slots):
            try:
                plans.append(self._view(key, st, len(slots)))
            except Exception as exc:  # noqa: BLE001 - this slot fails, the others go on
                plans.append(None)
                results[i] = exc
        live = [p for p in plans if p is not None]
        if any(p.chose for p in live):
            t = time.perf_counter()
            cost = self.cost  # calibrated on first use (about a second, once): not this round's planning
            self._t0 += time.perf_counter() - t
            self._choice = choose([p.view for p in live], cost, rate=self.rate_for(len(live)))
            for p, n in zip(live, self._choice.ns):
                p.n = n
        else:
            self._choice = Choice()
            for p in live:
                p.n = p.view.fixed or 0
        drafts = self._draft(plans, results)
        self._t_drafted = time.perf_counter()
        for i, p in enumerate(plans):
            if results[i] is not None:
                continue
            d = drafts.get(i) if p.preview.model is not None else p.preview.draft
            if d is not None and p.n > 0:
                d.tokens = list(d.tokens[:p.n])
                d.source = p.preview.source if p.preview.chained else ""
            else:
                d = Draft()
            try:
                results[i] = p.state.begin_round(d)
            except Exception as exc:  # noqa: BLE001
                results[i] = exc
                continue
            if p.chose:
                p.state.stats.spec.record_choice(p.n)
                self.last[p.key] = {"n": p.n, "source": p.preview.source,
                                    "acceptance": [round(a, 3) for a in p.view.rates[:p.n]]}
        self._plans = live
        return results

    def _view(self, key: int, st, slots: int = 1) -> SlotPlan:
        """Slot ``key``'s part of a round of ``slots`` slots: what its drafter drafts for free, how far
        it may draft, its acceptance estimates (the choice's with an exploration bound that narrows
        with ``slots``), and whether it chooses (a request that speculates with ``choose_n``: its
        ``n_max`` is then a bound) or drafts its own fixed length."""
        choosing = bool(st.options.choose_n) and st.options.n_max != 0 and not isinstance(st.drafter, NoDrafter)
        room = st.draft_room()
        pv = preview(st.drafter, st.draft_context(), room) if room > 0 else Preview()
        cap = min(room, pv.cap)
        view = SlotView(cap, (), pv.source if pv.model is not None else "", pv.batched,
                        None if choosing else min(st.fixed_n(), cap), st.options.n_min)
        chose = choosing and cap > 0
        if chose:
            acc = self._acceptance(key, pv.source)
            view.rates, view.plain = acc.rates(cap, explore_width(slots)), acc.rates(cap)
            if pv.model is not None:
                view.cont = self._acceptance(key, pv.source, "cont").rates(cap)
        return SlotPlan(key, st, pv, view, choosing=choosing, chose=chose, generated=st.stats.generated_tokens)

    def _draft(self, plans: list, results: list) -> dict:
        """The model drafters' drafts of this round, by slot position (batched across slots); a
        failure is recorded in ``results`` for every slot of the call."""
        jobs = [(i, p) for i, p in enumerate(plans) if p is not None and p.n > 0 and p.preview.model is not None]
        if not jobs:
            return {}
        self._model_drafted = True
        try:
            got = draft_batch([(p.preview.model, p.state.draft_context(), p.n) for _, p in jobs], self._observe_draft)
        except Exception as exc:  # noqa: BLE001 - the slots that drafted with a model fail
            for i, _ in jobs:
                results[i] = exc
            return {}
        return {i: d for (i, _), d in zip(jobs, got)}

    def _observe_draft(self, source: str, rows: int, seconds: float, steps: int = 1) -> None:
        self._step_s += seconds * steps
        if self._cost is not None:
            self._cost.observe_draft(source, rows, seconds)

    def finish(self, seconds: float, finished: set) -> None:
        """After the round's forward and verification (``seconds`` of them, drafting excluded): learn
        the round's time and each slot's acceptance, and update the totals. ``finished``: the keys of
        the slots whose round was verified (a slot that failed is left out)."""
        plans, self._plans = self._plans, []
        ran = [p for p in plans if p.key in finished]
        if not ran:
            return
        rows = sum(1 + p.state.last_verdict[0] for p in ran)
        choosing = any(p.chose for p in ran)
        if choosing or self._cost is not None:
            self.cost.observe_verify(len(ran), rows, seconds)
            # planning outside the timed steps; a stall (a first call's warm-up, a pause) counts at most
            # a quarter of the round's forward, so one outlier cannot price drafting out for long
            self.cost.observe_overhead(len(plans), self._model_drafted,
                                       min((self._t_drafted - self._t0) - self._step_s, 0.25 * seconds))
        for p in ran:
            drafted, accepted = p.state.last_verdict
            # the positions the round tried: a model drafter asked for n tokens that stopped early (its
            # p-min) gained nothing at the positions it did not draft, and the choice must learn that
            model = p.preview.model is not None
            tried = max(drafted, p.n) if model else drafted
            updated = set()
            if p.preview.source and tried:
                for what, got in (("gain", accepted), ("cont", drafted)) if model else (("gain", accepted),):
                    self._acceptance(p.key, p.preview.source, what).update(tried, got)
                    self.pooled[(p.preview.source, what)].update(tried, got)
                    updated.add((p.preview.source, what))
            for name, acc in self.per_slot.get(p.key, {}).items():
                if name not in updated:
                    acc.tick()
        if choosing:
            t = self.totals
            kept = sum(p.state.stats.generated_tokens - p.generated for p in ran)
            spent = (self._t_drafted - self._t0) + seconds
            t.rounds += 1
            t.predicted_tokens += self._choice.tokens
            t.predicted_seconds += self._choice.seconds
            t.tokens += kept
            t.seconds += spent
            self._observe_rate(len(plans), kept, spent)
            for p in ran:
                if p.chose:
                    t.chosen[p.n] = t.chosen.get(p.n, 0) + 1
            self.last_rate = (self._choice.rate, kept / spent if spent > 0 else 0.0)
        self._done = ran

    def round_choices(self) -> list[tuple[int, int]]:
        """``(slot key, n)`` of the choosing slots of the round last finished (for metrics)."""
        return [(p.key, p.n) for p in self._done if p.chose]


