"""The per-round choice of draft lengths for a batch (speculative/chooser.py), as pure functions with
fake cost models: no drafting when verify rows are expensive and acceptance low, the full length when
rows are free, batched drafting's shared steps, fixed slots, n-min; the cost model's calibration and
online corrections; acceptance by position; the measured rate a round's seconds are weighed at."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmaspec.speculative.chooser import (EXPLORE, EXPLORE_SLOTS, PRIOR_WEIGHT, Acceptance, CostModel, SlotView, choose,
                                           expected_tokens, explore_width)


class FakeCosts:
    """verify(S, R) = base + per_row * (R - S); a draft step of B rows = step0 + step_row * B."""

    def __init__(self, base=0.010, per_row=0.0, step0=0.0, step_row=0.0):
        self.base, self.per_row, self.step0, self.step_row = base, per_row, step0, step_row

    def verify_seconds(self, seqs, rows):
        return self.base + self.per_row * (rows - seqs)

    def draft_seconds(self, source, batch):
        return self.step0 + self.step_row * batch


def test_expected_tokens_counts_the_targets_own_token():
    assert expected_tokens([]) == [1.0]
    assert expected_tokens([0.5, 0.5]) == pytest.approx([1.0, 1.5, 1.75])


def test_no_drafting_when_rows_are_expensive_and_acceptance_low():
    slots = [SlotView(3, [0.3, 0.3, 0.3], "draft-mtp") for _ in range(4)]
    got = choose(slots, FakeCosts(base=0.020, per_row=0.010, step0=0.0005))
    assert got.ns == [0, 0, 0, 0]
    assert got.tokens == 4 and got.seconds == pytest.approx(0.020)


def test_full_length_at_one_slot_with_high_acceptance_and_free_rows():
    got = choose([SlotView(3, [0.9, 0.9, 0.9], "draft-mtp")], FakeCosts(base=0.010, per_row=0.0, step0=0.0002))
    assert got.ns == [3]
    assert got.rate > 1 / 0.010


def test_the_full_length_when_verification_rows_are_free():
    slots = [SlotView(4, [0.6, 0.5, 0.4, 0.3]) for _ in range(3)]  # drafts already made (n-gram): no draft cost
    assert choose(slots, FakeCosts(per_row=0.0)).ns == [4, 4, 4]


def test_load_turns_drafting_down():
    """The same machine and acceptance: one slot drafts; with four slots a forward's fixed cost is
    shared by four tokens, so each extra row weighs more and they draft less (here: nothing)."""
    costs = FakeCosts(base=0.010, per_row=0.0025, step0=0.0004, step_row=0.0001)
    rates = [0.7, 0.6, 0.5]
    alone = choose([SlotView(3, rates, "draft-mtp")], costs).ns[0]
    busy = choose([SlotView(3, rates, "draft-mtp") for _ in range(4)], costs).ns
    assert alone >= 2
    assert busy == [0, 0, 0, 0]


def test_slots_with_good_drafts_keep_drafting_under_load():
    slots = [SlotView(3, [0.95, 0.95, 0.95]), SlotView(3, [0.1, 0.1, 0.1], "draft-mtp")]
    got = choose(slots, FakeCosts(base=0.010, per_row=0.002, step0=0.0005))
    assert got.ns == [3, 0]


def test_a_fixed_slot_keeps_its_length_and_counts_in_the_cost():
    slots = [SlotView(3, [0.2] * 3, "draft-mtp", fixed=3), SlotView(3, [0.2] * 3, "draft-mtp")]
    got = choose(slots, FakeCosts(base=0.010, per_row=0.005))
    assert got.ns == [3, 0]
    assert got.seconds == pytest.approx(0.010 + 0.005 * 3)


def test_n_min_leaves_zero_or_at_least_n_min():
    got = choose([SlotView(4, [0.9, 0.2, 0.2, 0.2], n_min=3)], FakeCosts(base=0.010, per_row=0.004))
    assert got.ns[0] in (0, 3, 4)


def test_batched_drafting_is_priced_per_step_not_per_slot():
    """Draft steps that cost a lot alone but batch well: 4 slots drafting together pay one step per
    position, so drafting pays; priced per slot (not batched) it does not."""
    rates = [0.8, 0.7, 0.6]
    costs = FakeCosts(base=0.010, per_row=0.0005, step0=0.004, step_row=0.0001)
    together = choose([SlotView(3, rates, "m", batched=True) for _ in range(4)], costs).ns
    alone = choose([SlotView(3, rates, "m", batched=False) for _ in range(4)], costs).ns
    assert sum(together) > 0 and sum(alone) < sum(together)


def test_nothing_to_choose():
    assert choose([], FakeCosts()).ns == []
    assert choose([SlotView(0), SlotView(0)], FakeCosts()).ns == [0, 0]


def test_cost_model_per_cell_means_uses_calibration_then_measurements():
    """The per-(S, R) means the replays compare the fitted lines with (``fit = False``)."""
    m = CostModel([0.010, 0.011, 0.012, 0.013])
    m.fit = False
    assert m.verify_seconds(1, 3) == pytest.approx(0.012)
    assert m.verify_seconds(1, 6) == pytest.approx(0.015)  # linear beyond the calibration
    m.observe_verify(2, 2, 0.030)  # two slots, one row each: slower than one sequence's forward
    assert m.verify_seconds(2, 2) == pytest.approx(0.030)
    assert m.verify_seconds(2, 4) == pytest.approx(0.030 + 0.013 - 0.011)  # nearest seen + calibrated delta
    m.observe_verify(2, 2, 0.040)
    assert m.verify_seconds(2, 2) == pytest.approx(0.7 * 0.030 + 0.3 * 0.040)


def test_a_stall_kept_in_one_entry_does_not_price_wider_drafts_out():
    """8 slots: 13 and 14 rows were last seen during a stall (42-43 ms) while 15 and 16 rows cost 34-37
    ms: a round is priced at most as the cheapest wider one of the same slots, so the path from 8 to
    16 rows does not run through the stall; narrower rounds and other slot counts are not capped."""
    m = CostModel([0.010] * 16)
    m.fit = False  # the per-(S, R) means (the lines: below)
    for rows, ms in ((8, 23.2), (9, 25.0), (12, 28.5), (13, 42.5), (14, 43.3), (15, 34.4), (16, 36.9)):
        m.observe_verify(8, rows, ms / 1e3)
    m.observe_verify(4, 6, 0.050)
    assert m.verify_seconds(8, 13) == pytest.approx(0.0344) and m.verify_seconds(8, 14) == pytest.approx(0.0344)
    assert m.verify_seconds(8, 16) == pytest.approx(0.0369) and m.verify_seconds(8, 12) == pytest.approx(0.0285)
    assert m.verify_seconds(8, 9) == pytest.approx(0.0250) and m.verify_seconds(4, 6) == pytest.approx(0.050)
    assert m.verify_seconds(8, 10) == pytest.approx(0.0250)  # nearest (9) + calibrated delta (0), capped by 12
    m.monotone = False
    assert m.verify_seconds(8, 13) == pytest.approx(0.0425)


def test_cost_model_forgets_measurements_past_the_horizon():
    m = CostModel([0.010, 0.020], horizon=3)
    m.fit = False
    m.observe_verify(1, 2, 0.100)
    for _ in range(5):
        m.observe_verify(1, 1, 0.010)
    assert m.verify_seconds(1, 2) == pytest.approx(0.010 + 0.020 - 0.010)  # the old 0.100 is stale


def test_verify_line_is_fitted_over_every_width_seen():
    """8 slots at 27 ms plus 1.8 ms per draft row, seen at 8, 16 and 24 rows only: every width between
    and beyond is priced on the line (the rows nobody drafted lately included), and the calibration's
    own slope (0 here) gives way to the measured one."""
    m = CostModel([0.010] * 16)
    for _ in range(10):
        for rows in (8, 16, 24):
            m.observe_verify(8, rows, 0.027 + 0.0018 * (rows - 8))
    a, b = m.line(8)
    assert a == pytest.approx(0.027, rel=0.01) and b == pytest.approx(0.0018, rel=0.01)
    for rows in (8, 13, 20, 32):
        assert m.verify_seconds(8, rows) == pytest.approx(0.027 + 0.0018 * (rows - 8), rel=0.01)
    # a slot count never seen: the nearest one's line at the same draft rows, plus the calibrated delta (0)
    assert m.verify_seconds(6, 10) == pytest.approx(m.verify_seconds(8, 12))


def test_verify_line_takes_the_calibrated_slope_until_widths_differ():
    m = CostModel([0.010, 0.011, 0.012, 0.013])  # 1 ms per row
    assert m.line(2) is None and m.verify_seconds(2, 4) == pytest.approx(0.013)  # the calibration alone
    m.observe_verify(2, 2, 0.030)  # two slots, one row each: slower than one sequence's forward
    assert m.verify_seconds(2, 2) == pytest.approx(0.030)
    assert m.verify_seconds(2, 4) == pytest.approx(0.032)  # the calibrated slope from the one width seen
    m.observe_verify(2, 2, 0.040)
    assert m.verify_seconds(2, 2) == pytest.approx((0.97 * 0.030 + 0.040) / 1.97)  # a decayed mean


def test_a_stall_moves_the_verify_line_by_a_bounded_step():
    """Once a line has LINE_CLIP_AFTER rounds, one round 5x slower enters it as LINE_CLIP x the
    prediction: the price of every width rises by a bounded step, not fivefold for a rarely seen one."""
    from gemmaspec.speculative.chooser import LINE_CELL_PRIOR, LINE_CLIP, LINE_DECAY

    m = CostModel([0.010] * 4)
    for _ in range(4):
        m.observe_verify(1, 1, 0.010)
    w = sum(LINE_DECAY ** k for k in range(4))
    m.observe_verify(1, 1, 0.050)
    line = (LINE_DECAY * w * 0.010 + LINE_CLIP * 0.010) / (LINE_DECAY * w + 1)
    assert m.line(1)[0] == pytest.approx(line)
    # the cell (1, 1) also keeps the clipped round's offset from the line before it, shrunk
    assert m.verify_seconds(1, 1) == pytest.approx(line + (LINE_CLIP - 1) * 0.010 / (1 + LINE_CELL_PRIOR))
    assert m.verify_seconds(1, 1) < 0.014


def test_a_width_seen_often_keeps_its_own_offset_from_the_line():
    """The kernels' row counts are uneven: 16 rows of 8 slots runs 4 ms above the line through the
    others; seen often, it keeps most of that offset (shrunk by LINE_CELL_PRIOR rounds; the line takes
    a share), the widths on the line keep next to none, a width never seen lies on the line, and no
    width is priced above a wider one seen."""
    m = CostModel([0.010] * 16)
    line = lambda r: 0.027 + 0.0018 * (r - 8)  # noqa: E731
    for _ in range(30):
        for rows in (8, 12, 20, 24, 32):
            m.observe_verify(8, rows, line(rows))
        m.observe_verify(8, 16, line(16) + 0.004)
    a, b = m.line(8)
    assert m.verify_seconds(8, 16) - (a + b * 8) > 0.5 * 0.004  # the line took a share of it
    assert abs(m.verify_seconds(8, 12) - (a + b * 4)) < 0.001
    assert m.verify_seconds(8, 16) <= m.verify_seconds(8, 20)
    assert m.verify_seconds(8, 28) == pytest.approx(m.line(8)[0] + m.line(8)[1] * 20)  # never seen: on the line


def test_verify_prices_follow_every_round_observed():
    """The cost model keeps a round's lines and widest-width minima between observations (the chooser
    asks for every width each round): each price equals one computed from scratch, before and after a
    round that moves the line and a width's offset."""
    def fresh_copy(m: CostModel) -> CostModel:
        c = CostModel(m.cal)
        c.lines = {k: list(v) for k, v in m.lines.items()}
        c.cells = {s: {r: list(v) for r, v in d.items()} for s, d in m.cells.items()}
        c.round = m.round
        return c
    m = CostModel([0.010] * 16)
    for i in range(40):
        for rows in (8, 12, 16, 24):
            m.observe_verify(8, rows, 0.027 + 0.0018 * (rows - 8) + (0.003 if rows == 16 and i % 3 else 0.0))
    before = [m.verify_seconds(8, r) for r in range(8, 33)]
    assert before == [fresh_copy(m).verify_seconds(8, r) for r in range(8, 33)]
    m.observe_verify(8, 12, 0.060)  # a slow round of 12 rows: the line and 12's offset move
    after = [m.verify_seconds(8, r) for r in range(8, 33)]
    assert after == [fresh_copy(m).verify_seconds(8, r) for r in range(8, 33)]
    assert after[12 - 8] > before[12 - 8] and after != before


