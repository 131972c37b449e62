"""The engine: one generate loop for plain and speculative decoding.

Each decode round asks the drafter for up to ``n_max`` tokens, runs the target once over
``[pending] + drafts`` (the pending token is the last one generated, not yet in the KV cache),
verifies (:mod:`gemmaspec.speculative.verify`), keeps 1..n_max+1 tokens, checks stop conditions token
by token, and rolls the KV cache back to what was kept. Plain decoding is the drafter that proposes
nothing (:class:`~gemmaspec.speculative.drafters.NoDrafter`), so both paths share every line.

The round lives in :class:`RequestState` (``prefill`` / ``begin_round`` / ``finish_round``), which
owns a request's KV cache, drafter state, sampler and stop checks but not the target forward:
:meth:`Engine.generate` drives one state with one forward per round, and the server's scheduler
(:mod:`gemmaspec.server.scheduler`) drives several, batching their rounds into shared forwards. What a
request asks for (sampling, draft lengths, log-probabilities, grammar, context shift) is one
:class:`~gemmaspec.request.RequestOptions`; its ``max_tokens`` is enforced by the state alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator, NamedTuple

import torch

from .errors import InputError
from .models.base import MAX_ROLLBACK, PREFILL_CHUNK
from .multimodal import keyed
from .request import RequestOptions, TokenLogprob
from .sampling import Sampler, SamplingParams, ban_end_of_generation, filtered_probs
from .speculative.adaptive import AdaptiveDraftLength
from .speculative.drafters import Draft, DraftContext, Drafter, NoDrafter
from .speculative.stats import SpecStats, TokenSource
from .speculative.verify import verify_round
from .streaming import StopChecker
from .tokenizer import GemmaTokenizer


@dataclass
class RequestStats:
    """Timings and counts of one request (ms and tokens/s)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0  # request start → first generated token
    decode_ms: float = 0.0  # first generated token → last
    stop_reason: str = ""
    truncated: bool = False  # the context was shifted (prompt cut or tokens discarded mid-generation)
    seed: int = 0
    spec: SpecStats = field(default_factory=SpecStats)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.generated_tokens - 1
        return n / (self.decode_ms / 1e3) if n > 0 and self.decode_ms > 0 else 0.0

    @property
    def decode_text(self) -> str:
        """``decode 51.4 tokens/s``, or ``decode n/a (1 token)`` when fewer than two tokens were generated
        (decode speed is measured from the first generated token to the last)."""
        if self.generated_tokens < 2 or self.decode_ms <= 0:
            return f"decode n/a ({self.generated_tokens} token{'' if self.generated_tokens == 1 else 's'})"
        return f"decode {self.decode_tps:.1f} tokens/s"


