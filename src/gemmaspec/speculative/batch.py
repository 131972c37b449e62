"""Drafting for several slots at once (the server's rounds).

A round of the server first asks each slot's drafter what it would draft without spending time
(:func:`preview`: n-gram lookup drafts at once, a model drafter only says it would run), lets
:func:`~gemmaspec.speculative.chooser.choose` pick each slot's draft length, then drafts with the
models (:func:`draft_batch`): the MTP assistant runs each draft step once for every slot still drafting
(:meth:`~gemmaspec.models.gemma4_assistant.Gemma4Assistant.draft_steps`, each row's bits those of
drafting alone); other model drafters draft slot by slot. Every draft is what the slot's own drafter
would propose alone for that length, so batching changes no output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..kernels import ops_on_one_thread
from .drafters import ChainDrafter, Draft, DraftContext, MTPDrafter, NgramDrafter, NgramModDrafter, NoDrafter

FREE = (NgramDrafter, NgramModDrafter, NoDrafter)
"""Drafters whose proposal costs next to nothing: asked before the draft length is chosen."""


@dataclass
class Preview:
    """What a slot's drafter will draft this round.

    Attributes:
        source: the drafter that drafts (its ``name``: a chain's member), "" when none will.
        draft: the draft, already made (a free drafter), or None (a model drafter runs after the choice).
        model: the model drafter that will run (``draft`` None), else None.
        chained: the slot's drafter is a :class:`ChainDrafter` (drafts then say which member made them).
        batched: the model drafter's steps batch across slots (the MTP assistant).
    """

    source: str = ""
    draft: Draft | None = None
    model: object = None
    chained: bool = False
    batched: bool = False

    @property
    def cap(self) -> int:
        """Most tokens this drafter can give this round (before the room is applied): a made draft's
        length, or 15 for a model drafter."""
        if self.draft is not None:
            return len(self.draft.tokens)
        return 15 if self.model is not None else 0


def is_free(drafter) -> bool:
    """Whether ``drafter`` proposes at no real cost (n-gram lookup, none)."""
    return isinstance(drafter, FREE) or bool(getattr(drafter, "free", False))


def preview(drafter, ctx: DraftContext, n_max: int) -> Preview:
    """What ``drafter`` drafts this round, for at most ``n_max`` tokens: free drafters (n-gram lookup)
    are asked now, in a chain's order; the first model drafter in the way is named, not run. An MTP
    assistant before the target's first hidden state drafts nothing (as :meth:`MTPDrafter.propose`)."""
    members = drafter.drafters if isinstance(drafter, ChainDrafter) else [drafter]
    chained = isinstance(drafter, ChainDrafter)
    if n_max <= 0:
        return Preview(chained=chained)
    for d in members:
        if is_free(d):
            got = d.propose(ctx, n_max)
            if got.tokens:
                return Preview(d.name, Draft(list(got.tokens[:n_max]), got.dists), chained=chained)
            continue
        if isinstance(d, MTPDrafter) and ctx.hidden is None:
            return Preview(chained=chained)
        return Preview(getattr(d, "name", type(d).__name__), None, d, chained, isinstance(d, MTPDrafter))
    return Preview(chained=chained)


def draft_batch(jobs: list[tuple[object, DraftContext, int]],
                on_step: Callable[..., None] | None = None) -> list[Draft]:
    """Drafts of model drafters for several slots: ``jobs`` = ``(drafter, context, n)``, each slot its
    own drafter; returns one :class:`Draft` per job (at most ``n`` tokens; fewer where an assistant's
    p-min stops a slot's round). MTP drafters sharing one assistant draft together, one batched step
    per draft position for the slots still drafting; others draft alone. ``on_step(source, rows,
    seconds)`` is called for each batched step (the scheduler's cost model learns from it); for a
    drafter that drafts alone, once per call as ``on_step(source, 1, seconds per token, tokens asked)``."""
    out: list[Draft | None] = [None] * len(jobs)
    groups: dict[int, list[int]] = {}
    for i, (d, ctx, n) in enumerate(jobs):
        if n <= 0:
            out[i] = Draft()
        elif isinstance(d, MTPDrafter) and hasattr(d.assistant, "draft_steps"):
            groups.setdefault(id(d.assistant), []).append(i)
        else:
            t = time.perf_counter()
            out[i] = d.propose(ctx, n)
            if on_step is not None:
                on_step(getattr(d, "name", ""), 1, (time.perf_counter() - t) / max(1, n), max(1, n))
    for rows in groups.values():
        got = mtp_batch([jobs[i] for i in rows], on_step)
        for i, dr in zip(rows, got):
            out[i] = dr
    return out


def mtp_batch(jobs: list[tuple[MTPDrafter, DraftContext, int]], on_step=None) -> list[Draft]:
    """MTP drafters of one assistant, drafting together: step k runs once over every slot that has
    drafted k-1 tokens, wants more and was not stopped by its p-min; each slot's tokens are those of
    its :meth:`MTPDrafter.propose` alone (same inputs per row, batch-invariant products)."""
    a = jobs[0][0].assistant
    state = []  # per job: [position, kv, rope, token, hidden, drafts, stopped]
    with torch.inference_mode(), ops_on_one_thread():
        drafting = [j for j, (_, ctx, _) in enumerate(jobs) if ctx.hidden is not None]
        positions = [len(jobs[j][1].tokens) - 1 for j in drafting]
        ropes = iter(a.ropes_at(positions) if hasattr(a, "ropes_at") and positions else
                     [a.rope_at(p) for p in positions])
        for d, ctx, n in jobs:
            p = len(ctx.tokens) - 1
            if ctx.hidden is None:
                state.append(None)
                continue
            if p != d.cache.length:
                raise RuntimeError(f"MTP drafter out of step: position {p}, target cache holds {d.cache.length}")
            state.append([p, d.target_kv(p), next(ropes), ctx.tokens[-1], ctx.hidden, [], False])
        # what each row's C step reads that stays the same through the round, built once
        prepared = a.prepare_steps([state[j][1] for j in drafting], [state[j][2] for j in drafting]) \
            if hasattr(a, "prepare_steps") and drafting else None
        row_of = {j: r for r, j in enumerate(drafting)}
        targets = {id(d.target) for d, _, _ in jobs}
        for k in range(max(n for _, _, n in jobs)):
            live = [i for i, s in enumerate(state) if s is not None and not s[6] and len(s[5]) == k and jobs[i][2] > k]
            if not live:
                break
            t = time.perf_counter()
            if len(targets) == 1 and hasattr(jobs[0][0].target, "embed_rows"):
                x = jobs[0][0].target.embed_rows([state[i][3] for i in live])
            else:
                x = torch.stack([jobs[i][0].target.embed_row(state[i][3]) for i in live])
            h = torch.stack([state[i][4] for i in live])
            toks, probs, hs = a.draft_steps(x, h, [state[i][0] for i in live], [state[i][1] for i in live],
                                            [state[i][2] for i in live],
                                            probs=any(jobs[i][0].p_min > 0 for i in live), prepared=prepared,
                                            rows=[row_of[i] for i in live])
            for j, i in enumerate(live):
                s, d = state[i], jobs[i][0]
                if d.p_min > 0 and probs[j] < d.p_min:
                    s[6] = True
                    continue
                s[5].append(toks[j])
                s[3], s[4] = toks[j], hs[j]
            if on_step is not None:
                on_step(jobs[0][0].name, len(live), time.perf_counter() - t)
    return [Draft(list(s[5])) if s is not None else Draft() for s in state]