def test_verify_lines_are_forgotten_past_the_horizon():
    m = CostModel([0.010, 0.020], horizon=3)
    m.observe_verify(2, 2, 0.100)
    for _ in range(5):
        m.observe_verify(1, 1, 0.010)
    assert m.line(2) is None
    # slot count 1's line at the same draft rows (1: 0.010 + the calibrated 0.010 per row), plus the
    # calibrated delta between its 2 rows and these 3 (0.030 - 0.020)
    assert m.verify_seconds(2, 3) == pytest.approx(0.020 + 0.010)


def test_cost_model_draft_steps():
    m = CostModel([0.010])
    assert m.draft_seconds("draft-mtp", 2) == pytest.approx(0.1 * 0.010 * 2)  # the prior
    m.observe_draft("draft-mtp", 2, 0.001)
    assert m.draft_seconds("draft-mtp", 2) == pytest.approx(0.001)
    assert m.draft_seconds("draft-mtp", 1) == pytest.approx(0.001)  # a smaller batch: not more
    assert m.draft_seconds("draft-mtp", 4) == pytest.approx(0.002)  # a larger one: scaled up


def test_acceptance_by_position_and_its_parent():
    pooled = Acceptance(4, decay=1.0)
    for _ in range(20):
        pooled.update(3, 3)
    mine = Acceptance(4, decay=1.0, parent=pooled)
    assert mine.rates(2) == pytest.approx(pooled.rates(2))  # nothing of its own yet
    for _ in range(20):
        mine.update(3, 0)  # its own first drafts all rejected
    assert mine.rates(1)[0] < 0.1 < pooled.rates(1)[0]
    a = Acceptance(4, decay=1.0)
    a.update(4, 1)  # position 0 kept, position 1 rejected, 2 and 3 never tested
    assert a.reached == [1.0, 1.0, 0.0, 0.0] and a.acc == [1.0, 0.0, 0.0, 0.0]


