"""The adaptive draft-length controller: drafts long on easy text, short on hard text."""

from gemmaspec.speculative.adaptive import AdaptiveDraftLength

COSTS = [0.018, 0.020, 0.022, 0.024, 0.028, 0.032, 0.036, 0.040, 0.046]  # seconds for 1..9 tokens


def _drive(accept_all: bool, rounds: int = 30):
    c = AdaptiveDraftLength(COSTS, n_cap=8)
    for _ in range(rounds):
        k = c.choose()
        c.update(k, k if accept_all else 0, 0.0, COSTS[k])
    return c


def test_easy_text_drafts_long():
    c = _drive(True)
    assert c.choose() >= 6
    assert c.acceptance(0) > 0.9


def test_hard_text_stops_drafting():
    c = _drive(False)
    assert c.choose() <= 1
    assert c.acceptance(0) < 0.2


def test_recovers_when_text_turns_easy():
    c = _drive(False)
    for _ in range(40):
        k = c.choose()
        c.update(k, k, 0.0, COSTS[k])
    assert c.choose() >= 4


def test_conditional_counts_only_tested_positions():
    c = AdaptiveDraftLength(COSTS, n_cap=4, decay=1.0)
    c.update(4, 1, 0.0, COSTS[4])  # position 0 accepted, position 1 rejected, 2-3 never tested
    assert c.reached == [1.0, 1.0, 0.0, 0.0]
    assert c.acc == [1.0, 0.0, 0.0, 0.0]


def test_measured_round_times_override_a_stale_calibration():
    """The calibration says long drafts are cheap, but rounds of 5+ tokens really take 10x longer
    (the machine got busy, or the kernel's wide path is slow here): the measured times win."""
    c = AdaptiveDraftLength(COSTS, n_cap=8)
    for _ in range(40):
        k = c.choose()
        c.update(k, k, 0.0, COSTS[k] if k <= 3 else 0.2)
    assert c.choose() == 3
