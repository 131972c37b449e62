"""The engine: one generate loop for plain and speculative decoding.

Each decode round asks the drafter for up to ``n_max`` tokens, runs the target once over
``[pending] + drafts`` (the pending token is the last one generated, not yet in the KV cache),
verifies (:mod:`gemmaspec.speculative.verify`), keeps 1..n_max+1 tokens, checks stop conditions token
by token, and rolls the KV cache back to what was kept. Plain decoding is the drafter that proposes
nothing (:class:`~gemmaspec.speculative.drafters.NoDrafter`), so both paths share every line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .errors import InputError
from .sampling import Sampler, SamplingParams, filtered_probs
from .speculative.adaptive import AdaptiveDraftLength
from .speculative.drafters import DraftContext, Drafter, NoDrafter
from .speculative.stats import SpecStats
from .speculative.verify import Verdict, verify_greedy, verify_sampling
from .tokenizer import GemmaTokenizer, IncrementalDecoder

PREFILL_CHUNK = 256  # prompt tokens per forward


@dataclass
class RequestStats:
    """Timings and counts of one request (ms and tokens/s)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0  # request start → first generated token
    decode_ms: float = 0.0  # first generated token → last
    stop_reason: str = ""
    seed: int = 0
    spec: SpecStats = field(default_factory=SpecStats)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.generated_tokens - 1
        return n / (self.decode_ms / 1e3) if n > 0 and self.decode_ms > 0 else 0.0

    def line(self) -> str:
        return (f"prompt {self.prompt_tokens} tokens, prefill {self.prefill_tps:.1f} tokens/s | "
                f"generated {self.generated_tokens} tokens, decode {self.decode_tps:.1f} tokens/s | "
                f"TTFT {self.ttft_ms:.0f} ms | stop: {self.stop_reason} | seed {self.seed}")


@dataclass
class Event:
    """A streamed piece of output: ``text`` (may be empty) and the new token ids behind it."""

    text: str
    tokens: list[int]


class _StopChecker:
    """Token-by-token stop conditions: stop ids, stop strings (held back while they may still
    match), max tokens. ``add`` returns the text that is safe to show."""

    def __init__(self, tok: GemmaTokenizer, params: SamplingParams):
        self.tok, self.params = tok, params
        self.decoder = IncrementalDecoder(tok)
        self.text = ""  # all decoded text
        self.shown = 0  # chars of text already returned
        self.tokens: list[int] = []
        self.reason = ""

    def add(self, token: int) -> str | None:
        """Feed one generated token; returns text to show, or None when the token is a stop token."""
        if token in self.tok.stop_ids and not self.params.ignore_eos:
            self.reason = "eos"
            return None
        self.tokens.append(token)
        self.text += self.decoder.push([token])
        out_end = len(self.text)
        for s in self.params.stop:
            i = self.text.find(s, max(0, self.shown - len(s)))
            if i >= 0:
                self.reason = "stop"
                out_end = min(out_end, i)
        if self.reason == "stop":
            self.text = self.text[:out_end]
        else:
            # hold back a tail that could be the start of a stop string
            for s in self.params.stop:
                for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:n]):
                        out_end = min(out_end, len(self.text) - n)
                        break
            if self.params.max_tokens != -1 and len(self.tokens) >= self.params.max_tokens:
                self.reason = "length"
                out_end = len(self.text)
        out = self.text[self.shown:out_end] if out_end > self.shown else ""
        self.shown = max(self.shown, out_end)
        return out

    def finish(self) -> str:
        if self.reason == "stop":
            return ""
        self.text += self.decoder.flush()
        out = self.text[self.shown:]
        self.shown = len(self.text)
        return out


