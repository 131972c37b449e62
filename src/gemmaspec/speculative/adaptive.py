"""Adaptive draft length (``--spec-draft-n-max auto``).

Each round picks the draft length k that maximises expected tokens per second:

    tokens(k) = 1 + sum_{j=1..k} prod_{i=1..j} a_i        (a_i: acceptance at draft position i,
                                                            given position i-1 was accepted)
    seconds(k) = the round's measured time (drafter excluded) when k tokens were drafted, a decayed
                 mean learned online; for a k not seen yet, the target's forward time over k+1 tokens
                 measured once per engine (see :meth:`gemmaspec.engine.Engine.forward_costs`) plus
                 what the nearest seen k took beyond its own calibrated forward (the loop, attention
                 over a longer context, a machine busier than at calibration)
               + the drafter's measured time per round

Both are learned online within the request. Acceptance per position uses exponentially decayed
counts shrunk towards the previous position's estimate (drafts that survived position i-1 tend to
survive position i as well; position 0 starts from 0.85), so a run of easy text raises k and hard text lowers it within a few
rounds, and a position that stopped being tried drifts back to the prior (keeps exploring). Round
times are decayed averages per k; an untried k is extrapolated from the tried ones with a prior
marginal cost of ``prior_slope`` × the cheapest round per extra draft token.
"""

from __future__ import annotations


class AdaptiveDraftLength:
    """Online controller of the draft length.

    Args:
        forward_costs: seconds of one target forward over 1, 2, ... tokens (index k = k+1 tokens).
        n_cap: largest draft length it may choose (≤ len(forward_costs) - 1).
        decay: weight kept by old observations per round (0..1).
    """

    def __init__(self, forward_costs, n_cap: int = 8, decay: float = 0.95):
        self.costs = list(forward_costs)
        self.n_cap = min(n_cap, len(self.costs) - 1)
        self.decay = decay
        self.reached = [0.0] * self.n_cap
        self.acc = [0.0] * self.n_cap
        self.draft_time = 0.0  # decayed mean drafter seconds per round
        self.round_time = [0.0] * len(self.costs)  # decayed mean round time (drafter excluded) per drafted length
        self.round_seen = [0] * len(self.costs)
        self.last_k = 0

    def acceptance(self, i: int) -> float:
        """Estimated acceptance at draft position i given i-1 was accepted: decayed counts shrunk
        towards position i-1's estimate (position 0: towards 0.85), with a prior weight of 1."""
        prior = 0.85 if i == 0 else self.acceptance(i - 1)
        return (self.acc[i] + prior) / (self.reached[i] + 1.0)

    def expected_tokens(self, k: int) -> float:
        total, prob = 1.0, 1.0
        for i in range(k):
            prob *= self.acceptance(i)
            total += prob
        return total

    def seconds(self, k: int) -> float:
        """Expected seconds of a round drafting k tokens: measured when seen (the calibration goes
        stale when the machine's load changes), else calibrated forward corrected by the nearest seen k."""
        if self.round_seen[k]:
            verify = self.round_time[k]
        else:
            seen = [j for j in range(len(self.costs)) if self.round_seen[j]]
            if seen:
                j = min(seen, key=lambda j: (abs(j - k), j))
                verify = self.costs[k] + self.round_time[j] - self.costs[j]
            else:
                verify = self.costs[k]
        return max(1e-6, verify + (self.draft_time if k else 0.0))

    def choose(self) -> int:
        """The draft length for the next round."""
        best, best_rate = 0, 0.0
        for k in range(self.n_cap + 1):
            rate = self.expected_tokens(k) / self.seconds(k)
            if rate > best_rate * 1.0001:
                best, best_rate = k, rate
        self.last_k = best
        return best

    def update(self, n_drafted: int, n_accepted: int, draft_seconds: float, round_seconds: float | None = None) -> None:
        """Record a round: drafts proposed and accepted, the drafter's seconds and the whole round's."""
        for i in range(self.n_cap):
            self.reached[i] *= self.decay
            self.acc[i] *= self.decay
        # position i is tested only when positions 0..i-1 were accepted: 0..n_accepted, capped
        for i in range(min(n_drafted, n_accepted + 1, self.n_cap)):
            self.reached[i] += 1.0
            if i < n_accepted:
                self.acc[i] += 1.0
        if n_drafted:
            self.draft_time = 0.7 * self.draft_time + 0.3 * draft_seconds
        if round_seconds is not None and n_drafted < len(self.costs):
            spent = round_seconds - draft_seconds
            seen = self.round_seen[n_drafted]
            self.round_time[n_drafted] = spent if seen == 0 else 0.7 * self.round_time[n_drafted] + 0.3 * spent
            self.round_seen[n_drafted] = seen + 1
