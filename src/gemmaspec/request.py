"""The per-request options, written down once: what one request asks of the engine beyond its prompt.

:class:`RequestOptions` is taken by :class:`~gemmaspec.engine.RequestState` (which runs a request),
:meth:`~gemmaspec.engine.Engine.generate` (the CLI's loop) and the server scheduler's
:class:`~gemmaspec.server.scheduler.Job`; each front end builds one from its own flags or request body.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, replace

from .errors import InputError
from .sampling import SamplingParams


@dataclass(frozen=True)
class RequestOptions:
    """Everything a request chooses besides its prompt (defaults: plain decoding, no extras).

    Attributes:
        params: sampling parameters and the stop conditions (temperature, top-k/p, min-p, penalties,
            seed, stop strings, ``ignore_eos``, ``max_tokens``); see :class:`~gemmaspec.sampling.SamplingParams`.
            ``max_tokens`` is enforced by :class:`~gemmaspec.engine.RequestState` alone (stop reason
            ``length``); :meth:`tokens_left` is the one count of what remains.
        n_max: most draft tokens per round (0..``max_rollback - 1``; a drafter that proposes none
            ignores it), or ``"auto"``: chosen each round by
            :class:`~gemmaspec.speculative.adaptive.AdaptiveDraftLength` (``--spec-draft-n-max``).
        n_min: a proposal shorter than this many tokens is not verified (``--spec-draft-n-min``).
        choose_n: ``n_max`` is an upper bound and each round's draft length is chosen for the whole
            batch from measured costs (:mod:`gemmaspec.speculative.chooser`; the server's default),
            instead of drafting ``n_max`` (or the per-request ``auto``) every round. Read by the
            server's scheduler; a request run alone by :meth:`Engine.generate` drafts as before.
        p_min: the drafter's ``p_min`` for this request (0..1, llama-server's ``speculative.p_min``:
            a model drafter stops drafting below this probability), None for the drafter's own. Applied
            by whoever owns the drafter (the scheduler's slot, :meth:`Engine.generate`) and restored after.
        logprobs: None for no log-probabilities; k >= 0 to attach to each token event its
            log-probability under the model (natural log of the softmax of the logits, before any
            sampling filter) and the k most likely alternatives.
        post_sampling: with ``logprobs``, report probabilities in the sampling distribution instead
            (llama-server's ``post_sampling_probs``; see :class:`TokenLogprob`);
            not with a ``constraint``.
        constraint: None, or a fresh :class:`~gemmaspec.grammar.Constraint` (one per request, it is
            stateful): the output follows its grammar (see :class:`~gemmaspec.engine.RequestState`).
        context_shift: llama-server's ``--context-shift``: when the context fills, drop tokens and go
            on instead of stopping with reason ``context``; a prompt of ``ctx_size`` tokens or more
            is cut instead of refused.
        n_keep: tokens of the prompt a context shift keeps, after BOS (-1: the whole prompt; at most
            half the context is kept); llama-server's ``n_keep`` / ``--keep``.
        n_discard: tokens a context shift drops after the kept ones (0: half of them); llama-server's
            ``n_discard``.

    Build one with ``RequestOptions(params, n_max=3, ...)`` (every field but ``params`` by keyword), or
    with :meth:`of`.
    """

    params: SamplingParams
    _: KW_ONLY
    n_max: int | str = 0
    n_min: int = 0
    choose_n: bool = False
    p_min: float | None = None
    logprobs: int | None = None
    post_sampling: bool = False
    constraint: object = None
    context_shift: bool = False
    n_keep: int = 0
    n_discard: int = 0

    @classmethod
    def of(cls, params: "SamplingParams | RequestOptions", **options) -> "RequestOptions":
        """``params`` as options: a :class:`SamplingParams` with the given fields, or a
        :class:`RequestOptions` with the given fields replaced.

        Raises:
            TypeError: a name that is not a field of :class:`RequestOptions`.
        """
        if isinstance(params, RequestOptions):
            return replace(params, **options) if options else params
        return cls(params, **options)

    def tokens_left(self, generated: int) -> int | None:
        """Tokens the request may still generate after ``generated`` of them (``max_tokens -
        generated``), or None when ``max_tokens`` is -1 (no limit)."""
        limit = self.params.max_tokens
        return None if limit == -1 else limit - generated

    def validate(self, max_rollback: int) -> None:
        """Check the options (``params`` included) for an engine whose cache rolls back ``max_rollback``
        positions.

        Raises:
            InputError: bad sampling parameters, ``n_max`` out of 0..max_rollback-1 and not
                ``"auto"``, bad ``n_keep`` or ``n_discard``, ``post_sampling`` with a ``constraint``.
        """
        self.params.validate()
        n_keep, n_discard, n_max = self.n_keep, self.n_discard, self.n_max
        if not isinstance(n_keep, int) or n_keep < -1:
            raise InputError(f"n_keep must be -1 (the whole prompt) or a number of tokens >= 0 (got {n_keep!r})")
        if not isinstance(n_discard, int) or n_discard < 0:
            raise InputError(f"n_discard must be a number of tokens >= 0, 0 for half (got {n_discard!r})")
        if n_max != "auto" and (not isinstance(n_max, int) or not 0 <= n_max < max_rollback):
            raise InputError(f"draft length must be in 0..{max_rollback - 1} or 'auto' (got {n_max})")
        if self.post_sampling and self.constraint is not None:
            raise InputError("post-sampling probabilities cannot be combined with a grammar")


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (natural log, before sampling filters)
    and the ``top`` most likely ``(id, logprob)`` pairs at its position, most likely first.

    With ``probs`` True (llama-server's ``post_sampling_probs``) the values are instead probabilities
    in the distribution the token was drawn from (after penalties, top-k, top-p, min-p and
    temperature): ``logprob`` holds the token's probability there (0 if it was not a candidate) and
    ``top`` the most likely candidates with probabilities above 0."""

    token: int
    logprob: float
    top: list
    probs: bool = False
