"""benchmarks/chooser_sim.py: the offline replay of the server's rounds that chose the planner's
exploration and prior weight. Its round arithmetic and its "known acceptance" rates must be right for
its comparisons to mean anything."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import chooser_sim as sim  # noqa: E402

COSTS = {"calibration_s": [0.010, 0.012, 0.014, 0.016], "verify_s": {"1,1": 0.010, "1,4": 0.016},
         "draft_s": {"draft-mtp,1": 0.001}, "overhead_s": {"1,1": 0.0005, "1,0": 0.0}}


def test_a_fixed_length_replay_keeps_one_plus_the_accepted_prefix_per_round():
    truth = sim.Truth(COSTS)
    assert truth.verify(1, 1) == pytest.approx(0.010) and truth.verify(1, 4) == pytest.approx(0.016)
    assert truth.verify(1, 2) == pytest.approx(0.012)  # on the line through the measured rows
    positions = {str(g): [3, 2, "draft-mtp"] for g in range(1, 47)}  # 3 drafted, the first 2 accepted
    pl = sim.SimPlanner(truth)
    seconds, tokens, chosen = sim.simulate_phase(pl, positions, 1, "draft-mtp", 3, False, 48, random.Random(0), 0.0)
    # rounds at generated 1, 4, ..., 43 keep 3 tokens each (15 rounds, 45 tokens); at 46 the room is 1
    # draft token: it keeps 2 -> 48 in all, 47 of them after the prefill's first
    assert tokens == 47 and not chosen
    expect = 15 * (truth.verify(1, 4) + 3 * 0.001 + 0.0005) + (truth.verify(1, 2) + 0.001 + 0.0005)
    assert seconds == pytest.approx(expect)


def test_a_model_that_stops_early_drafts_and_steps_only_what_it_drafted():
    truth = sim.Truth(COSTS)
    positions = {str(g): [1, 1, "draft-mtp"] for g in range(1, 47)}  # its p-min stops after 1 token
    seconds, tokens, _ = sim.simulate_phase(sim.SimPlanner(truth), positions, 1, "draft-mtp", 3, False, 48,
                                            random.Random(0), 0.0)
    assert tokens == 47
    # rounds at generated 1, 3, ..., 45: 2 rows verified, 2 draft steps (the second the one its p-min
    # stopped); at 47 no room to draft: a plain step
    assert seconds == pytest.approx(23 * (truth.verify(1, 2) + 2 * 0.001 + 0.0005) + truth.verify(1, 1))


def test_known_acceptance_is_the_traces_conditional_rate():
    positions = {"1": [3, 2, "draft-mtp"], "2": [3, 0, "draft-mtp"], "3": [2, 2, "draft-mtp"], "4": [3, 3, "draft-mtp"]}
    rates = sim._true_rates(positions, "draft-mtp")
    assert rates[("draft-mtp", "gain")] == pytest.approx([3 / 4, 3 / 3, 1 / 3])
    assert rates[("draft-mtp", "cont")] == pytest.approx([1.0, 1.0, 3 / 4])


def test_truth_cells_keep_a_well_measured_width_off_the_line():
    """--truth-cells N: a (slots, rows) measured N times or more costs its own median; the others stay
    on the slot count's line, so a cost model that assumes a line is judged against the machine's
    unevenness too."""
    costs = {**COSTS, "verify_s": {"1,1": 0.010, "1,2": 0.020, "1,4": 0.016},
             "samples": {"verify": {"1,1": 50, "1,2": 12, "1,4": 3}}}
    line = sim.Truth(costs)
    cells = sim.Truth(costs, cells=10)
    assert cells.verify(1, 2) == pytest.approx(0.020) and line.verify(1, 2) != pytest.approx(0.020)
    assert cells.verify(1, 1) == pytest.approx(0.010)
    assert cells.verify(1, 4) == pytest.approx(line.verify(1, 4))  # 3 samples: on the line
    assert cells.verify(1, 3) == pytest.approx(line.verify(1, 3))


def test_a_negative_truth_cells_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as got:
        sim.sim(sim.argparse.Namespace(variant="base", truth_cells=-1))
    assert "--truth-cells -1" in str(got.value)


def test_several_prompts_are_taken_from_one_queue_as_the_bench_sends_them():
    """--mix: a phase's users take the kind's prompts from one queue (cycled up to a multiple of the
    users); at one user that is each prompt's phase one after the other."""
    truth = sim.Truth(COSTS)
    a = {str(g): [3, 3, "draft-mtp"] for g in range(1, 47)}  # every draft accepted
    b = {str(g): [3, 0, "draft-mtp"] for g in range(1, 47)}  # every draft rejected

    def phase(prompts, users):
        return sim.simulate_phase(sim.SimPlanner(truth), prompts, users, "draft-mtp", 3, False, 48,
                                  random.Random(0), 0.0)
    sa, ta, _ = phase(a, 1)
    sb, tb, _ = phase(b, 1)
    both, tokens, _ = phase([a, b], 1)
    assert tokens == ta + tb == 94 and both == pytest.approx(sa + sb)
    # two users, three prompts: four requests (a, b, a, a), each 47 tokens after its prefill's first
    _, tokens, _ = phase([a, b, a], 2)
    assert tokens == 4 * 47
    # one prompt: every user decodes it (the bench's --prompts-per-kind 1)
    _, tokens, _ = phase(a, 3)
    assert tokens == 3 * 47


