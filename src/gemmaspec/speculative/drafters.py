"""Drafters: what proposes tokens for the target to verify.

A drafter only proposes; the engine verifies (:mod:`.verify`) and keeps the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..kernels import ops_on_one_thread
from ..models.base import PREFILL_CHUNK
from ..sampling import argmax


@dataclass
class Draft:
    """Proposed tokens and, when the drafter has them, their distributions.

    Attributes:
        tokens: draft token ids (0..n_max of them).
        dists: per draft position ``(ids int64 [n], probs float64 [n])``, or None (one-hot drafts).
        source: which drafter of a :class:`ChainDrafter` proposed them (its ``name``); "" otherwise.
    """

    tokens: list[int] = field(default_factory=list)
    dists: list | None = None
    source: str = ""


@dataclass
class DraftContext:
    """What a drafter may look at.

    Attributes:
        tokens: every token so far (prompt + generated), the last one not yet run by the target.
        hidden: the target's final-norm hidden state float32 [hidden_size] at the last position it
            ran, or None before the first forward.
        non_text: token ids that stand for no text (an image's placeholders, whose positions hold
            image embeddings): never to be copied as drafts.
    """

    tokens: list[int]
    hidden: torch.Tensor | None = None
    non_text: frozenset = frozenset()


class Drafter(Protocol):
    """The drafter interface."""

    name: str

    def propose(self, ctx: DraftContext, n_max: int) -> Draft:
        """Up to ``n_max`` draft tokens continuing ``ctx.tokens``."""
        ...

    def reset(self) -> None:
        """Forget all per-request state."""
        ...


class NoDrafter:
    """Plain decoding: proposes nothing, so every round is one target forward and one token."""

    name = "none"

    def propose(self, ctx: DraftContext, n_max: int) -> Draft:
        return Draft()

    def reset(self) -> None:
        pass


class NgramDrafter:
    """Prompt lookup (``--spec-type ngram-simple``): find the latest earlier occurrence of the
    context's last n tokens and propose what followed it.

    Tries n = ``ngram_max`` down to ``ngram_min``; the longest match wins, the latest occurrence of
    it breaks ties. Indexes each n-gram once (a dict per n), so a proposal costs O(n_max).
    Source: Saxena 2023, "Prompt Lookup Decoding"; llama.cpp ``common/ngram-cache`` / ``ngram-simple``.

    Args:
        ngram_max: longest n-gram to match (default 4).
        ngram_min: shortest n-gram that counts as a match (default 1).
    """

    name = "ngram-simple"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            from ..errors import InputError

            raise InputError(f"n-gram sizes need 1 <= min <= max (got min {ngram_min}, max {ngram_max})")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.reset()

    def reset(self) -> None:
        self.index = {n: {} for n in range(self.ngram_min, self.ngram_max + 1)}
        self.seen = 0
        self.tokens: list[int] = []

    def _sync(self, tokens: list[int], skip: frozenset = frozenset()) -> None:
        if tokens[:self.seen] != self.tokens[:self.seen]:  # a different sequence: start over
            self.reset()
        for i in range(self.seen, len(tokens)):
            if tokens[i] in skip:  # an image's position: no n-gram ends before it or runs over it
                continue
            for n, table in self.index.items():
                if i >= n and not (skip and skip.intersection(tokens[i - n:i])):
                    table[tuple(tokens[i - n:i])] = i  # n-gram ending before i, continued at i
        self.seen = len(tokens)
        self.tokens = tokens

    def propose(self, ctx: DraftContext, n_max: int) -> Draft:
        toks, skip = ctx.tokens, ctx.non_text
        self._sync(toks, skip)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(toks) < n:
                continue
            at = self.index[n].get(tuple(toks[-n:]))
            if at is not None:
                draft = list(toks[at:at + n_max])
                cut = next((j for j, t in enumerate(draft) if t in skip), len(draft))
                return Draft(draft[:cut])
        return Draft()


class NgramPool:
    """llama.cpp's ``ngram-mod`` hash pool (``common/ngram-mod``, PR #19164): a fixed-size table from the
    hash of an n-gram of ``n`` tokens to the token that last followed it. No keys are stored: a
    collision answers another n-gram's follower (verification rejects it). One pool serves every slot of
    a server, so requests learn from each other's text.

    Args:
        n: tokens hashed per entry (``--spec-ngram-mod-n-match``; llama.cpp's default 24).
        size: table entries (llama.cpp's 4 Mi: 16 MiB of int32).
    """

    EMPTY = -1

    def __init__(self, n: int = 24, size: int = 1 << 22):
        from array import array

        if n < 1:
            raise ValueError(f"an n-gram pool needs n >= 1 (got {n})")
        self.n, self.size = n, size
        self._fresh = array("i", [self.EMPTY])
        self.reset()

    def reset(self) -> None:
        """Empty the table."""
        self.table = self._fresh * self.size
        self.used = 0

    def add(self, tokens: list[int], i: int) -> None:
        """Record that ``tokens[i : i + n]`` was followed by ``tokens[i + n]``."""
        at = hash(tuple(tokens[i:i + self.n])) % self.size
        if self.table[at] == self.EMPTY:
            self.used += 1
        self.table[at] = tokens[i + self.n]

    def get(self, key: tuple) -> int:
        """The follower recorded for the n-gram ``key`` (a tuple of n ids), or :data:`EMPTY`."""
        return self.table[hash(key) % self.size]


class NgramModDrafter:
    """llama.cpp's ``ngram-mod`` drafter (``--spec-type ngram-mod``): every n-gram of the text goes into a
    shared :class:`NgramPool`; a draft follows the pool from the last n tokens, one token at a time (each
    drafted token extends the key), until an empty entry or ``n_max``; fewer than ``n_min`` drafted
    tokens propose nothing. When three rounds in a row kept less than half of a draft, the pool is
    emptied (stale or colliding entries), and a request that starts with the pool over a quarter full
    empties it too, as llama.cpp does. Algorithm from llama.cpp's ``common/speculative.cpp``
    (``common_speculative_state_ngram_mod``); our code. Unlike llama.cpp, new n-grams are added every
    round, not in chunks of 32 tokens.

    Args:
        pool: the shared :class:`NgramPool` (its ``n`` is the match length).
        n_min: shortest draft proposed (``--spec-ngram-mod-n-min``).
    """

    name = "ngram-mod"

    def __init__(self, pool: NgramPool, n_min: int = 1):
        self.pool, self.n_min = pool, max(1, n_min)
        self.reset()

    def reset(self) -> None:
        self.added = 0  # tokens whose n-grams (as their last token's follower) are in the pool
        self.started = False
        self.last: list[int] = []  # the last draft, and the context length it followed
        self.last_at = 0
        self.low = 0  # rounds in a row that kept less than half of their draft

    def _feedback(self, toks: list[int]) -> None:
        if not self.last:
            return
        kept = 0
        for a, b in zip(self.last, toks[self.last_at:]):
            if a != b:
                break
            kept += 1
        self.low = self.low + 1 if kept * 2 < len(self.last) else 0
        self.last = []
        if self.low >= 3:
            self.pool.reset()
            self.low, self.added = 0, 0

    def propose(self, ctx: DraftContext, n_max: int) -> Draft:
        toks, n = ctx.tokens, self.pool.n
        if self.added > len(toks):  # another sequence (a context shift): add it again
            self.added = 0
        self._feedback(toks)
        for i in range(max(0, self.added - n), len(toks) - n):
            self.pool.add(toks, i)
        self.added = len(toks)
        if not self.started:
            self.started = True
            if self.pool.used > self.pool.size // 4:
                self.pool.reset()
                for i in range(len(toks) - n):
                    self.pool.add(toks, i)
        if len(toks) < n or n_max <= 0:
            return Draft()
        key, out = tuple(toks[-n:]), []
        while len(out) < n_max:
            t = self.pool.get(key)
            if t == NgramPool.EMPTY:
                break
            out.append(t)
            key = key[1:] + (t,)
        if len(out) < self.n_min:
            return Draft()
        self.last, self.last_at = out, len(toks)
        return Draft(out)


class ChainDrafter:
    """Several drafters in order of precedence (``--spec-type ngram-simple,draft-mtp``): each round
    the first one that proposes anything drafts, the rest are not asked. llama-server's rule when a
    draft model is combined with a draftless type ("the draftless decoding has higher precedence",
    llama.cpp ``docs/speculative.md``; ``common/speculative.cpp`` calls its implementations in that
    order and the first non-empty draft wins). With n-gram lookup first and the MTP assistant second,
    text that repeats its context is copied (long, nearly free drafts) and new text is predicted.

    The drafters see the same :class:`DraftContext`; each draft says which one made it
    (``Draft.source``), so the engine keeps acceptance per drafter (``SpecStats.by_drafter``).

    Args:
        drafters: at least two drafters, highest precedence first.
    """

    def __init__(self, drafters: list):
        if len(drafters) < 2:
            raise ValueError("a chain needs at least two drafters")
        self.drafters = list(drafters)
        self.name = ",".join(d.name for d in self.drafters)

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()

    @property
    def p_min(self) -> float:
        """The ``p_min`` of the drafters that have one (a model drafter; at most one in a chain), the
        largest if several; 0 when none has one. Setting it sets theirs."""
        return max((d.p_min for d in self.drafters if hasattr(d, "p_min")), default=0.0)

    @p_min.setter
    def p_min(self, value: float) -> None:
        for d in self.drafters:
            if hasattr(d, "p_min"):
                d.p_min = value

    def propose(self, ctx: DraftContext, n_max: int) -> Draft:
        for d in self.drafters:
            got = d.propose(ctx, n_max)
            if got.tokens:
                got.source = d.name
                return got
        return Draft()


class DraftModelDrafter:
    """A separate, smaller model (``--spec-type draft-simple``, ``-md``) with its own KV cache.

    Proposes greedily, one token per draft-model forward, and stops early when its top probability
    falls below ``p_min`` (llama.cpp's ``--spec-draft-p-min``). Drafts are one-hot (q = 1 on the
    proposed token), which keeps rejection sampling lossless. Its cache follows the target's
    sequence: before each proposal it rolls back to the longest common prefix and runs what is new.

    Args:
        model: a :class:`~gemmaspec.models.base.CausalLM` sharing the target's vocabulary.
        ctx_size: its context size (the target's).
        p_min: minimum top probability to keep drafting (0..1).
    """

    name = "draft-simple"

    def __init__(self, model, ctx_size: int, p_min: float = 0.0):
        self.model = model
        self.cache = model.new_cache(ctx_size, max_rollback=16)
        self.p_min = p_min
        self.done: list[int] = []  # tokens in the draft cache

    def reset(self) -> None:
        self.cache.reset()
        self.done = []

    def propose(self, ctx: DraftContext, n_max: int) -> Draft:
        toks = ctx.tokens
        common = 0
        limit = min(len(self.done), len(toks) - 1)
        while common < limit and self.done[common] == toks[common]:
            common += 1
        if len(self.done) - common > self.cache.max_rollback:  # diverged too far: start over
            common = 0
            self.cache.reset()
        else:
            self.cache.rollback(common)
        self.done = list(toks[:common])
        out = None
        # run everything but the last token, then each draft step feeds the previous choice
        pending = toks[common:]
        if len(pending) > 1:
            for i in range(0, len(pending) - 1, PREFILL_CHUNK):
                self.model.forward(torch.tensor(pending[i:min(i + PREFILL_CHUNK, len(pending) - 1)]), self.cache)
            self.done.extend(pending[:-1])
        last = toks[-1]
        drafts: list[int] = []
        for _ in range(n_max):
            if self.cache.length + 1 >= self.cache.capacity:
                break
            out = self.model.forward(torch.tensor([last]), self.cache)
            self.done.append(last)
            logits = out.logits[0]
            tok = int(argmax(logits))
            if self.p_min > 0 and float(torch.softmax(logits, -1)[tok]) < self.p_min:
                break
            drafts.append(tok)
            last = tok
        return Draft(drafts)


def check_same_vocabulary(target_tok, draft_tok) -> None:
    """Refuse a target/draft pair whose vocabularies differ.

    Raises:
        InputError: size, BOS/EOS ids or token strings differ (names the first difference).
    """
    from ..errors import InputError

    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if len(a) != len(b):
        raise InputError(f"the draft model's vocabulary has {len(b)} tokens, the target's {len(a)}: "
                         "they cannot be paired; use a draft model from the same family")
    if (target_tok.bos_id, target_tok.eos_id) != (draft_tok.bos_id, draft_tok.eos_id):
        raise InputError(f"the draft model's BOS/EOS ids ({draft_tok.bos_id}/{draft_tok.eos_id}) differ from the "
                         f"target's ({target_tok.bos_id}/{target_tok.eos_id}); use a draft model from the same family")
    if a != b:
        diff = next(t for t, i in a.items() if b.get(t) != i)
        raise InputError(f"the draft model's vocabulary differs from the target's (token {diff!r} has id "
                         f"{a[diff]} in the target, {b.get(diff)} in the draft); use a draft model from the same family")


class MTPDrafter:
    """An MTP assistant as a drafter (``--spec-type draft-mtp``).

    Reads the target's last hidden state (``ctx.hidden``) and the target's KV cache as it stands
    (positions 0..p-1, p = the last token's position); every draft step of a round runs at p.
    Proposes nothing before the target has produced a hidden state. Source: transformers
    ``SinglePositionMultiTokenCandidateGenerator``; see :mod:`gemmaspec.models.gemma4_assistant`.

    Args:
        assistant: the assistant model (``step``, ``head_dims``; e.g. ``Gemma4Assistant``).
        target: the model it drafts for; it must offer ``embed_row(token)`` and ``kv_layout()``
            (which cache layer the assistant reads per layer type).
        cache: the target's KV cache (the engine's).
        p_min: stop the round's drafting at a draft whose probability under the assistant's softmax
            is below this (``--spec-draft-p-min``, as llama.cpp's draft-model loop; 0: never stop early);
            that draft is not proposed, so a round may propose nothing (a plain step).
    """

    name = "draft-mtp"

    def __init__(self, assistant, target, cache, p_min: float = 0.0):
        self.assistant, self.target, self.cache, self.p_min = assistant, target, cache, p_min
        self.producer = {kind: layer for kind, (layer, _, _) in target.kv_layout().items()}

    def reset(self) -> None:
        pass

    def target_kv(self, p: int) -> dict:
        """Per layer type: (keys, values, mask [1, L] or None) that a query at position p sees."""
        window = self.target.config.sliding_window
        out = {}
        for kind, j in self.producer.items():
            layer = self.cache.layers[j]
            if layer.window is None:  # rows are positions 0..capacity-1
                keys, values = layer.k[:p], layer.v[:p]
                mask = None
                if kind == "sliding" and p > window - 1:
                    mask = (torch.arange(p, device=keys.device) > p - window)[None]
            else:  # ring buffer: rows hold the positions in cache.slot_pos
                slot = self.cache.slot_pos
                mask = ((slot >= 0) & (slot < p) & (slot > p - window))[None]
                keys, values = layer.k, layer.v
            out[kind] = (keys, values, mask)
        return out

    def propose(self, ctx: DraftContext, n_max: int) -> Draft:
        if ctx.hidden is None or n_max <= 0:  # no target state yet: never draft from undefined input
            return Draft()
        p = len(ctx.tokens) - 1
        if p != self.cache.length:
            raise RuntimeError(f"MTP drafter out of step: position {p}, target cache holds {self.cache.length}")
        kv = self.target_kv(p)
        tok, h = ctx.tokens[-1], ctx.hidden
        drafts = []
        with torch.inference_mode(), ops_on_one_thread():
            rope = self.assistant.rope_at(p)  # every step of the round is at position p
            for _ in range(n_max):
                if self.p_min > 0:
                    tok, prob, h = self.assistant.draft_step_p(self.target.embed_row(tok), h, p, kv, rope)
                    if prob < self.p_min:
                        break
                else:
                    tok, h = self.assistant.draft_step(self.target.embed_row(tok), h, p, kv, rope)
                drafts.append(tok)
        return Draft(drafts)


def check_mtp_pair(target, assistant) -> None:
    """Refuse a target/assistant pair that cannot work together.

    Raises:
        InputError: the target cannot feed an MTP assistant (no ``kv_layout``), or widths,
            vocabulary, layer types or head dims differ.
    """
    from ..errors import InputError

    arch = getattr(target.config, "architecture", type(target).__name__)
    if not hasattr(target, "kv_layout") or not hasattr(target, "embed_row"):
        raise InputError(f"--spec-type draft-mtp: this target ({arch}) cannot feed an MTP assistant")
    tc = target.config
    layout = target.kv_layout()
    problems = []
    if assistant.backbone_hidden_size != tc.hidden_size:
        problems.append(f"the assistant was trained for a target of width {assistant.backbone_hidden_size}, "
                        f"this target's width is {tc.hidden_size}")
    if assistant.vocab_size != tc.vocab_size:
        problems.append(f"vocabularies differ ({assistant.vocab_size} vs {tc.vocab_size} tokens)")
    for kind, dim in assistant.head_dims().items():
        if kind not in layout:
            problems.append(f"the assistant has {kind} attention layers, the target none")
        elif layout[kind][2] != dim:
            problems.append(f"{kind} layers' head dims differ (assistant {dim}, target {layout[kind][2]})")
    if problems:
        raise InputError("this assistant does not belong to this target: " + "; ".join(problems)
                         + ". Use the assistant released with the target")
