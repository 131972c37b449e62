"""Sampling: turning a position's logits into a token (or a distribution to verify against).

The chain follows llama.cpp's default sampler order (``common/sampling.cpp``): logit bias →
penalties (repetition, then frequency and presence, over the last ``repeat_last_n`` tokens) → top-k →
top-p → min-p → temperature → draw. Temperature 0 is greedy (argmax; ties go to the lowest
id). Random draws use NumPy PCG64 generators in float64. The token at absolute position p is drawn
with p's own stream, keyed by (seed, p): plain decoding and speculative verification of a
deterministic drafter draw every token the same way, so the same seed gives the same text with and
without speculation, at any draft length and batch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from .errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """Generation parameters, with llama.cpp's defaults.

    Attributes:
        temperature: 0 for greedy, else > 0 (``--temp``).
        top_k: keep the k most likely tokens; 0 disables (``--top-k``).
        top_p: keep the smallest set whose probability reaches p (at least one token: 0 keeps the most
            likely); 1 disables (``--top-p``).
        min_p: drop tokens below min_p × the top probability; 0 disables (``--min-p``).
        repeat_penalty: divide positive / multiply negative logits of recent tokens; 1 disables.
        repeat_last_n: how many recent tokens the penalty looks at.
        max_tokens: most tokens to generate (``-n``); -1 means until a stop or the context is full; 0
            runs the prompt only (into the cache; llama-server's ``n_predict: 0``).
        seed: random seed; -1 picks one (reported in the stats so a run can be repeated).
        stop: strings that end generation (not included in the output).
        ignore_eos: keep generating past EOS / end-of-turn (benchmarks), as llama.cpp's --ignore-eos.
        presence_penalty: subtracted once from the logit of every token seen in the last
            ``repeat_last_n`` tokens (OpenAI's ``presence_penalty``, -2..2); 0 disables.
        frequency_penalty: subtracted from a token's logit once per occurrence in the last
            ``repeat_last_n`` tokens (OpenAI's ``frequency_penalty``, -2..2); 0 disables.
        logit_bias: ``((token id, bias), ...)`` added to the logits before everything else; a bias of
            ``-inf`` (OpenAI's -100 maps to it at the server) bans the token; biases of a token listed
            twice add up.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    max_tokens: int = 128
    seed: int = -1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def validate(self) -> "SamplingParams":
        """Return self, or raise :class:`InputError` naming the bad value and its range."""
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature})"),
            (self.top_k >= 0, f"top-k must be >= 0 (got {self.top_k}; 0 disables it)"),
            (0 <= self.top_p <= 1, f"top-p must be between 0 and 1 (got {self.top_p}; 1 disables it, 0 keeps the most likely token)"),
            (0 <= self.min_p <= 1, f"min-p must be in [0, 1] (got {self.min_p}; 0 disables it)"),
            (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0,
             f"repeat-penalty must be > 0 (got {self.repeat_penalty}; 1 disables it)"),
            (self.repeat_last_n >= 0, f"repeat-last-n must be >= 0 (got {self.repeat_last_n})"),
            (self.max_tokens >= -1,
             f"the number of tokens to generate must be >= 0, or -1 for no limit (got {self.max_tokens})"),
            (self.seed >= -1, f"seed must be >= 0, or -1 for a random one (got {self.seed})"),
            (math.isfinite(self.presence_penalty), f"presence penalty must be a finite number (got {self.presence_penalty})"),
            (math.isfinite(self.frequency_penalty),
             f"frequency penalty must be a finite number (got {self.frequency_penalty})"),
            (all(not math.isnan(b) and b != math.inf for _, b in self.logit_bias),
             "a logit bias must be a number (-inf bans the token)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InputError(msg)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @functools.cached_property
    def bias_ids(self) -> frozenset[int]:
        """The ids ``logit_bias`` touches (built once: a request may bias the whole vocabulary)."""
        return frozenset(t for t, _ in self.logit_bias)

    @functools.cached_property
    def bias_max(self) -> float:
        """The largest bias (-inf without any)."""
        return max((b for _, b in self.logit_bias), default=-math.inf)

    def bias_tensors(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``logit_bias`` as (ids int64 [n], biases [n]) on ``like``'s device and dtype, built once per
        device and dtype: rebuilding them from Python for every position cost a request biasing most
        of the vocabulary ~10 ms a token, on the thread that runs every slot."""
        cache = self.__dict__.setdefault("_bias_tensors", {})  # frozen: fields only; this is a cache
        key = (like.device, like.dtype)
        got = cache.get(key)
        if got is None:
            got = cache[key] = (torch.tensor([t for t, _ in self.logit_bias], dtype=torch.long, device=like.device),
                                torch.tensor([b for _, b in self.logit_bias], dtype=like.dtype, device=like.device))
        return got

    @property
    def raw_logits(self) -> bool:
        """Whether nothing changes the logits before the filters (no bias, no penalty)."""
        return (self.repeat_penalty == 1.0 and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and not self.logit_bias)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of the largest value along the last axis of ``logits`` (float32 [V] or [T, V]), int64
    [] or [T]; ties (and NaNs) go to the lowest index, as :func:`torch.argmax`. A contiguous CPU tensor
    goes through NumPy, whose argmax reads a 262,144-token row in ~0.03 ms where PyTorch's takes
    ~0.6 ms (measured on a 2-core Zen 3, in a decode step of ~25 ms)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() \
            and not logits.requires_grad:
        return torch.from_numpy(np.asarray(logits.numpy().argmax(-1), dtype=np.int64))
    return logits.argmax(-1)


def _penalties_neutral(params: "SamplingParams") -> bool:
    return params.repeat_penalty == 1.0 and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0


class NonFiniteLogitsError(RuntimeError):
    """The model's scores at a position hold NaN: a defect (of the weights, the kernel or the machine),
    never a token to emit. Raised instead of the id 0 an argmax over NaN gives."""


def _nan_check(value: float, what: str) -> None:
    if math.isnan(value):
        raise NonFiniteLogitsError(f"the model's logits {what} are NaN, so no token can be chosen; this is a "
                                   "defect, not an input error: please report it with the model file and the "
                                   "machine (CPU, `gemmaspec --version`)")


def greedy_token(logits: torch.Tensor, params: "SamplingParams", history=()) -> int:
    """The greedy token for logits float32 [V] under ``params``' logit bias and penalties: the argmax
    of :func:`apply_repeat_penalty`'s logits, the same id. Shortcut: without penalties and with no
    positive bias, the raw argmax is the answer unless the bias touches it (a bias <= 0 cannot raise
    another token above it, and an equal value earlier would have been the raw argmax), so the
    ``ignore_eos`` bans cost a lookup instead of a copy of the logits."""
    if params.raw_logits:
        best = int(argmax(logits))
        _nan_check(float(logits[best]), "at the greedy token")  # argmax lands on the first NaN if any
        return best
    if _penalties_neutral(params) and params.bias_max <= 0:
        best = int(argmax(logits))
        if best not in params.bias_ids and not math.isnan(float(logits[best])):
            return best
    scored = apply_repeat_penalty(logits, history, params)
    best = int(argmax(scored))
    _nan_check(float(scored[best]), "at the greedy token")
    return best


def ban_end_of_generation(params: SamplingParams, stop_ids) -> SamplingParams:
    """``params`` with ``ignore_eos`` made as llama.cpp makes it: a logit bias of -inf on every
    end-of-generation token (``stop_ids``: EOS, end of turn) appended, so they are never sampled;
    ``params`` unchanged without ``ignore_eos``."""
    if not params.ignore_eos:
        return params
    return replace(params, logit_bias=params.logit_bias + tuple((t, -math.inf) for t in sorted(stop_ids)))


def apply_repeat_penalty(logits: torch.Tensor, history, params: SamplingParams) -> torch.Tensor:
    """logits float32 [V] after the logit bias, then llama.cpp's penalties over the last
    ``repeat_last_n`` ids of ``history``: the repetition penalty (divide positive / multiply negative
    logits of tokens seen), then ``frequency_penalty × count + presence_penalty`` subtracted."""
    if params.raw_logits:
        return logits
    logits = logits.clone()
    if params.logit_bias:
        ids, biases = params.bias_tensors(logits)
        # index_add_: biases of a token listed twice add up (a ban, -inf, wins over any other bias)
        logits.index_add_(0, ids, biases)
    window = list(history[-params.repeat_last_n:]) if params.repeat_last_n and history else []
    if not window or _penalties_neutral(params):
        return logits
    counts: dict[int, int] = {}
    for t in window:
        counts[t] = counts.get(t, 0) + 1
    ids = torch.tensor(sorted(counts), dtype=torch.long, device=logits.device)
    vals = logits[ids]
    if params.repeat_penalty != 1.0:
        vals = torch.where(vals > 0, vals / params.repeat_penalty, vals * params.repeat_penalty)
    if params.frequency_penalty or params.presence_penalty:
        n = torch.tensor([counts[t] for t in sorted(counts)], dtype=logits.dtype, device=logits.device)
        vals = vals - n * params.frequency_penalty - params.presence_penalty
    logits[ids] = vals
    return logits


def _sorted_above(logits: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits >= threshold and their ids, largest first, equal logits by ascending id (a stable
    sort of the ids in ascending order): the first entries of a stable full sort, bit for bit."""
    pool = torch.nonzero(logits >= threshold).view(-1)
    vals, order = torch.sort(logits[pool], descending=True, stable=True)
    return vals, pool[order]


def filtered_probs(logits: torch.Tensor, params: SamplingParams, history=(),
                   mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling distribution at one position, restricted to the tokens it can produce.

    Args:
        logits: float32 [V].
        history: ids before this position (for the repetition penalty).
        mask: None, or bool [V]: the tokens a grammar allows here (:meth:`gemmaspec.grammar.Constraint.mask`);
            the others are set to -inf after the logit bias and penalties, before top-k (as
            llama.cpp's grammar sampler), so no filter can bring them back.

    Returns:
        ``(ids, probs)``: int64 [n] candidate ids and float64 [n] probabilities summing to 1, the most
        likely first (ties by id) over every token a filter kept. With no filter that cuts (top-k off,
        top-p 1, min-p 0) every token is kept, and only the head (the logits within 8 of the best, the
        bulk of the mass) is sorted; the rest follow in id order, so no full-vocabulary sort is paid
        per sampled token. Greedy gives one id with probability 1.
    """
    if params.greedy and mask is None:
        return torch.tensor([greedy_token(logits, params, history)]), torch.ones(1, dtype=torch.float64)
    logits = apply_repeat_penalty(logits, history, params)
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf)
    if params.greedy:
        return argmax(logits).view(1), torch.ones(1, dtype=torch.float64)
    v = logits.shape[-1]
    if 0 < params.top_k < v:
        vals, ids = torch.topk(logits, params.top_k)  # sorted, most likely first
        log_z = torch.logsumexp(vals.double(), 0)
        _nan_check(float(log_z), "at a sampled position")  # a NaN anywhere makes the normaliser NaN
    else:
        log_z = torch.logsumexp(logits.double(), 0)
        _nan_check(float(log_z), "at a sampled position")  # before the max below is used as a threshold
        top = float(logits.max())
        if params.min_p > 0:  # min-p keeps only logits >= max + log(min_p): sort just those
            vals, ids = _sorted_above(logits, top + math.log(params.min_p))
        elif params.top_p < 1:
            # top-p keeps a prefix of the sorted tokens: sort the head only, widened until its mass
            # reaches top-p (cumsum is sequential, so the head's sums are the full sort's first sums
            # and the cut is the one a full sort would give); below max - 32 the rest holds < 3e-9
            for width in (8.0, 16.0, 32.0, math.inf):
                vals, ids = _sorted_above(logits, top - width)
                cum = torch.cumsum(torch.exp(vals.double() - log_z), 0)
                if float(cum[-1]) >= params.top_p:
                    break
        else:  # nothing cuts: the sorted head, then every other possible token in id order
            vals, ids = _sorted_above(logits, top - 8.0)
            rest = torch.nonzero((logits < top - 8.0) & (logits > -math.inf)).view(-1)
            vals, ids = torch.cat([vals, logits[rest]]), torch.cat([ids, rest])
    # top-p and min-p act on the temperature-1 distribution over the top-k survivors
    p = torch.exp(vals.double() - log_z)
    keep = p.shape[0]
    if params.top_p < 1:
        cum = torch.cumsum(p, 0)
        keep = min(keep, int(torch.searchsorted(cum, torch.tensor([params.top_p], dtype=torch.float64))) + 1)
    if params.min_p > 0:
        keep = min(keep, int((p >= params.min_p * p[0]).sum()))
    if mask is not None:  # never a token the grammar forbids, whatever top-k / top-p kept
        keep = min(keep, int(torch.isfinite(vals).sum()))
    keep = max(1, keep)
    ids, vals = ids[:keep], vals[:keep]
    return ids, torch.softmax(vals.double() / params.temperature, -1)


class Sampler:
    """Draws tokens for one request: a seeded float64 random stream plus the parameters."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.seed = params.seed if params.seed >= 0 else int(np.random.SeedSequence().entropy % (2**31))
        self.rng = np.random.Generator(np.random.PCG64(self.seed))

    def uniform(self) -> float:
        """One float64 draw in [0, 1)."""
        return float(self.rng.random())

    def draw(self, ids: torch.Tensor, probs: torch.Tensor) -> int:
        """One id from a distribution given as (ids, probs) by inverting the CDF with a float64 draw."""
        if ids.shape[0] == 1:
            return int(ids[0])
        cdf = torch.cumsum(probs, 0)
        u = self.uniform() * float(cdf[-1])
        j = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True).item())
        return int(ids[min(j, ids.shape[0] - 1)])

    def uniform_at(self, pos: int) -> float:
        """The float64 draw in [0, 1) of absolute position ``pos``: its own stream, keyed by (seed,
        position), so a token's draw does not depend on how many draws came before it."""
        return float(np.random.Generator(np.random.PCG64([self.seed, pos])).random())

    def draw_at(self, pos: int, ids: torch.Tensor, probs: torch.Tensor) -> int:
        """One id from (ids, probs) with position ``pos``'s draw (:meth:`uniform_at`)."""
        if ids.shape[0] == 1:
            return int(ids[0])
        cdf = torch.cumsum(probs, 0)
        u = self.uniform_at(pos) * float(cdf[-1])
        j = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True).item())
        return int(ids[min(j, ids.shape[0] - 1)])

    def sample(self, logits: torch.Tensor, history=(), pos: int | None = None, mask: torch.Tensor | None = None) -> int:
        """One token from logits float32 [V]; with ``pos`` (its absolute position) drawn from that
        position's own stream (:meth:`draw_at`), else from the request's running stream. ``mask``
        (bool [V]) restricts it to a grammar's allowed tokens (:func:`filtered_probs`)."""
        if self.params.greedy and mask is None:
            return greedy_token(logits, self.params, history)
        dist = filtered_probs(logits, self.params, history, mask)
        return self.draw(*dist) if pos is None else self.draw_at(pos, *dist)