def test_the_oracle_is_refused_with_several_prompts_in_one_line():
    with pytest.raises(SystemExit) as got:
        sim.sim(sim.argparse.Namespace(variant="oracle", mix=True, truth_cells=0))
    assert "--mix" in str(got.value)


def test_fair_share_weights_favour_the_slow_request_and_average_one():
    """(mean rate / own rate) ** fairness over the measured slots, scaled to a mean of 1; an unmeasured
    slot counts as the mean; one slot, nothing measured or fairness 0: all 1."""
    w = sim.slot_weights([100.0, 300.0], 1.0)
    assert w == pytest.approx([1.5, 0.5])  # (200/100, 200/300) = (2, 2/3), mean 4/3
    assert sum(sim.slot_weights([50.0, None, 200.0], 1.0)) == pytest.approx(3.0)
    a, b, c = sim.slot_weights([50.0, None, 200.0], 1.0)
    assert a > b > c and b == pytest.approx(1.0 / ((2.5 + 1.0 + 0.625) / 3))
    assert sim.slot_weights([100.0], 1.0) == [1.0] and sim.slot_weights([None, None], 1.0) == [1.0, 1.0]
    assert sim.slot_weights([100.0, 300.0], 0.0) == [1.0, 1.0]
    half = [2 ** 0.5, (2 / 3) ** 0.5]
    assert sim.slot_weights([100.0, 300.0], 0.5) == pytest.approx([x * 2 / sum(half) for x in half])


@pytest.mark.parametrize("pf", [0.0, 1.0])
def test_a_mixed_phase_chooses_its_lengths_with_and_without_fair_shares(pf):
    """Two users on different prompts (one whose drafts are always accepted, one whose drafts never
    are), lengths chosen per round: the replay plans rounds either way, and with the fair-shares
    variant each request's own rate is tracked (the accepted one's higher)."""
    truth = sim.Truth(COSTS)
    good = {str(g): [3, 3, "draft-mtp"] for g in range(1, 47)}
    bad = {str(g): [3, 0, "draft-mtp"] for g in range(1, 47)}
    pl = sim.SimPlanner(truth)
    pl.pf = pf
    seconds, tokens, chosen = sim.simulate_phase(pl, [good, bad], 2, "draft-mtp", 3, True, 48,
                                                 random.Random(0), 0.0)
    assert tokens == 2 * 47 and seconds > 0
    assert sum(c for n, c in chosen.items() if n > 0) > 0, chosen
    rates = {s: r[0] / r[1] for s, r in pl.slot_rate.items()}
    assert len(rates) == 2 and rates[0] > rates[1]
