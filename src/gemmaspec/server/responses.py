"""Responses: OpenAI's response objects and streamed chunks (:class:`Formatter`), llama-server's
``/completion`` result (:class:`NativeFormatter`), ``usage``, ``timings`` and server-sent events.

References: OpenAI's API reference (completions, chat completions) and llama.cpp
``tools/server/README.md`` (``timings``, ``completion_probabilities``).
"""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING

from ..sampling import SamplingParams, ban_end_of_generation
from ..seeds import SEED_RANDOM
from .apierror import APIError
from .scheduler import Job

if TYPE_CHECKING:
    from .state import ServerState

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON (UTF-8 text, not ``\\u`` escapes)."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_error(payload) -> str:
    """A streamed error event for the scheduler's ``("error", (status, message))``."""
    status, message = payload
    return sse({"error": {"message": message, "type": APIError.TYPES.get(status, "server_error"), "code": status}})


def fingerprint() -> str:
    """``system_fingerprint`` (and ``/props``' ``build_info``), shaped like llama-server's
    ``b<build>-<commit>`` (clients and llama.cpp's tests check that it starts with ``b``): build 0,
    then the gemmaspec version that answered, ``b0-gemmaspec-0.1.0``."""
    from .. import __version__

    return f"b0-gemmaspec-{__version__}"


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenText:
    """A token's text and real bytes for log-probabilities. A byte-fallback token (``<0xE4>``: part of a
    character the vocabulary spells as bytes) has bytes ``[0xE4]`` and text ``bytes:\\xe4`` (OpenAI's
    spelling), so the bytes of a reply's tokens, concatenated, are its UTF-8 and no two tokens share a text."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._memo: dict[int, tuple[str, bytes]] = {}

    def __call__(self, tid: int) -> tuple[str, bytes]:
        got = self._memo.get(tid)
        if got is None:
            m = _BYTE_TOKEN.match(self.tok.id_to_token(tid) or "")
            if m:
                b = bytes([int(m.group(1), 16)])
                got = (f"bytes:\\x{b[0]:02x}", b)
            else:
                text = self.tok.decode([tid])
                got = (text, text.encode("utf-8"))
            self._memo[tid] = got
        return got

    def keyed(self, pairs) -> dict[str, float]:
        """``{text: logprob}`` for (id, logprob) pairs, never dropping one whose text repeats (it is then
        keyed ``text [id N]``)."""
        out: dict[str, float] = {}
        for tid, lp in pairs:
            key = self(tid)[0]
            if key in out:
                key = f"{key} [id {tid}]"
            out[key] = lp
        return out


def provenance_json(events, text_of: TokenText) -> list[dict]:
    """The ``provenance`` entries of ``events``' tokens (the request's ``return_provenance``), one per
    token in order: ``id``, ``source`` (the drafter's type for an accepted draft, ``target`` for the
    target's own token), ``pos`` (in its round) and ``drafted`` (drafts the round proposed); the
    target's token of a round with drafts adds ``drafter`` and the drafts it replaced,
    ``rejected`` (their texts, spelled as in log-probabilities) and ``rejected_ids``."""
    out = []
    for e in events:
        for tid, s in zip(e.tokens, e.sources or [None] * len(e.tokens)):
            if s is None:  # not known (an engine path that does not say): the target's, as far as we know
                out.append({"id": tid, "source": "target", "pos": 0, "drafted": 0})
                continue
            entry = {"id": tid, "source": s.kind, "pos": s.pos, "drafted": s.drafted}
            if s.kind == "target" and s.drafted:
                entry.update(drafter=s.drafter, rejected=[text_of(t)[0] for t in s.rejected],
                             rejected_ids=list(s.rejected))
            out.append(entry)
    return out


class Formatter:
    """Builds OpenAI response objects (whole or streamed chunks) for one request.

    ``include_usage``: ``stream_options.include_usage`` (True: usage in a last chunk with no choices
    and ``usage: null`` in the others; False: no usage at all; None, not given: usage in the chunk
    with the finish reason, as llama-server does). ``tools``: the chat request's
    :class:`~gemmaspec.server.tools.ToolSpec` when it may call tools (replies that are calls become
    ``tool_calls`` with ``finish_reason: "tool_calls"``). ``timings_per_token``: ``timings`` (so far)
    in every streamed chunk, not only the last. ``verbose``: a :class:`NativeFormatter` whose result
    (llama-server's ``/completion`` object, with the rendered ``prompt``) goes under ``__verbose``, in
    the whole response or the first of the finishing chunks, as llama-server does with ``--verbose``.
    ``provenance`` (the request's ``return_provenance``): each choice (streamed chunk or whole
    response) carries ``provenance``, where its tokens came from (:func:`provenance_json`)."""

    def __init__(self, kind: str, rid: str, model: str, tokenizer, logprobs: int | None,
                 include_usage: bool | None = None, tools=None, timings_per_token: bool = False,
                 verbose: "NativeFormatter | None" = None, index: int = 0, provenance: bool = False):
        self.kind, self.id, self.model, self.tok, self.logprobs = kind, rid, model, tokenizer, logprobs
        self.index = index  # the choice's index (n > 1: one formatter per choice)
        self.tools = tools
        self.text_of = TokenText(tokenizer)
        self.include_usage = include_usage
        self.timings_per_token, self.verbose = timings_per_token, verbose
        self.created = int(time.time())
        self.offset = 0  # characters of text so far (completions' text_offset)
        self.text: list[str] = []  # the streamed text so far (for __verbose)
        self.n_sent = 0  # tokens streamed so far (a speculative round's tokens arrive together)
        self.provenance = provenance

    def _chat_lp(self, lps) -> dict:
        def entry(tid, lp):
            s, b = self.text_of(tid)
            return {"token": s, "logprob": lp, "bytes": list(b)}

        return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                            for x in lps]}

    def _completion_lp(self, lps, text_offsets) -> dict:
        return {"tokens": [self.text_of(x.token)[0] for x in lps], "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [self.text_of.keyed(x.top) for x in lps], "text_offset": text_offsets}

    def _lp(self, events) -> dict | None:
        if self.logprobs is None:
            return None
        lps = [x for e in events if e.logprobs for x in e.logprobs]
        if self.kind == "chat":
            return self._chat_lp(lps)
        offsets, at = [], self.offset
        for e in events:
            for _ in e.logprobs or []:
                offsets.append(at)
            at += len(e.text)
        return self._completion_lp(lps, offsets)

    def _base(self, obj: str, choices: list, **extra) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "system_fingerprint": fingerprint(), "choices": choices, **extra}
        if self.include_usage and "usage" not in out:
            out["usage"] = None
        return out

    def chunk(self, delta: dict | str, finish: str | None, logprobs=None, **extra) -> dict:
        """One streamed chunk of this choice: ``delta`` (chat) or text (completions), ``extra`` fields added."""
        if self.kind == "chat":
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": self.index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = "text_completion"
        return self._base(obj, [choice], **extra)

    def first_chunk(self) -> dict:
        """Streamed chat's first chunk, as llama-server sends it: the role, no content yet."""
        return self.chunk({"role": "assistant", "content": None}, None)

    def event_chunk(self, ev, job: Job | None = None) -> dict:
        """The streamed chunk of one engine event (its text and log-probabilities; ``timings`` so far
        with ``timings_per_token``)."""
        lp = self._lp([ev]) if ev.tokens else None
        self.offset += len(ev.text)
        self.text.append(ev.text)
        self.n_sent += len(ev.tokens)
        extra = {"timings": _timings(job, self.n_sent)} if self.timings_per_token and job is not None else {}
        out = self.chunk({"content": ev.text} if self.kind == "chat" else ev.text, None, lp, **extra)
        if self.provenance:
            out["choices"][0]["provenance"] = provenance_json([ev], self.text_of)
        return out

    def progress_chunk(self, progress: dict) -> dict:
        """llama-server's ``return_progress`` event: ``prompt_progress`` (``total``, ``cache``,
        ``processed``, ``time_ms``) on an empty delta (with ``timings_per_token``, ``timings`` so far)."""
        delta = {"role": "assistant", "content": None} if self.kind == "chat" else ""
        extra = {"timings": _progress_timings(progress)} if self.timings_per_token else {}
        return self.chunk(delta, None, prompt_progress=progress, **extra)

    def tool_calls(self, text: str, job: Job) -> list[dict] | None:
        """The reply's tool calls, or None (no tools, not a call, or cut short before it was complete)."""
        from .tools import parse_reply

        if self.tools is None or job.stats.stop_reason != "eos":
            return None
        return parse_reply(text, self.tools)

    def tool_call_chunks(self, calls: list[dict]) -> list[dict]:
        """Streamed ``tool_calls`` deltas, as OpenAI sends them: per call, its id, type and name with
        empty arguments, then the arguments."""
        out = []
        for i, c in enumerate(calls):
            fn = c["function"]
            out.append(self.chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                                   "function": {"name": fn["name"], "arguments": ""}}]}, None))
            out.append(self.chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}, None))
        return out

    def final_chunks(self, job: Job, finish: str | None = None, usage_jobs: list[Job] | None = None) -> list[dict]:
        """The chunk with the finish reason (and ``timings``), then the usage chunk if asked for.
        ``usage_jobs``: the jobs whose usage to report (n > 1: all choices', on the last one to
        finish; ``[]``: no usage here, another choice reports it)."""
        finish = finish or FINISH.get(job.stats.stop_reason, "stop")
        delta = {} if self.kind == "chat" else ""
        jobs = [job] if usage_jobs is None else usage_jobs
        if self.include_usage is None:
            out = [self.chunk(delta, finish, **({"usage": usage_of(jobs)} if jobs else {}))]
        else:
            out = [self.chunk(delta, finish)]
            if self.include_usage and jobs:
                out.append(self._base(out[0]["object"], [], usage=usage_of(jobs)))
        out[-1]["timings"] = _timings(job)  # on the last chunk, as llama-server
        if self.verbose is not None:
            out[0]["__verbose"] = self.verbose.final([], job, content="".join(self.text), tokens=[])
        return out

    def whole(self, events, job: Job) -> dict:
        """The whole (not streamed) response of a finished job: its text or tool calls, ``usage``, ``timings``."""
        text = "".join(e.text for e in events)
        finish = FINISH.get(job.stats.stop_reason, "stop")
        lp = self._lp(events)
        if self.kind == "chat":
            calls = self.tool_calls(text, job)
            message = {"role": "assistant", "content": text} if calls is None else \
                {"role": "assistant", "content": None, "tool_calls": calls}
            choice = {"index": self.index, "message": message, "logprobs": lp,
                      "finish_reason": finish if calls is None else "tool_calls"}
            obj = "chat.completion"
        else:
            choice = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish}
            obj = "text_completion"
        if self.provenance:
            choice["provenance"] = provenance_json(events, self.text_of)
        out = self._base(obj, [choice], usage=_usage(job), timings=_timings(job))
        if self.verbose is not None:
            out["__verbose"] = self.verbose.final(events, job)
        return out


