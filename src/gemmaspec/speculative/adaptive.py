"""Adaptive draft length (``--spec-draft-n-max auto``).

Each round picks the draft length k that maximises expected tokens per second:

    tokens(k) = 1 + sum_{j=1..k} prod_{i=1..j} a_i        (a_i: acceptance at draft position i,
                                                            given position i-1 was accepted)
    seconds(k) = measured time of a round that drafted k tokens (drafting + verify)

Both are learned online within the request. Acceptance per position uses exponentially decayed
counts with a Beta(1, 1) prior, so a run of easy text raises k and hard text lowers it within a few
rounds, and a position that stopped being tried drifts back to the prior (keeps exploring). Round
times are decayed averages per k; an untried k is extrapolated from the tried ones with a prior
marginal cost of ``prior_slope`` × the cheapest round per extra draft token.
"""

from __future__ import annotations


class AdaptiveDraftLength:
    """Online controller of the draft length.

    Args:
        n_cap: largest draft length it may choose (≤ 15).
        decay: weight kept by old observations per round (0..1).
        prior_slope: assumed cost of one more draft token, as a fraction of a plain round.
    """

    def __init__(self, n_cap: int = 8, decay: float = 0.95, prior_slope: float = 0.25):
        self.n_cap, self.decay, self.prior_slope = n_cap, decay, prior_slope
        self.reached = [0.0] * n_cap
        self.acc = [0.0] * n_cap
        self.time = {}  # k -> decayed mean seconds per round
        self.last_k = 0

    def acceptance(self, i: int) -> float:
        return (self.acc[i] + 1.0) / (self.reached[i] + 2.0)

    def expected_tokens(self, k: int) -> float:
        total, prob = 1.0, 1.0
        for i in range(k):
            prob *= self.acceptance(i)
            total += prob
        return total

    def seconds(self, k: int) -> float:
        if k in self.time:
            return self.time[k]
        if not self.time:
            return 1.0 + self.prior_slope * k
        base = min(self.time.values())
        lower = [j for j in self.time if j < k]
        j = max(lower) if lower else min(self.time)
        return self.time[j] + self.prior_slope * base * (k - j)

    def choose(self) -> int:
        """The draft length for the next round."""
        best, best_rate = 0, 0.0
        for k in range(self.n_cap + 1):
            rate = self.expected_tokens(k) / self.seconds(k)
            if rate > best_rate * 1.0001:
                best, best_rate = k, rate
        self.last_k = best
        return best

    def update(self, n_drafted: int, n_accepted: int, seconds: float) -> None:
        """Record a round: drafts proposed and accepted, and the round's wall time in seconds."""
        for i in range(self.n_cap):
            self.reached[i] *= self.decay
            self.acc[i] *= self.decay
        for i in range(min(n_drafted, self.n_cap)):
            self.reached[i] += 1.0
            if i < n_accepted:
                self.acc[i] += 1.0
        old = self.time.get(n_drafted)
        self.time[n_drafted] = seconds if old is None else 0.7 * old + 0.3 * seconds
