"""Verification of draft tokens against the target: pure functions, no model, no cache.

Greedy: accept drafts while each equals the target's argmax; the first disagreement is replaced by
the target's token (recovered); when all agree the target's next token is the bonus.

Sampling: rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Alg. 1; Chen et al. 2023): accept draft x with probability min(1, p(x)/q(x));
on rejection draw from norm(max(p − q, 0)); after n accepted drafts draw a bonus from p. A drafter
without probabilities counts as q = one-hot on its token. The output is distributed exactly as p.
Distributions are ``(ids int64 [n], probs float64 [n])`` pairs over the tokens they can produce.

Sampling with a deterministic drafter (one-hot proposals: n-gram, greedy draft models, the MTP
assistant) and a known position: the target's token at each position is drawn from p with that
position's own random stream and a draft is accepted iff it equals the draw
(:func:`verify_by_position`). Each kept token is then exactly the token plain sampling draws at that
position (same stream, same p), so seeded output is identical with and without speculation; this is
as lossless as rejection sampling (each token is a sample from p given the tokens before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import _nan_check, argmax, filtered_probs, greedy_token


@dataclass
class Verdict:
    """Outcome of one round: ``n_accepted`` drafts kept, then ``next_token``, the target's own token:
    ``recovered`` (it replaces the first rejected draft) or, when every draft was accepted, the
    ``bonus`` token (``kind`` says which)."""

    n_accepted: int
    next_token: int
    kind: str  # "recovered" or "bonus"


def verify_greedy(target_tokens, drafts) -> Verdict:
    """Greedy verification.

    Args:
        target_tokens: the target's choice at each of len(drafts)+1 positions (ints).
        drafts: the draft tokens (ints).
    """
    n = 0
    while n < len(drafts) and int(drafts[n]) == int(target_tokens[n]):
        n += 1
    return Verdict(n, int(target_tokens[n]), "recovered" if n < len(drafts) else "bonus")


def _prob_of(dist, token: int) -> float:
    ids, probs = dist
    hit = (ids == token).nonzero()
    return float(probs[hit[0, 0]]) if hit.numel() else 0.0


def residual(p_dist, q_dist):
    """norm(max(p − q, 0)) as (ids, probs); q None means one-hot... see :func:`verify_sampling`."""
    p_ids, p_probs = p_dist
    q_ids, q_probs = q_dist
    q_on_p = torch.zeros_like(p_probs)
    # align q onto p's support (tokens outside p's support have p = 0, so they never come back):
    # where[t] = t's index in p_ids, -1 where p has no t
    size = max(int(p_ids.max()), int(q_ids.max())) + 1 if p_ids.numel() and q_ids.numel() else 0
    if size:
        where = torch.full((size,), -1, dtype=torch.int64)
        where[p_ids] = torch.arange(p_ids.shape[0])
        at = where[q_ids]
        hit = at >= 0
        q_on_p[at[hit]] = q_probs[hit].to(q_on_p.dtype)
    r = torch.clamp(p_probs - q_on_p, min=0.0)
    total = float(r.sum())
    if total <= 0.0:  # p == q: rejection had probability 0; fall back to p
        return p_ids, p_probs
    return p_ids, r / total


def verify_sampling(target_dists, drafts, draft_dists, uniform, draw) -> Verdict:
    """Rejection-sampling verification.

    Args:
        target_dists: callable i -> p at position i (i = 0..len(drafts)); called lazily, in order.
        drafts: draft tokens.
        draft_dists: list of q per draft position, or None for one-hot drafts.
        uniform: callable returning a float64 draw in [0, 1).
        draw: callable (ids, probs) -> token, drawing from a distribution.
    """
    for i, x in enumerate(drafts):
        p = target_dists(i)
        px = _prob_of(p, int(x))
        if draft_dists is None:
            q = (torch.tensor([int(x)]), torch.ones(1, dtype=torch.float64))
            qx = 1.0
        else:
            q = draft_dists[i]
            qx = _prob_of(q, int(x))
        if qx > 0 and uniform() < min(1.0, px / qx):
            continue
        return Verdict(i, draw(*residual(p, q)), "recovered")
    return Verdict(len(drafts), draw(*target_dists(len(drafts))), "bonus")


def verify_by_position(target_dists, drafts, draw_at, pos: int) -> Verdict:
    """Verification by per-position draws.

    Args:
        target_dists: callable i -> p at position i (i = 0..len(drafts)); called lazily, in order.
        drafts: draft tokens.
        draw_at: callable (absolute position, ids, probs) -> token, with that position's own stream.
        pos: absolute position of the first token this round produces.
    """
    for i, x in enumerate(drafts):
        t = draw_at(pos + i, *target_dists(i))
        if t != int(x):
            return Verdict(i, t, "recovered")
    return Verdict(len(drafts), draw_at(pos + len(drafts), *target_dists(len(drafts))), "bonus")


def verify_round(logits: torch.Tensor, history: list[int], drafts: list[int], dists, params, sampler,
                 pos: int | None = None, masks=None) -> Verdict:
    """Decide one speculative round from the target's logits.

    Args:
        logits: float32 [len(drafts) + 1, V], the target's scores at the pending token and each draft.
        history: every token before the pending one's successor (prompt + generated), for the
            repetition penalty.
        drafts: the draft tokens.
        dists: the drafter's distributions per draft position, or None (one-hot drafts).
        params: :class:`~gemmaspec.sampling.SamplingParams`; greedy (temperature 0) compares argmaxes
            (after the logit bias and penalties when set), otherwise rejection sampling over the
            filtered distributions (:func:`~gemmaspec.sampling.filtered_probs`).
        sampler: the request's :class:`~gemmaspec.sampling.Sampler` (its seeded uniform and draw).
        pos: absolute position of the first token the round produces; with one-hot drafts
            (``dists`` None) sampling then verifies by per-position draws (:func:`verify_by_position`).
        masks: None, or a callable i -> bool [V], the tokens a grammar allows at position i (its
            state after ``drafts[:i]``); called lazily and in order, at most once per position. A
            draft the grammar forbids has probability 0 under the masked target, so it is rejected.
    """
    mask = masks if masks is not None else (lambda i: None)
    if params.greedy and params.raw_logits and masks is None:
        best = argmax(logits)
        _nan_check(float(logits.gather(-1, best.view(-1, 1)).sum()), "at a verified position")  # NaN: argmax's pick
        return verify_greedy(best.tolist(), drafts)
    if params.greedy and masks is None:  # token ids straight from the logits (bias, penalties): no tensors
        n = 0
        while True:
            t = greedy_token(logits[n], params, history if n == 0 else history + drafts[:n])
            if n == len(drafts) or t != int(drafts[n]):
                return Verdict(n, t, "recovered" if n < len(drafts) else "bonus")
            n += 1
    memo = {}

    def target(i):
        if i not in memo:
            memo[i] = filtered_probs(logits[i], params, history + drafts[:i], mask(i))
        return memo[i]

    if params.greedy:
        n = 0  # lazily: the masks after a rejected draft are never needed
        while n < len(drafts) and int(target(n)[0][0]) == int(drafts[n]):
            n += 1
        return Verdict(n, int(target(n)[0][0]), "recovered" if n < len(drafts) else "bonus")
    if dists is None and pos is not None:
        return verify_by_position(target, drafts, sampler.draw_at, pos)
    return verify_sampling(target, drafts, dists, sampler.uniform, sampler.draw)