class Engine:
    """A target model, its tokenizer and a context size; runs requests one at a time.

    Args:
        model: a :class:`~gemmaspec.models.base.CausalLM`.
        tokenizer: the model's tokenizer.
        ctx_size: most positions a request may use (prompt + generated), ``-c``.
    """

    def __init__(self, model, tokenizer: GemmaTokenizer, ctx_size: int = 4096, max_rollback: int = 16):
        self.model, self.tokenizer, self.ctx_size = model, tokenizer, ctx_size
        self.cache = model.new_cache(ctx_size, max_rollback)
        self.max_rollback = max_rollback

    # ------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids for a prompt; with ``chat`` the prompt is one user turn in the chat template."""
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return self.tokenizer.encode_chat(msgs)
        return self.tokenizer.encode(prompt)

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InputError("the prompt is empty: give at least one token of text")
        if len(ids) >= self.ctx_size:
            raise InputError(f"the prompt is {len(ids)} tokens, the context is {self.ctx_size} (-c); "
                             f"shorten the prompt or raise -c (at most the model's context)")

    def forward_costs(self, n_cap: int = 8) -> list[float]:
        """Seconds of one target forward over 1..n_cap+1 tokens on this machine (median of 3), measured
        once per engine on a scratch cache and kept; the adaptive draft length plans with it."""
        if getattr(self, "_forward_costs", None) is None:
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

    def _prefill(self, ids: list[int]):
        out = None
        for i in range(0, len(ids), PREFILL_CHUNK):
            out = self.model.forward(torch.tensor(ids[i:i + PREFILL_CHUNK]), self.cache)
        return out

    def generate(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None = None,
                 n_max: int | str = 0, stats: RequestStats | None = None, n_min: int = 0) -> Iterator[Event]:
        """Generate from ``prompt_ids``, yielding text as it is produced.

        Args:
            prompt_ids: the prompt's token ids (BOS included when the model wants it).
            params: sampling parameters (validated here).
            drafter: who proposes draft tokens (None: plain decoding).
            n_max: most draft tokens per round (ignored by a drafter that proposes none), or
                ``"auto"``: chosen each round by :class:`~gemmaspec.speculative.adaptive.AdaptiveDraftLength`.
            stats: filled in as the request runs (counts, timings, acceptance).
            n_min: a proposal shorter than this is not verified (llama.cpp's ``--spec-draft-n-min``).

        Raises:
            InputError: empty or too long prompt, bad parameters, n_max out of range.
        """
        params.validate()
        self.check_prompt(prompt_ids)
        controller = None
        if n_max == "auto":
            controller = AdaptiveDraftLength(self.forward_costs(), n_cap=min(8, self.max_rollback - 1))
        elif not isinstance(n_max, int) or not 0 <= n_max < self.max_rollback:
            raise InputError(f"draft length must be in 0..{self.max_rollback - 1} or 'auto' (got {n_max})")
        drafter = drafter or NoDrafter()
        drafter.reset()
        st = stats if stats is not None else RequestStats()
        sampler = Sampler(params)
        st.seed, st.prompt_tokens = sampler.seed, len(prompt_ids)
        stop = _StopChecker(self.tokenizer, params)
        t0 = time.perf_counter()
        self.cache.reset()
        out = self._prefill(prompt_ids)
        tokens = list(prompt_ids)
        token = sampler.sample(out.logits[0], tokens)
        hidden = out.hidden[-1]
        t1 = time.perf_counter()
        st.prefill_ms = st.ttft_ms = (t1 - t0) * 1e3
        t_last = t1
        text = stop.add(token)
        if text is None:
            st.stop_reason = stop.reason
            return
        tokens.append(token)
        st.generated_tokens = 1
        if text:
            yield Event(text, [token])
        if not stop.reason and len(tokens) >= self.ctx_size:
            stop.reason = "context"
        while not stop.reason:
            start = self.cache.length  # == len(tokens) - 1: the pending token is not cached yet
            room = self.ctx_size - start - 1  # positions left after the pending token
            remaining = params.max_tokens - st.generated_tokens if params.max_tokens != -1 else room
            t_round = time.perf_counter()
            k = max(0, min(controller.choose() if controller else n_max, room, remaining - 1))
            ctx = DraftContext(tokens, hidden)
            draft = drafter.propose(ctx, k) if k > 0 else None
            t_drafted = time.perf_counter()
            drafts = list(draft.tokens[:k]) if draft else []
            if len(drafts) < max(n_min, 1):
                drafts = []
            out = self.model.forward(torch.tensor(tokens[-1:] + drafts), self.cache, all_logits=bool(drafts))
            verdict = self._verify(out.logits, tokens, drafts, draft.dists if draft else None, params, sampler)
            new = drafts[:verdict.n_accepted] + [verdict.next_token]
            kept = 0
            shown, shown_ids = [], []
            for t in new:
                text = stop.add(t)
                if text is None:
                    break
                kept += 1
                shown_ids.append(t)
                if text:
                    shown.append(text)
                if stop.reason:
                    break
            self.cache.rollback(start + kept)
            tokens.extend(new[:kept])
            st.generated_tokens += kept
            st.spec.record(len(drafts), min(verdict.n_accepted, kept))
            hidden = out.hidden[min(kept, verdict.n_accepted)] if kept else hidden
            drafter.accepted(DraftContext(tokens, hidden), min(verdict.n_accepted, kept))
            t_last = time.perf_counter()
            if controller:
                controller.update(len(drafts), verdict.n_accepted, t_drafted - t_round, t_last - t_round)
            if shown_ids:
                yield Event("".join(shown), shown_ids)
            if not stop.reason and len(tokens) >= self.ctx_size:
                stop.reason = "context"
        tail = stop.finish()
        if tail:
            yield Event(tail, [])
        st.decode_ms = (t_last - t1) * 1e3
        st.stop_reason = stop.reason

    def _verify(self, logits, history, drafts, dists, params: SamplingParams, sampler: Sampler) -> Verdict:
        """Decide a round from the target's logits float32 [len(drafts)+1, V]."""
        if params.greedy and params.repeat_penalty == 1.0:
            return verify_greedy(logits.argmax(-1).tolist(), drafts)
        if params.greedy:
            targets = [int(filtered_probs(logits[i], params, history + drafts[:i])[0][0]) for i in range(len(drafts) + 1)]
            return verify_greedy(targets, drafts)
        cache = {}

        def target(i):
            if i not in cache:
                cache[i] = filtered_probs(logits[i], params, history + drafts[:i])
            return cache[i]

        return verify_sampling(target, drafts, dists, sampler.uniform, sampler.draw)
