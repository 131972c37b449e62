"""Drafters: what proposes tokens for the target to verify.

A drafter only proposes; the engine verifies (:mod:`.verify`) and tells the drafter what was kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Draft:
    """Proposed tokens and, when the drafter has them, their distributions.

    Attributes:
        tokens: draft token ids (0..n_max of them).
        dists: per draft position ``(ids int64 [n], probs float64 [n])``, or None (one-hot drafts).
    """

    tokens: list[int] = field(default_factory=list)
    dists: list | None = None


@dataclass
class DraftContext:
    """What a drafter may look at.

    Attributes:
        tokens: every token so far (prompt + generated), the last one not yet run by the target.
        hidden: the target's final-norm hidden state float32 [hidden_size] at the last position it
            ran, or None before the first forward.
    """

    tokens: list[int]
    hidden: torch.Tensor | None = None


class Drafter(Protocol):
    """The drafter interface."""

    name: str

    def propose(self, ctx: DraftContext, n_max: int) -> Draft:
        """Up to ``n_max`` draft tokens continuing ``ctx.tokens``."""
        ...

    def accepted(self, ctx: DraftContext, n_accepted: int) -> None:
        """Told after each round: ``ctx.tokens`` now holds the kept tokens; n_accepted drafts survived."""
        ...

    def reset(self) -> None:
        """Forget all per-request state."""
        ...


class NoDrafter:
    """Plain decoding: proposes nothing, so every round is one target forward and one token."""

    name = "none"

    def propose(self, ctx: DraftContext, n_max: int) -> Draft:
        return Draft()

    def accepted(self, ctx: DraftContext, n_accepted: int) -> None:
        pass

    def reset(self) -> None:
        pass
