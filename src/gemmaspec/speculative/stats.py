"""Acceptance statistics, per request and in total, in llama-server's terms.

acceptance rate = accepted / drafted; mean accepted length = 1 + accepted / verify steps (tokens per
target verify step, the bonus or recovered token included).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters of speculative rounds.

    Attributes:
        drafted: draft tokens proposed.
        accepted: draft tokens accepted (and kept).
        steps: target verify steps (rounds in which at least one draft was proposed).
        rounds: all target forwards of the decode phase, drafts or not.
        accepted_per_pos: accepted counts by draft position (index 0 = first draft token).
        drafted_per_pos: proposed counts by draft position.
        by_drafter: with several drafters (``--spec-type ngram-simple,draft-mtp``), the same counters
            per drafter name for the rounds it drafted (``rounds`` there: rounds it drafted in).
        chosen_n: rounds by the draft length chosen for them from measured costs (the server's
            :mod:`~gemmaspec.speculative.chooser`; empty when nothing chose): ``{n: rounds}``.
    """

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    rounds: int = 0
    accepted_per_pos: list = field(default_factory=list)
    drafted_per_pos: list = field(default_factory=list)
    by_drafter: dict = field(default_factory=dict)
    chosen_n: dict = field(default_factory=dict)

    def record(self, n_drafted: int, n_accepted: int, source: str = "") -> None:
        """Count one round: ``n_drafted`` tokens proposed (0: a plain step), ``n_accepted`` of them
        kept; ``source``: the chain member that drafted them ("" when there is one drafter)."""
        self.rounds += 1
        if n_drafted == 0:
            return
        if source:
            self.by_drafter.setdefault(source, SpecStats()).record(n_drafted, n_accepted)
        self.steps += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        for lst, n in ((self.drafted_per_pos, n_drafted), (self.accepted_per_pos, n_accepted)):
            while len(lst) < n:
                lst.append(0)
            for i in range(n):
                lst[i] += 1

    def record_choice(self, n: int) -> None:
        """Count a round whose draft length ``n`` was chosen for the batch (it may draft fewer:
        the assistant's p-min stops early)."""
        self.chosen_n[n] = self.chosen_n.get(n, 0) + 1

    def chosen_text(self) -> str:
        """``draft n chosen: 0x12 1x30 3x5`` (rounds by chosen length), or "" when nothing chose."""
        if not self.chosen_n:
            return ""
        return "draft n chosen: " + " ".join(f"{n}x{c}" for n, c in sorted(self.chosen_n.items()))

    def merge(self, other: "SpecStats") -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.steps += other.steps
        self.rounds += other.rounds
        for mine, theirs in ((self.drafted_per_pos, other.drafted_per_pos), (self.accepted_per_pos, other.accepted_per_pos)):
            while len(mine) < len(theirs):
                mine.append(0)
            for i, v in enumerate(theirs):
                mine[i] += v
        for name, st in other.by_drafter.items():
            self.by_drafter.setdefault(name, SpecStats()).merge(st)
        for n, c in other.chosen_n.items():
            self.chosen_n[n] = self.chosen_n.get(n, 0) + c

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 1.0

    def llama_line(self) -> str:
        """``draft acceptance = 0.84656 (  160 accepted /   189 generated), mean len =  2.68``"""
        return (f"draft acceptance = {self.acceptance_rate:.5f} ({self.accepted:5d} accepted / "
                f"{self.drafted:5d} generated), mean len = {self.mean_accepted_length:5.2f}")

    def _by_drafter_in_order(self) -> list:
        """``by_drafter``'s items in a list's drafting order (n-gram lookup first, as ``--spec-type``
        puts it), whichever drafted first in the request."""
        from .options import DRAFTLESS_TYPES, MODEL_TYPES

        order = DRAFTLESS_TYPES + MODEL_TYPES
        return sorted(self.by_drafter.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))

    def drafter_lines(self) -> list[str]:
        """Per drafter of a chain, in the list's order, llama.cpp's ``statistics`` line: ``statistics
        ngram-simple: #gen drafts = 5, #gen tokens = 187, #acc tokens = 73, acceptance = 0.39037, mean
        len = 15.60``; [] with one drafter."""
        return [f"statistics {name}: #gen drafts = {st.steps}, #gen tokens = {st.drafted}, "
                f"#acc tokens = {st.accepted}, acceptance = {st.acceptance_rate:.5f}, "
                f"mean len = {st.mean_accepted_length:.2f}" for name, st in self._by_drafter_in_order()]

    def to_dict(self) -> dict:
        out = {"draft_n": self.drafted, "draft_n_accepted": self.accepted, "verify_steps": self.steps,
               "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length,
               "accepted_per_pos": list(self.accepted_per_pos), "drafted_per_pos": list(self.drafted_per_pos)}
        if self.chosen_n:
            out["chosen_n"] = {str(n): c for n, c in sorted(self.chosen_n.items())}
        if self.by_drafter:
            out["by_drafter"] = {name: {k: v for k, v in st.to_dict().items() if not k.endswith("_per_pos")}
                                 for name, st in self._by_drafter_in_order()}
        return out


@dataclass
class TokenSource:
    """Where a generated token came from in its decode round (the server's ``return_provenance``).

    Attributes:
        kind: the drafter's type (``draft-mtp``, ``ngram-simple``, ``draft-simple``) for an accepted
            draft; ``target`` for the target's own token (the first token, a plain step's, the token
            recovered after a rejection, or the bonus after all drafts were accepted).
        pos: the token's position in its round (drafts 0..accepted-1, then the target's token).
        drafted: drafts the round proposed (0: no drafting).
        drafter: the drafter of the round's drafts ("" when none drafted).
        rejected: on the target's token, the drafts it replaced (empty when all were accepted).
    """

    kind: str
    pos: int = 0
    drafted: int = 0
    drafter: str = ""
    rejected: list[int] = field(default_factory=list)