def test_a_faded_record_is_tried_again():
    a = Acceptance(3, decay=0.9)
    for _ in range(30):
        a.update(3, 0)
    low = a.rates(1)[0]
    for _ in range(60):
        a.tick()
    assert low < 0.2 and a.rates(1)[0] > 0.7


def test_a_drafter_that_stops_early_is_priced_by_its_expected_rows_and_steps():
    """Asked for 2 tokens, the drafter drafts the first half the time and the second half of those
    (its p-min): 0.75 rows expected, step 1 always, step 2 in half the rounds."""
    slot = SlotView(2, [0.5, 0.5], "m", fixed=2, cont=[0.5, 0.5])
    got = choose([slot], FakeCosts(base=0.010, per_row=0.004, step0=0.001))
    assert got.seconds == pytest.approx(0.010 + 0.004 * 0.75 + 0.001 + 0.5 * 0.001)
    always = choose([SlotView(2, [0.5, 0.5], "m", fixed=2)], FakeCosts(base=0.010, per_row=0.004, step0=0.001))
    assert always.seconds == pytest.approx(0.010 + 0.004 * 2 + 0.002)


class OverheadCosts(FakeCosts):
    """FakeCosts plus a round's planning time outside the timed draft steps: ``idle`` when no slot
    drafts with a model, ``drafting`` when one does."""

    def __init__(self, idle=0.0, drafting=0.0, **kw):
        super().__init__(**kw)
        self.idle, self.drafting = idle, drafting

    def overhead_seconds(self, seqs, drafting):
        return self.drafting if drafting else self.idle