STOP_TYPE = {"eos": "eos", "stop": "word", "length": "limit", "context": "limit"}


class NativeFormatter:
    """llama-server's ``/completion`` response: ``content``, ``tokens``, ``stop``, ``stop_type``,
    ``stopping_word``, ``truncated``, ``generation_settings``, ``tokens_cached``, ``timings`` (with
    ``cache_n``), and ``completion_probabilities`` when ``n_probs`` > 0: per token ``id``, ``token``,
    ``bytes``, ``logprob`` and ``top_logprobs``, or with ``post_sampling_probs`` ``prob`` and
    ``top_probs`` (probabilities in the sampling distribution). ``timings_per_token``: ``timings`` in
    every streamed event. ``provenance`` (``return_provenance``): ``provenance`` in every streamed
    event and the whole result (:func:`provenance_json`)."""

    def __init__(self, model: str, tokenizer, n_probs: int, return_tokens: bool, settings: dict, prompt: str,
                 timings_per_token: bool = False, response_fields: list[str] | None = None,
                 provenance: bool = False):
        self.model, self.n_probs, self.return_tokens = model, n_probs, return_tokens
        self.text_of = TokenText(tokenizer)
        self.settings, self.prompt = settings, prompt
        self.timings_per_token = timings_per_token
        self.response_fields = response_fields or None
        self.n_sent = 0  # tokens streamed so far
        self.provenance = provenance

    def _probs(self, events) -> list[dict]:
        def entry(tid, v, key):
            s, b = self.text_of(tid)
            return {"id": tid, "token": s, "bytes": list(b), key: v}

        out = []
        for e in events:
            for x in e.logprobs or []:
                key, top = ("prob", "top_probs") if x.probs else ("logprob", "top_logprobs")
                out.append({**entry(x.token, x.logprob, key), top: [entry(t, v, key) for t, v in x.top]})
        return out

    def event_chunk(self, ev, job: Job) -> dict:
        """The streamed event of one engine event: its text and tokens (and probabilities with ``n_probs``)."""
        out = {"index": 0, "content": ev.text, "tokens": list(ev.tokens), "stop": False, "id_slot": job.slot,
               "tokens_predicted": job.stats.generated_tokens, "tokens_evaluated": job.stats.prompt_tokens}
        self.n_sent += len(ev.tokens)
        if self.timings_per_token:
            out["timings"] = _timings(job, self.n_sent)
        if self.n_probs:
            out["completion_probabilities"] = self._probs([ev])
        if self.provenance:
            out["provenance"] = provenance_json([ev], self.text_of)
        return out

    def progress_chunk(self, progress: dict, job: Job) -> dict:
        """llama-server's ``return_progress`` event: no text yet, ``prompt_progress`` (and with
        ``timings_per_token``, ``timings`` so far)."""
        out = {"index": 0, "content": "", "tokens": [], "stop": False, "id_slot": job.slot, "tokens_predicted": 0,
               "tokens_evaluated": progress["total"], "prompt_progress": progress}
        if self.timings_per_token:
            out["timings"] = _progress_timings(progress)
        return out

    def final(self, events, job: Job, content: str | None = None, tokens=None) -> dict:
        """The result of a finished job (the whole response, or the stream's last event with
        ``content=""`` and ``tokens=[]``); only ``response_fields`` when the request named some."""
        st = job.stats
        tokens = [t for e in events for t in e.tokens] if tokens is None else tokens
        out = {"index": 0, "content": "".join(e.text for e in events) if content is None else content,
               "tokens": tokens if self.return_tokens else [], "id_slot": job.slot, "stop": True,
               "model": self.model, "tokens_predicted": st.generated_tokens, "tokens_evaluated": st.prompt_tokens,
               "generation_settings": self.settings, "prompt": self.prompt, "has_new_line": False,
               "truncated": st.truncated or st.stop_reason == "context", "stop_type": STOP_TYPE.get(st.stop_reason, "none"),
               "stopping_word": job.stop_word, "tokens_cached": job.n_cached,
               "timings": _timings(job)}
        out["has_new_line"] = "\n" in out["content"]
        if self.n_probs and content is None:
            out["completion_probabilities"] = self._probs(events)
        if self.provenance and content is None:
            out["provenance"] = provenance_json(events, self.text_of)
        if self.response_fields:  # llama-server's: only these fields, nested ones by path ("a/b")
            out = {path: v for path, v in ((p, _at_path(out, p)) for p in self.response_fields) if v is not _MISSING}
        return out