@dataclass
class Event:
    """A streamed piece of output: ``text`` (may be empty) and the new token ids behind it, with
    their log-probabilities when the request asked for them and, per token, where it came from
    (``sources``, parallel to ``tokens``; None when not known)."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None
    sources: list[TokenSource] | None = None


class RoundInput(NamedTuple):
    """What the target runs for one round: ``tokens`` int64 [1 + drafts] (the pending token, then the
    drafts) and whether it must return logits for every position (``all_logits``, when drafts exist)."""

    tokens: torch.Tensor
    all_logits: bool


@dataclass
class RoundInFlight:
    """A round between :meth:`RequestState.begin_round` and :meth:`RequestState.finish_round`.

    Attributes:
        start: the cache's length when the round began (``len(tokens) - 1``: the pending token is not
            cached yet); the cache rolls back to ``start`` + the tokens kept.
        drafts: the draft token ids the target verifies (may be empty: a plain step).
        dists: the drafter's distributions for the drafts (see :class:`~gemmaspec.speculative.drafters.Draft`),
            or None (one-hot drafts, or none).
        source: the name of the drafter of a chain that proposed them ("" otherwise).
        t_start, t_drafted: ``time.perf_counter()`` seconds when the round began and when drafting ended.
    """

    start: int
    drafts: list[int]
    dists: list | None
    source: str
    t_start: float
    t_drafted: float


class RequestState:
    """One request's generation, as steps a caller drives: :meth:`prefill`, then rounds of
    :meth:`begin_round` → one target forward over the returned tokens on :attr:`cache` →
    :meth:`finish_round`, until :attr:`done`. :meth:`Engine.generate` drives one state; the server's
    scheduler drives several at once, batching their rounds into shared forwards.

    Each event returned carries one generated token (its text may be empty while a stop string or an
    incomplete UTF-8 character is held back); the last may be a token-less event with the text held
    back until the end.

    Args:
        engine: the :class:`Engine` (model, tokenizer, context size).
        prompt_ids: the prompt's token ids (BOS included when the model wants it).
        options: the request's :class:`~gemmaspec.request.RequestOptions` (validated here). With
            ``params.ignore_eos`` the end-of-generation tokens (EOS, end of turn) are banned (a logit
            bias of -inf added, as llama.cpp does), so they are never sampled (not with a
            ``constraint``, whose grammar may need them to end). With a ``constraint`` every token is
            drawn from the tokens its grammar allows, drafts are cut at the first token it forbids,
            each verify position is masked by its state after the drafts before it, the state advances
            over kept tokens only, and the request stops (reason ``eos``) once the grammar can only
            end; a stop token then always ends it, ``ignore_eos`` or not. With ``context_shift``
            (llama-server's ``--context-shift``, ``n_keep``, ``n_discard``) a prompt of ``ctx_size``
            tokens or more is cut (its first ``n_keep`` tokens kept, BOS always, then whole blocks of
            half the room dropped after them), and when generation fills the context ``n_discard``
            tokens after the first ``n_keep`` are dropped (0: half of those after them), the cache is
            rebuilt from the tokens kept (a prefill: exact, where llama.cpp re-rotates its cached keys)
            and generation goes on; ``stats.truncated`` says so. ``n_keep`` -1 keeps the whole prompt;
            at most half the context is kept (llama.cpp: all but 4 tokens, but its shift costs no
            prefill). ``p_min`` is not applied here: the drafter's owner sets it.
        drafter: who proposes draft tokens (None: plain decoding); reset here.
        stats: filled in as the request runs.
        cache: the KV cache to run in (emptied by :meth:`prefill`); None builds a new one.
        images: the prompt's images (:class:`~gemmaspec.multimodal.ImageSpan`: where their placeholder
            tokens lie and the embeddings that replace them); the target must accept ``images`` in its
            forward. Their placeholder ids are not text: drafters are told so (n-gram lookup skips
            them), a context shift is not done (the request stops at the context), and a prompt-cache
            reuse never ends inside an image (a caller compares :meth:`cache_keys`, which tell images
            apart, to decide how much to reuse).

    The ``max_tokens`` limit is enforced here and only here (:meth:`_reaches_limit`): the token that
    reaches it ends the request with stop reason ``length`` (:meth:`_take`), and no round drafts past it.

    Raises:
        InputError: empty or too long prompt (without context shift), bad options.
        ValueError: a ``cache`` smaller than the engine's context.
    """

    def __init__(self, engine: "Engine", prompt_ids: list[int], options: RequestOptions,
                 drafter: Drafter | None = None, stats: RequestStats | None = None, cache=None, images=()):
        options.validate(engine.max_rollback)
        self.images = list(images)
        self.non_text = frozenset(prompt_ids[im.start] for im in self.images)
        if self.images and options.context_shift and len(prompt_ids) >= engine.ctx_size:
            raise InputError(f"the prompt with its images is {len(prompt_ids)} tokens, the context is "
                             f"{engine.ctx_size} (-c); a prompt with images is not cut: raise -c")
        self.options = options
        bos = engine.tokenizer.bos_id
        lead = 1 if prompt_ids and prompt_ids[0] == bos else 0
        keep = len(prompt_ids) if options.n_keep == -1 else options.n_keep + lead
        # at most half the context is kept, so a shift frees at least a quarter of it: each one rebuilds
        # the cache (a prefill), and a head of nearly the whole context would shift every token or two
        self.n_keep, self.n_discard = max(lead, min(keep, engine.ctx_size // 2)), options.n_discard
        self.shifted = 0  # tokens dropped by context shifts so far (positions for seeded draws stay absolute)
        truncated = False
        if self.options.context_shift and prompt_ids and len(prompt_ids) >= engine.ctx_size:
            prompt_ids, truncated = self._cut_prompt(list(prompt_ids), engine.ctx_size), True
        engine.check_prompt(prompt_ids)
        constraint, params = options.constraint, options.params
        if constraint is None:  # ignore_eos bans the end-of-generation tokens (llama.cpp's way)
            params = ban_end_of_generation(params, engine.tokenizer.stop_ids)
        self.controller = None
        if options.n_max == "auto":
            self.controller = AdaptiveDraftLength(engine.forward_costs(), n_cap=min(8, engine.max_rollback - 1))
        if cache is not None and cache.capacity < engine.ctx_size:
            raise ValueError(f"a cache of {cache.capacity} positions cannot hold the context of {engine.ctx_size}")
        self.engine, self.model, self.ctx_size = engine, engine.model, engine.ctx_size
        self.params = params  # the options' sampling parameters, with ignore_eos's bans
        self.cache = cache if cache is not None else engine.model.new_cache(engine.ctx_size, engine.max_rollback)
        self.drafter = drafter or NoDrafter()
        self.drafter.reset()
        self.stats = st = stats if stats is not None else RequestStats()
        self.sampler = Sampler(params)
        st.seed, st.prompt_tokens, st.truncated = self.sampler.seed, len(prompt_ids), truncated
        self.constraint = constraint
        self.stop = StopChecker(engine.tokenizer, replace(params, ignore_eos=False) if constraint else params)
        self.tokens = list(prompt_ids)
        self.hidden = None
        self.done = False
        self.reused = 0
        self._round: RoundInFlight | None = None
        self.last_verdict = (0, 0)  # (drafts verified, drafts accepted) of the last finished round
        self._t1 = self._t_last = 0.0

    # ------------------------------------------------------------------------------------------
    def prefill(self, cancelled=None, reuse: int = 0, progress=None) -> list[Event]:
        """Run the prompt (in chunks of ``PREFILL_CHUNK``) and sample the first token.

        Args:
            cancelled: optional callable checked before each chunk; when it returns True the request
                stops there (:meth:`cancel`) and no event is returned.
            reuse: how many leading prompt tokens the cache already holds (a previous request's
                prefix, the server's prompt cache): they are kept and only the rest is run, when the
                cache can roll back to that length (else the whole prompt runs). At most
                ``len(prompt) - 1``. :attr:`reused` says how many were kept.
            progress: optional callable ``progress(total, cache, processed, time_ms)``: called once
                before the first chunk (``processed == cache``: the reused tokens) and after each
                chunk, the last with ``processed == total`` (llama-server's ``prompt_progress``).
        """
        t0 = time.perf_counter()
        ids = self.tokens
        reuse = max(0, min(reuse, len(ids) - 1, self.cache.length))
        for im in self.images:  # an image runs whole in one forward, or not at all
            if im.start < reuse < im.end:
                reuse = im.start
        if reuse:
            try:
                self.cache.rollback(reuse)
            except ValueError:  # a sliding-window ring no longer holds that far back
                reuse = 0
        if not reuse:
            self.cache.reset()
        self.reused = reuse
        report = None
        if progress is not None:
            total = len(ids)
            progress(total, reuse, reuse, 0.0)
            report = lambda n: progress(total, reuse, reuse + n, (time.perf_counter() - t0) * 1e3)  # noqa: E731
        spans = [(im.start - reuse, im.embeddings) for im in self.images]
        out = self.engine._prefill(ids[reuse:], self.cache, cancelled, report, images=spans)
        if out is None:
            self.cancel()
            return []
        st = self.stats
        if self._reaches_limit(0):  # max_tokens 0, the prompt only: its KV is in the cache, nothing is generated
            self._t1 = self._t_last = time.perf_counter()
            st.prefill_ms = (self._t1 - t0) * 1e3
            st.stop_reason, self.done = "length", True
            return []
        mask = self.constraint.mask() if self.constraint is not None else None
        token = self.sampler.sample(out.logits[0], ids, pos=len(ids) + self.shifted, mask=mask)
        self.hidden = out.hidden[-1]
        self._t1 = self._t_last = time.perf_counter()
        st.prefill_ms = st.ttft_ms = (self._t1 - t0) * 1e3
        text = self._take(token, 1)
        if text is None:
            st.stop_reason = self.stop.reason
            self.done = True
            return []
        self.tokens.append(token)
        self._grammar_step(token)
        st.generated_tokens = 1
        events = [Event(text, [token], self._logprobs(out.logits[0], [token], ids[:-1]), [TokenSource("target")])]
        self._check_context()
        if self.stop.reason:
            self._finish(events)
        return events

    def cache_keys(self) -> list:
        """The tokens so far as prompt-cache keys: the ids, with each image's positions replaced by
        numbers drawn from its pixels (:func:`gemmaspec.multimodal.keyed`), so a common prefix of
        two requests' keys is KV they share."""
        return keyed(self.tokens, self.images)

    def draft_room(self, n: int | None = None) -> int:
        """Most draft tokens this round may verify: ``n`` (default: the request's ``n_max``, or for
        ``auto`` its controller's cap), and one fewer than the context still holds and than
        ``max_tokens`` leaves (a round keeps its accepted drafts plus one target token, so plain
        decoding's output is never exceeded at a limit)."""
        room = self.ctx_size - len(self.tokens)
        left = self.options.tokens_left(self.stats.generated_tokens)
        remaining = room if left is None else left
        if n is None:
            n = self.controller.n_cap if self.controller else self.options.n_max
        return max(0, min(n, room - 1, remaining - 1))

    def fixed_n(self) -> int:
        """The draft length this round when nobody chooses it for the batch: ``n_max``, or the
        controller's choice for ``auto``, within :meth:`draft_room`."""
        return self.draft_room(self.controller.choose() if self.controller else None)

    def draft_context(self) -> DraftContext:
        """What the drafter sees this round (the tokens so far, the target's last hidden state, the image
        placeholder ids n-gram lookup skips)."""
        return DraftContext(self.tokens, self.hidden, self.non_text)

    def begin_round(self, draft: Draft | None = None) -> RoundInput:
        """Start a round; returns what the target must run. Without ``draft`` the drafter is asked for
        :meth:`fixed_n` tokens; a caller that drafted for the request (the server's batched drafting)
        passes its :class:`~gemmaspec.speculative.drafters.Draft`, cut to :meth:`draft_room`."""
        if self.done or self._round is not None:
            raise RuntimeError("begin_round() on a finished request or with a round in flight")
        start = self.cache.length  # == len(tokens) - 1: the pending token is not cached yet
        t_round = time.perf_counter()
        if draft is None:
            k = self.fixed_n()
            draft = self.drafter.propose(self.draft_context(), k) if k > 0 else None
        else:
            k = self.draft_room()
        t_drafted = time.perf_counter()
        drafts = list(draft.tokens[:k]) if draft else []
        if self.constraint is not None and drafts:  # a draft token the grammar forbids ends the draft
            drafts = drafts[:self.constraint.valid_prefix(drafts)]
        if len(drafts) < max(self.options.n_min, 1):
            drafts = []
        self._round = RoundInFlight(start, drafts, draft.dists if draft else None, draft.source if draft else "",
                                    t_round, t_drafted)
        return RoundInput(torch.tensor(self.tokens[-1:] + drafts), bool(drafts))

    def finish_round(self, out) -> list[Event]:
        """Verify the round from the target's :class:`~gemmaspec.models.base.ForwardOutput` (logits
        float32 [1 + drafts, V] when drafts were run, else [1, V]), keep the accepted tokens, check
        stops token by token and roll the cache back to what was kept."""
        if self._round is None:
            raise RuntimeError("finish_round() without begin_round()")
        rnd, self._round = self._round, None
        drafts = rnd.drafts
        st, stop = self.stats, self.stop
        c, masks = self.constraint, None
        if c is not None:
            base = c.consumed

            def masks(i):  # the grammar state after drafts[:i], advanced tentatively
                while c.consumed - base < i:
                    c.consume(drafts[c.consumed - base])
                return c.mask()

        verdict = verify_round(out.logits, self.tokens, drafts, rnd.dists, self.params, self.sampler,
                               pos=len(self.tokens) + self.shifted,
                               masks=masks)
        if c is not None:
            c.rollback(c.consumed - base)  # back to the kept tokens; they are consumed again below
        n_acc = verdict.n_accepted
        new = (drafts[:n_acc] + [verdict.next_token])[:self.ctx_size - len(self.tokens)]
        drafter = (rnd.source or self.drafter.name) if drafts else ""
        events = []
        for i, t in enumerate(new):
            text = self._take(t, st.generated_tokens + i + 1)
            if text is None:
                break
            src = TokenSource(drafter if i < n_acc else "target", i, len(drafts), drafter,
                              [] if i < n_acc else drafts[n_acc:])
            events.append(Event(text, [t], self._logprobs(out.logits[i], [t], self.tokens + new[:i]), [src]))
            self._grammar_step(t)
            if stop.reason:
                break
        kept = len(events)
        self.cache.rollback(rnd.start + kept)
        self.tokens.extend(new[:kept])
        st.generated_tokens += kept
        st.spec.record(len(drafts), min(verdict.n_accepted, kept), rnd.source)
        self.last_verdict = (len(drafts), verdict.n_accepted)
        self.hidden = out.hidden[min(kept, verdict.n_accepted)] if kept else self.hidden
        self._t_last = time.perf_counter()
        if self.controller:
            self.controller.update(len(drafts), verdict.n_accepted, rnd.t_drafted - rnd.t_start,
                                   self._t_last - rnd.t_start)
        self._check_context()
        if stop.reason:
            self._finish(events)
        return events

    def cancel(self) -> None:
        """Stop here (the client went away): no more rounds; stop reason ``cancelled``."""
        if not self.done:
            self._round = None
            self.stats.decode_ms = (self._t_last - self._t1) * 1e3 if self._t1 else 0.0
            self.stats.stop_reason = "cancelled"
            self.done = True

    # ------------------------------------------------------------------------------------------
    def _reaches_limit(self, n: int) -> bool:
        """Whether ``n`` generated tokens reach the request's ``max_tokens`` (the ``length`` stop)."""
        left = self.options.tokens_left(n)
        return left is not None and left <= 0

    def _take(self, token: int, n: int) -> str | None:
        """Feed the request's ``n``-th generated token to the stop checks: the text to show, or None for
        a stop token. The token that reaches ``max_tokens`` ends the request here (reason ``length``,
        unless a stop string ended it first) and the text held back for stop strings is released
        with it; :meth:`prefill` stops a request of ``max_tokens`` 0 before any token."""
        last = self._reaches_limit(n)
        text = self.stop.add(token, last=last)
        if text is not None and last and not self.stop.reason:
            self.stop.reason = "length"
        return text

    def _grammar_step(self, token: int) -> None:
        """Advance the grammar over a kept token; once it can only end, the request ends (``eos``)."""
        if self.constraint is not None:
            self.constraint.consume(token)
            if self.constraint.done and not self.stop.reason:
                self.stop.reason = "eos"

    def _check_context(self) -> None:
        if not self.stop.reason and len(self.tokens) >= self.ctx_size:
            if self.options.context_shift and self._shift_context():
                return
            self.stop.reason = "context"

    def _cut_prompt(self, ids: list[int], n_ctx: int) -> list[int]:
        """llama-server's prompt truncation: keep the first ``n_keep`` tokens, drop whole blocks of half
        the remaining room after them, keep the rest (always fewer than ``n_ctx`` tokens)."""
        keep = self.n_keep
        block = max(1, (n_ctx - keep) // 2)
        erased = (len(ids) - keep - block) // block
        self.shifted += erased * block
        return ids[:keep] + ids[keep + erased * block:]

    def _shift_context(self) -> bool:
        """Drop ``n_discard`` tokens after the first ``n_keep`` and rebuild the cache from the tokens kept;
        False when nothing can be dropped (then the request stops at the context)."""
        if self.images:  # the cache is rebuilt from tokens, which cannot bring an image back
            return False
        cached = len(self.tokens) - 1  # the pending token is not in the cache
        keep = min(self.n_keep, cached - 1)
        discard = self.n_discard or (cached - keep) // 2
        discard = min(discard, cached - keep - 1)  # at least one cached token after the kept ones
        if keep < 0 or discard < 1:
            return False
        self.tokens = self.tokens[:keep] + self.tokens[keep + discard:]
        self.shifted += discard
        self.cache.reset()
        out = self.engine._prefill(self.tokens[:-1], self.cache)
        self.hidden = out.hidden[-1]
        self.drafter.reset()
        self.stats.truncated = True
        return True

    def _finish(self, events: list[Event]) -> None:
        tail = self.stop.finish()
        if tail:
            events.append(Event(tail, []))
        self.stats.decode_ms = (self._t_last - self._t1) * 1e3
        self.stats.stop_reason = self.stop.reason
        self.done = True

    def _logprobs(self, logits: torch.Tensor, tokens: list[int], history=()):
        k = self.options.logprobs
        if k is None:
            return None
        if self.options.post_sampling:  # the distribution the token was drawn from (history: the ids before it)
            ids, probs = filtered_probs(logits, self.params, history)
            best = torch.topk(probs, min(k, probs.shape[0])).indices  # (only the head is sorted when nothing cuts)
            top = [(int(ids[i]), float(probs[i])) for i in best.tolist() if float(probs[i]) > 0]

            def prob(t):  # 0 for a token the filters removed
                hit = (ids == t).nonzero()
                return float(probs[hit[0, 0]]) if hit.numel() else 0.0

            return [TokenLogprob(t, prob(t), top, probs=True) for t in tokens]
        lp = torch.log_softmax(logits.float(), -1)
        top = []
        if k > 0:
            vals, ids = torch.topk(lp, k)
            top = list(zip(ids.tolist(), vals.tolist()))
        return [TokenLogprob(t, float(lp[t]), top) for t in tokens]


def _merged(events: list[Event]) -> Iterator[Event]:
    """A round's token events as one event (the CLI's granularity), then any token-less tail."""
    toks = [e for e in events if e.tokens]
    if toks:
        lps = None if any(e.logprobs is None for e in toks) else [lp for e in toks for lp in e.logprobs]
        srcs = None if any(e.sources is None for e in toks) else [x for e in toks for x in e.sources]
        yield Event("".join(e.text for e in toks), [t for e in toks for t in e.tokens], lps, srcs)
    for e in events:
        if not e.tokens:
            yield e


class Engine:
    """A target model, its tokenizer and a context size; runs requests one at a time.

    Args:
        model: a :class:`~gemmaspec.models.base.CausalLM`.
        tokenizer: the model's tokenizer.
        ctx_size: most positions a request may use (prompt + generated), ``-c``.
        max_rollback: positions a cache may roll back (a round keeps at most ``max_rollback`` tokens,
            so draft lengths are 0..max_rollback-1).
        model_path: the file or directory the model was loaded from (:class:`pathlib.Path`), None when
            it was built in memory; the shipped-assistant lookup matches it.

    Context shift is a request's choice (:attr:`~gemmaspec.request.RequestOptions.context_shift`).
    """

    def __init__(self, model, tokenizer: GemmaTokenizer, ctx_size: int = 4096, max_rollback: int = MAX_ROLLBACK,
                 model_path=None):
        self.model, self.tokenizer, self.ctx_size = model, tokenizer, ctx_size
        self.model_path = model_path
        self.cache = model.new_cache(ctx_size, max_rollback)
        self.max_rollback = max_rollback
        self._forward_costs: list[float] | None = None

    # ------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids for a prompt; with ``chat`` the prompt is one user turn in the chat template."""
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return self.tokenizer.encode_chat(msgs)
        return self.tokenizer.encode(prompt)

    def check_prompt(self, ids: list[int]) -> None:
        """Raises :class:`InputError` for an empty prompt or one that leaves no room in the context."""
        if not ids:
            raise InputError("the prompt is empty: give at least one token of text")
        if len(ids) >= self.ctx_size:
            raise InputError(f"the prompt is {len(ids)} tokens, the context is {self.ctx_size} (-c); "
                             f"shorten the prompt or raise -c (at most the model's context)")

    def forward_costs(self, n_cap: int = 8) -> list[float]:
        """Seconds of one target forward over 1..n_cap+1 tokens on this machine (median of 3), measured
        once per engine on a scratch cache and kept; the adaptive draft length plans with it."""
        if self._forward_costs is None:
            cache = self.model.new_cache(64, self.max_rollback)
            self.model.forward(torch.tensor([self.tokenizer.bos_id] * 8), cache)
            costs = []
            for m in range(1, n_cap + 2):
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    self.model.forward(torch.tensor([self.tokenizer.bos_id] * m), cache, all_logits=True)
                    times.append(time.perf_counter() - t)
                    cache.rollback(8)
                costs.append(sorted(times)[1])
            self._forward_costs = costs
        return self._forward_costs

    def _prefill(self, ids: list[int], cache=None, cancelled=None, progress=None, images=()):
        """Run ``ids`` at positions cache.length.. in chunks of ``PREFILL_CHUNK`` (default cache: the
        engine's); returns the last chunk's :class:`~gemmaspec.models.base.ForwardOutput`, or None when
        ``cancelled()`` (checked before each chunk) said stop. ``progress(n)``, if given, is called
        after each chunk with the number of ``ids`` run so far. ``images``: ``[(index into ids,
        embeddings [n, hidden])]``: no chunk splits an image (a chunk ends before one that would not
        fit, or runs it whole), and each goes to the forward as its ``images``."""
        cache = self.cache if cache is None else cache
        out, i = None, 0
        while i < len(ids):
            if cancelled is not None and cancelled():
                return None
            end = min(i + PREFILL_CHUNK, len(ids))
            for a, emb in images:
                if a < end < a + emb.shape[0]:
                    end = a if a > i else a + emb.shape[0]
            inside = [(a - i, emb) for a, emb in images if i <= a < end]
            kw = {"images": inside} if inside else {}
            out = self.model.forward(torch.tensor(ids[i:end]), cache, **kw)
            i = end
            if progress is not None:
                progress(i)
        return out

    def generate(self, prompt_ids: list[int], params: SamplingParams | RequestOptions, drafter: Drafter | None = None,
                 *, stats: RequestStats | None = None, images=(), **options) -> Iterator[Event]:
        """Generate from ``prompt_ids`` in this engine's cache, yielding text as it is produced (one
        event per round, then any text held back to the end).

        Args:
            prompt_ids: the prompt's token ids (BOS included when the model wants it).
            params: the request's :class:`~gemmaspec.request.RequestOptions`, or just its sampling
                parameters (then ``options`` gives the other fields).
            drafter: who proposes draft tokens (None: plain decoding). With ``p_min`` set, its
                ``p_min`` (if it has one) is that value for this call and restored after.
            stats: filled in as the request runs (counts, timings, acceptance).
            images: the prompt's :class:`~gemmaspec.multimodal.ImageSpan` list (see :class:`RequestState`).
            **options: fields of :class:`~gemmaspec.request.RequestOptions` (``n_max``, ``n_min``,
                ``constraint``, ``context_shift``, ...), set on (or replaced in) ``params``.

        Raises:
            InputError: empty or too long prompt, bad options (see :class:`RequestState`).
            TypeError: an ``options`` name that is not a field of RequestOptions.
        """
        opts = RequestOptions.of(params, **options)
        own_p_min = getattr(drafter, "p_min", None) if opts.p_min is not None else None
        if own_p_min is not None:
            drafter.p_min = opts.p_min
        try:
            state = RequestState(self, prompt_ids, opts, drafter, stats, cache=self.cache, images=images)
            yield from _merged(state.prefill())
            while not state.done:
                rnd = state.begin_round()
                out = self.model.forward(rnd.tokens, state.cache, all_logits=rnd.all_logits)
                yield from _merged(state.finish_round(out))
        finally:
            if own_p_min is not None:
                drafter.p_min = own_p_min