def test_a_fixed_cost_of_drafting_at_all_turns_a_marginal_draft_off():
    """Steps and rows alone make a one-token draft pay (1.3 tokens for 0.0115 s against 1 for 0.010);
    a round that drafts with the model also pays 0.003 s of setup, and then it does not."""
    slot = [SlotView(1, [0.3], "draft-mtp")]
    base = dict(base=0.010, per_row=0.001, step0=0.0005)
    assert choose(slot, FakeCosts(**base)).ns == [1]
    got = choose(slot, OverheadCosts(idle=0.0005, drafting=0.003, **base))
    assert got.ns == [0]
    assert got.seconds == pytest.approx(0.0105)  # the idle overhead counts in the prediction too
    # a draft already made (n-gram lookup) pays no model's setup
    assert choose([SlotView(1, [0.3])], OverheadCosts(idle=0.0005, drafting=0.003, **base)).ns == [1]


def test_cost_model_learns_the_overhead_per_slot_count_and_drafting():
    m = CostModel([0.010])
    assert m.overhead_seconds(2, True) == 0.0  # nothing seen
    m.observe_overhead(2, True, 0.002)
    m.observe_overhead(2, False, 0.0004)
    assert m.overhead_seconds(2, True) == pytest.approx(0.002)
    assert m.overhead_seconds(2, False) == pytest.approx(0.0004)
    assert m.overhead_seconds(4, True) == pytest.approx(0.004)  # more slots than seen: scaled up
    assert m.overhead_seconds(1, True) == pytest.approx(0.002)  # fewer: not less
    m.observe_overhead(2, True, 0.004)
    assert m.overhead_seconds(2, True) == pytest.approx(0.7 * 0.002 + 0.3 * 0.004)
    m.observe_overhead(3, False, -0.001)  # clock jitter below zero counts as none
    assert m.overhead_seconds(3, False) == 0.0