_MISSING = object()


def _at_path(obj, path: str):
    """The value at ``a/b/c`` in nested dicts, or ``_MISSING``."""
    for key in path.split("/"):
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _usage(job: Job) -> dict:
    return usage_of([job])


def usage_of(jobs: list[Job]) -> dict:
    """OpenAI's ``usage`` for the choices of one request (n > 1: each prompt counted once, by the
    first choice that runs it; the choices of one prompt share its id list), with
    ``prompt_tokens_details.cached_tokens``: the prompt tokens reused from a slot's cache
    (``timings.cache_n``; 0 when the whole prompt was prefilled), as OpenAI and llama-server report it."""
    first: dict[int, Job] = {}
    for j in jobs:
        first.setdefault(id(j.prompt_ids), j)
    done = sum(j.stats.generated_tokens for j in jobs)
    return usage_dict(sum(j.stats.prompt_tokens for j in first.values()), done,
                      sum(j.cache_n for j in first.values()))


def usage_dict(prompt: int, completion: int, cached: int) -> dict:
    """``usage``: ``prompt_tokens`` (``cached`` of them reused from the cache), ``completion_tokens``,
    ``total_tokens`` and ``prompt_tokens_details.cached_tokens``."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _progress_timings(progress: dict) -> dict:
    """``timings`` while the prompt is still being prefilled: nothing predicted yet."""
    n, ms = progress["processed"] - progress["cache"], progress["time_ms"]
    return {"prompt_n": n, "prompt_ms": ms, "prompt_per_token_ms": ms / n if n else 0.0,
            "prompt_per_second": n / (ms / 1e3) if n and ms > 0 else 0.0, "predicted_n": 0, "predicted_ms": 0.0,
            "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0, "cache_n": progress["cache"], "draft_n": 0,
            "draft_n_accepted": 0, "ttft_ms": 0.0}


def _timings(job: Job, n_sent: int | None = None) -> dict:
    """llama-server's ``timings``: prompt = prefill; predicted = decoding after the first token (while
    the request runs: so far; ``n_sent``: the tokens streamed so far, which a speculative round's
    events reach one by one)."""
    st = job.stats
    pn, gn = st.prompt_tokens - job.cache_n, st.generated_tokens  # prompt_n: tokens prefilled (llama-server's)
    if n_sent is not None:
        gn = min(gn, n_sent)
    decode_ms, s = st.decode_ms, job.state
    if s is not None and not s.done and s._t1:  # still running: decode time up to the last round
        decode_ms = (s._t_last - s._t1) * 1e3
    out = {
        "prompt_n": pn, "prompt_ms": st.prefill_ms,
        "prompt_per_token_ms": st.prefill_ms / pn if pn else 0.0, "prompt_per_second": st.prefill_tps,
        "predicted_n": gn, "predicted_ms": decode_ms,
        "predicted_per_token_ms": decode_ms / (gn - 1) if gn > 1 else 0.0,
        "predicted_per_second": (gn - 1) / (decode_ms / 1e3) if gn > 1 and decode_ms > 0 else 0.0,
        "cache_n": job.cache_n, "draft_n": st.spec.drafted, "draft_n_accepted": st.spec.accepted,
        "ttft_ms": job.ttft_ms,
    }
    if st.spec.by_drafter:  # a drafter list (ngram-simple,draft-mtp): each member's part of draft_n
        out["draft_n_by_type"] = {name: {"draft_n": s.drafted, "draft_n_accepted": s.accepted}
                                  for name, s in sorted(st.spec.by_drafter.items())}
    return out


# -- llama-server's generation settings (/props, /slots, /completion, __verbose) -------------------------
OFF_SAMPLERS = {"typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
                "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "mirostat": 0, "mirostat_tau": 5.0,
                "mirostat_eta": 0.1, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
                "dry_penalty_last_n": -1, "min_keep": 0}
"""llama-server's ``generation_settings`` fields of the samplers gemmaspec does not run, at the values
that turn them off (a request that sets one to another value gets a 400)."""


def logit_bias_json(params: SamplingParams, stop_ids) -> list[dict]:
    """llama-server's ``generation_settings.logit_bias``: ``[{"bias", "token"}, ...]`` as the request
    is sampled (``ignore_eos``'s bans on the end-of-generation tokens included), a ban (-inf) as
    ``null``, which is how llama-server writes it (JSON has no infinity)."""
    p = ban_end_of_generation(params, stop_ids)
    return [{"bias": None if b == float("-inf") else b, "token": t} for t, b in p.logit_bias]


def generation_settings(st: ServerState, params: SamplingParams | None = None, n_max=None, n_min=None,
                        p_min=None) -> dict:
    """llama-server's ``params`` / ``generation_settings`` for a request (default: the server's); the
    seed as llama-server shows it, a uint32 (4294967295: a random one). Needs the model loaded."""
    cfg = st.cfg
    p = params or cfg.defaults
    n_pred = p.max_tokens if params is not None else (cfg.n_predict if cfg.n_predict is not None else -1)
    return {"n_predict": n_pred, "max_tokens": n_pred, "seed": SEED_RANDOM if p.seed < 0 else p.seed,
            "temperature": p.temperature,
            "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "repeat_last_n": p.repeat_last_n,
            "repeat_penalty": p.repeat_penalty, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "logit_bias": logit_bias_json(p, st.engine.tokenizer.stop_ids),
            **OFF_SAMPLERS, "stop": list(p.stop), "ignore_eos": p.ignore_eos, "n_probs": 0,
            "samplers": ["logit_bias", "penalties", "top_k", "top_p", "min_p", "temperature"],
            "speculative.n_max": cfg.spec.n_max if n_max is None else n_max,
            "speculative.n_min": cfg.spec.n_min if n_min is None else n_min,
            "speculative.p_min": st.model.p_min if p_min is None else p_min}


def slot_fields(st: ServerState, job: Job | None, last: Job | None = None) -> dict:
    """A slot's llama-server fields in ``/slots``: the running request's (``job``), or the last one's
    parameters with an idle ``next_token`` (nothing remains, nothing decoded)."""
    s = job.stats if job else None
    left = job.options.tokens_left(s.generated_tokens) if job else None
    task = job or last
    o = task.options
    return {"id_task": task.id_task, "speculative": st.model.spec_type != "none",
            "params": generation_settings(st, o.params, o.n_max, o.n_min, o.p_min),
            "next_token": [{"has_next_token": job is not None, "has_new_line": False,  # a list, as llama-server's
                            "n_remain": -1 if left is None else left,
                            "n_decoded": s.generated_tokens if s else 0}]}