def test_a_thin_own_record_is_explored_instead_of_inheriting_a_low_pooled_estimate():
    """Other requests taught the pool that the drafter is poor (acceptance ~0.2): a new request's
    plain estimate is the pool's, for which drafting does not pay, and a round that drafts nothing
    tests nothing, so it would never learn that its own text drafts well. The upper confidence bound
    on its first position makes it draft; as its own tests accumulate the bound closes on the
    estimate."""
    pooled = Acceptance(4, decay=1.0, weight=2.0)
    for _ in range(50):
        pooled.update(3, 0)
        pooled.update(3, 1)
        pooled.update(3, 0)
        pooled.update(3, 0)
        pooled.update(3, 0)
    mine = Acceptance(4, parent=pooled)
    plain, bound = mine.rates(3), mine.rates(3, explore=1.0)
    assert plain[0] < 0.25
    p = plain[0]
    assert bound[0] == pytest.approx(p + (p * (1 - p) / 1.0) ** 0.5)
    assert all(b == pytest.approx(min(1.0, q + (q * (1 - q)) ** 0.5)) for b, q in zip(bound, plain))
    costs = FakeCosts(base=0.010, per_row=0.003, step0=0.0005)
    assert choose([SlotView(3, plain, "draft-mtp")], costs).ns == [0]
    assert choose([SlotView(3, bound, "draft-mtp")], costs).ns[0] > 0
    for _ in range(30):  # its own drafts do well: the estimate rises and the bound narrows to it
        mine.update(3, 3)
    p = mine.rates(1)[0]
    assert p > 0.9
    assert mine.rates(1, explore=1.0)[0] - p < 0.3 * (p * (1 - p)) ** 0.5 + 1e-9


def test_untested_later_positions_are_explored_too():
    """A request that drafted only 1 token has tested position 1 only: its bound there is narrow,
    the untested positions keep a wide one, so a thin record of long drafts does not stay thin
    because the pool's later positions were poor."""
    pooled = Acceptance(4, decay=1.0, weight=2.0)
    for _ in range(40):
        pooled.update(3, 1)  # others: the first draft token accepted, the second not
    mine = Acceptance(4, parent=pooled, weight=PRIOR_WEIGHT)
    for _ in range(10):
        mine.update(1, 1)  # its own rounds drafted 1 token each, all accepted
    plain, bound = mine.rates(3), mine.rates(3, explore=1.0)
    assert plain[0] > 0.8 and plain[1] < 0.1
    widths = [b - q for b, q in zip(bound, plain)]
    assert widths[0] < 0.15  # tested ten times
    assert bound[1] == pytest.approx(plain[1] + (plain[1] * (1 - plain[1])) ** 0.5)  # never tested
    assert widths[1] > 2 * widths[0]


def test_exploration_narrows_as_slots_are_added():
    assert explore_width(1) == EXPLORE
    widths = [explore_width(s) for s in (1, 2, 4, 8, 16)]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[1]
    assert widths[3] == pytest.approx(EXPLORE / 8 ** EXPLORE_SLOTS)
    # a request whose first drafts failed: at one slot its bound still buys a draft; at 8 slots the
    # full width would have every slot draft 3, the narrowed one drafts nothing
    thin = Acceptance(4, parent=Acceptance(4), weight=PRIOR_WEIGHT)
    for _ in range(3):
        thin.update(3, 0)
    costs = FakeCosts(base=0.030, per_row=0.0015, step0=0.0005)
    assert choose([SlotView(3, thin.rates(3, EXPLORE), "draft-mtp") for _ in range(8)], costs).ns == [3] * 8
    views = [SlotView(3, thin.rates(3, explore_width(8)), "draft-mtp") for _ in range(8)]
    assert choose(views, costs).ns == [0] * 8
    assert choose([SlotView(3, thin.rates(3, explore_width(1)), "draft-mtp")], costs).ns[0] > 0


def test_one_missed_draft_moves_a_request_estimate_by_a_third():
    pooled = Acceptance(4, decay=1.0, weight=2.0)
    for _ in range(50):
        pooled.update(1, 1)
    mine = Acceptance(4, parent=pooled, weight=PRIOR_WEIGHT)
    p = pooled.rates(1)[0]
    mine.update(1, 0)
    assert mine.rates(1)[0] == pytest.approx(p * PRIOR_WEIGHT / (PRIOR_WEIGHT + 1))
    assert PRIOR_WEIGHT == 2.0


def test_the_reported_tokens_use_the_estimates_without_the_exploration_bound():
    got = choose([SlotView(2, [0.9, 0.5], "draft-mtp", plain=[0.6, 0.5])], FakeCosts(base=0.010))
    assert got.ns == [2]
    assert got.tokens == pytest.approx(1 + 0.6 + 0.3)


def test_a_measured_rate_weighs_seconds_over_rounds_not_within_one():
    """One slot, an n-gram draft (free) with acceptance 0.9, 0.5, 0.5; a forward of 10 ms + 3 ms per row.
    The round's own ratio peaks at 1 token (1.9 / 13 ms; 2 tokens: 2.35 / 16 ms is within the
    tolerance); when the server makes only 100 tokens of a second, the second token's 0.45 tokens for
    3 ms (150 / s) pays and it drafts 2. A server making 200 tokens of a second drafts a poor slot
    (0.5) not at all, where the round's own ratio (1.5 / 13 ms > 1 / 10 ms) would."""
    costs = FakeCosts(base=0.010, per_row=0.003)
    good = [SlotView(3, [0.9, 0.5, 0.5])]
    assert choose(good, costs).ns == [1]
    got = choose(good, costs, rate=100.0)
    assert got.ns == [2] and got.tokens == pytest.approx(2.35) and got.seconds == pytest.approx(0.016)
    poor = [SlotView(3, [0.5, 0.5, 0.5])]
    assert choose(poor, costs).ns == [1]
    assert choose(poor, costs, rate=200.0).ns == [0]


@settings(max_examples=60, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6),
       base=st.floats(0.001, 0.05), per_row=st.floats(0.0, 0.02), step=st.floats(0.0, 0.003),
       model=st.booleans())
def test_at_the_rounds_own_best_rate_both_criteria_agree(rates, base, per_row, step, model):
    """Dinkelbach's fixed point: with the rate set to the best ratio a round can reach, the length that
    maximises tokens - rate * seconds reaches that ratio too (one slot, no tolerance: the search
    tries every length)."""
    view = [SlotView(len(rates), rates, "draft-mtp" if model else "")]
    costs = FakeCosts(base=base, per_row=per_row, step0=step)
    best = choose(view, costs, tolerance=0.0)
    got = choose(view, costs, tolerance=0.0, rate=best.rate)
    assert got.rate == pytest.approx(best.rate, rel=1e-9)


def test_the_planner_rate_per_slot_count_waits_decays_and_forgets():
    """The planner's measured rate (speculative/planner.py): none before RATE_MIN_ROUNDS decayed rounds
    of that many slots, then decayed tokens over decayed seconds, kept per slot count, and started again once
    its last round is past the horizon (200 rounds without a cost model)."""
    from gemmaspec.speculative.chooser import RATE_DECAY, RATE_MIN_ROUNDS
    from gemmaspec.speculative.planner import RoundPlanner

    p = RoundPlanner(engine=None)
    n = next(k for k in range(1, 100) if sum(RATE_DECAY ** j for j in range(k)) >= RATE_MIN_ROUNDS)  # decayed
    for i in range(n):
        assert p.rate_for(4) is None
        p.totals.rounds += 1
        p._observe_rate(4, 8 if i % 2 else 4, 0.020)
    t = sum(RATE_DECAY ** (n - 1 - i) * (8 if i % 2 else 4) for i in range(n))
    s = sum(RATE_DECAY ** (n - 1 - i) * 0.020 for i in range(n))
    assert p.rate_for(4) == pytest.approx(t / s) and p.rate_for(2) is None
    p.totals.rounds += 201
    assert p.rate_for(4) is None
    p._observe_rate(4, 10, 0.010)
    assert p._rates[4][:3] == pytest.approx([10, 0.010, 1.0])


def test_new_requests_make_the_measured_rate_count_for_less():
    """A rate measured on other requests (another kind of text) weighs RATE_NEW_REQUEST per request that
    starts: one new request among several keeps it in use, a batch that turned over waits for its own
    rounds (the rounds' own ratio until then), and they move it faster than if it had kept its weight."""
    from gemmaspec.speculative.chooser import RATE_DECAY, RATE_MIN_ROUNDS, RATE_NEW_REQUEST
    from gemmaspec.speculative.planner import RoundPlanner

    p, q = RoundPlanner(engine=None), RoundPlanner(engine=None)  # q: no request starts
    for pl in (p, q):
        for _ in range(40):
            pl.totals.rounds += 1
            pl._observe_rate(4, 8, 0.020)  # 400 tokens/s
    rounds = sum(RATE_DECAY ** j for j in range(40))
    p.new_request(0)
    assert p._rates[4][2] == pytest.approx(RATE_NEW_REQUEST * rounds)
    assert p.rate_for(4) == pytest.approx(400.0)  # the same rate, with less weight
    for key in (1, 2, 3):
        p.new_request(key)
    assert RATE_NEW_REQUEST ** 4 * rounds < RATE_MIN_ROUNDS and p.rate_for(4) is None
    for _ in range(3):  # the new batch's rounds: 200 tokens/s
        for pl in (p, q):
            pl.totals.rounds += 1
            pl._observe_rate(4, 4, 0.020)
    w_old = RATE_NEW_REQUEST ** 4 * rounds * RATE_DECAY ** 3
    w_new = sum(RATE_DECAY ** j for j in range(3))
    assert p.rate_for(4) == pytest.approx((400 * w_old + 200 * w_new) / (w_old + w_new))
    assert p.rate_for(4) < q.rate_for(4) - 50


def test_a_slot_whose_tokens_weigh_less_drafts_less():
    """Two slots, one that cannot draft. The other's first draft token gains 0.6 for 3 ms of everyone's
    round; at 150 tokens/s a second is worth 0.45 tokens: it drafts when every token counts alike, and
    not when its tokens weigh 0.5 against its neighbour's 1.5 (0.3 < 0.45; the replay's fair-shares
    variant)."""
    costs = FakeCosts(base=0.010, per_row=0.003)
    fast, idle = SlotView(3, [0.6, 0.6, 0.6]), SlotView(0)
    assert choose([fast, idle], costs, rate=150.0).ns == [1, 0]
    fast.weight, idle.weight = 0.5, 1.5
    got = choose([fast, idle], costs, rate=150.0)
    assert got.ns == [0, 0] and got.tokens == pytest.approx(2.0)  # the reported tokens are not weighted


def test_the_rate_is_no_less_than_the_rounds_own_without_drafting():
    """A measured rate of 50 tokens/s where this round without drafting makes 100 (1 token in 10 ms): a
    first draft token worth 0.25 for 3 ms (83 tokens/s) pays against 50 but would pull the server below
    what plain rounds make; with the floor it is not drafted. Above the floor the rate is used as given."""
    costs = FakeCosts(base=0.010, per_row=0.003)
    poor = [SlotView(3, [0.25, 0.25, 0.25])]
    assert choose(poor, costs, rate=50.0, floor=False).ns == [1]
    assert choose(poor, costs, rate=50.0, floor=True).ns == [0]
    good = [SlotView(3, [0.9, 0.5, 0.5])]
    assert choose(good, costs, rate=120.0, floor=True).ns == choose(good, costs, rate=120.0, floor=False).ns == [2]
