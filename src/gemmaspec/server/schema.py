"""The OpenAI (and llama-server) request and response shapes: request bodies and their checks, the
error object, and the formatting of whole responses and streamed chunks.

Request bodies are validated here (not by FastAPI) so that every bad input gets an OpenAI-style
error, ``{"error": {"message", "type", "code"}}`` with the HTTP status as ``code`` (llama-server's
convention). References: OpenAI's API reference (completions, chat completions) and llama.cpp
``tools/server/README.md`` (``timings``, ``speculative.n_max``).
"""

from __future__ import annotations

import json
import math
import time

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import GemmaspecError
from ..sampling import SamplingParams
from ..speculative.options import parse_n_max
from .scheduler import Job

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP ``status``; ``extra`` adds fields to it."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 500: "server_error", 503: "unavailable_error"}

    def __init__(self, status: int, message: str, type_: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type_ or self.TYPES.get(status, "invalid_request_error")
        self.extra = extra

    def response(self) -> JSONResponse:
        err = {"message": self.message, "type": self.type, "code": self.status, **self.extra}
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse({"error": err}, status_code=self.status, headers=headers)


# -- request bodies ----------------------------------------------------------------------------------
class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    ignore_eos: bool = False


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


def validate(model_cls, body: dict):
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"][:1]) or "body"
        detail = ".".join(str(p) for p in err["loc"])
        if err["type"] == "missing":
            raise APIError(400, f"missing required field '{detail}'") from None
        raise APIError(400, f"invalid value for '{field}' ({detail}: {err['msg']})") from None



async def json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def sampling_params(req: GenerationRequest, max_tokens: int | None, ctx: int, default_max: int) -> SamplingParams:
    if req.n != 1:
        raise APIError(400, f"only n = 1 is supported (got {req.n})")
    if max_tokens is None:
        max_tokens = default_max
    elif max_tokens <= 0:
        raise APIError(400, f"max_tokens must be at least 1 (got {max_tokens})")
    elif max_tokens > ctx:
        raise APIError(400, f"max_tokens ({max_tokens}) is above the context size ({ctx})")
    d = SamplingParams()
    temp = d.temperature if req.temperature is None else req.temperature
    if not (math.isfinite(temp) and 0 <= temp <= 2):
        raise APIError(400, f"temperature must be between 0 and 2 (got {temp})")
    top_p = d.top_p if req.top_p is None else req.top_p
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise APIError(400, f"top_p must be in (0, 1] (got {top_p})")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            temperature=temp, top_p=top_p, top_k=d.top_k if req.top_k is None else req.top_k,
            min_p=d.min_p if req.min_p is None else req.min_p,
            repeat_penalty=d.repeat_penalty if req.repeat_penalty is None else req.repeat_penalty,
            max_tokens=max_tokens, seed=-1 if req.seed is None else req.seed,
            stop=tuple(s for s in stop if s), ignore_eos=req.ignore_eos).validate()
    except GemmaspecError as exc:
        raise APIError(400, str(exc)) from None


def completion_prompt(prompt, engine) -> list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request is supported (got {len(prompt)})")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return engine.tokenizer.encode(prompt)
    vocab = engine.tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    if not prompt:
        raise APIError(400, "the prompt is empty")
    return list(prompt)


def spec_overrides(req, cfg) -> tuple[int | str, int]:
    """llama-server's per-request ``speculative.n_max`` / ``speculative.n_min`` (n_max 0 turns drafting
    off for the request); the server's settings otherwise."""
    extra = req.model_extra or {}
    n_max, n_min = extra.get("speculative.n_max"), extra.get("speculative.n_min")
    out_max = cfg.n_max if n_max is None else n_max
    out_min = cfg.n_min if n_min is None else n_min
    if not isinstance(out_max, (int, str)) or isinstance(out_max, bool) or (isinstance(out_max, str) and out_max != "auto"):
        raise APIError(400, f"speculative.n_max must be a number or 'auto' (got {n_max!r})")
    try:
        out_max = parse_n_max(out_max, "speculative.n_max")
    except GemmaspecError as exc:
        raise APIError(400, str(exc)) from None
    if not (isinstance(out_min, int) and not isinstance(out_min, bool) and out_min >= 0):
        raise APIError(400, f"speculative.n_min must be >= 0 (got {n_min!r})")
    return out_max, out_min


def chat_messages(req: ChatRequest) -> list[dict]:
    """The chat template's messages from a chat request: roles checked (``developer`` becomes
    ``system``), text content parts joined.

    Raises:
        APIError: 400 for an unknown role, a missing content, or a non-text content part.
    """
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if m.role not in ("system", "developer", "user", "assistant"):
            raise APIError(400, f"messages[{i}].role must be system, developer, user or assistant (got {m.role!r})")
        if content is None and m.role != "assistant":
            raise APIError(400, f"messages[{i}].content is missing: a {m.role} message needs text")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}]: only text content parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return messages


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Formatter:
    """Builds OpenAI response objects (whole or streamed chunks) for one request."""

    def __init__(self, kind: str, rid: str, model: str, tokenizer, logprobs: int | None):
        self.kind, self.id, self.model, self.tok, self.logprobs = kind, rid, model, tokenizer, logprobs
        self.created = int(time.time())
        self.offset = 0  # characters of text so far (completions' text_offset)

    def _piece(self, tid: int) -> str:
        return self.tok.decode([tid])

    def _chat_lp(self, lps) -> dict:
        def entry(tid, lp):
            s = self._piece(tid)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                            for x in lps]}

    def _completion_lp(self, lps, text_offsets) -> dict:
        return {"tokens": [self._piece(x.token) for x in lps], "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{self._piece(t): v for t, v in x.top} for x in lps], "text_offset": text_offsets}

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

    def chunk(self, delta: dict | str, finish: str | None, logprobs=None, **extra) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice], **extra}

    def event_chunk(self, ev) -> dict:
        lp = self._lp([ev]) if ev.tokens else None
        self.offset += len(ev.text)
        return self.chunk({"content": ev.text} if self.kind == "chat" else ev.text, None, lp)

    def final_chunk(self, job: Job) -> dict:
        return self.chunk({} if self.kind == "chat" else "", FINISH.get(job.stats.stop_reason, "stop"),
                          usage=_usage(job), timings=_timings(job))

    def whole(self, events, job: Job) -> dict:
        text = "".join(e.text for e in events)
        finish = FINISH.get(job.stats.stop_reason, "stop")
        lp = self._lp(events)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                      "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": _usage(job), "timings": _timings(job)}


def _usage(job: Job) -> dict:
    st = job.stats
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.generated_tokens,
            "total_tokens": st.prompt_tokens + st.generated_tokens}


def _timings(job: Job) -> dict:
    """llama-server's ``timings``: prompt = prefill; predicted = decoding after the first token."""
    st = job.stats
    pn, gn = st.prompt_tokens, st.generated_tokens
    return {
        "prompt_n": pn, "prompt_ms": st.prefill_ms,
        "prompt_per_token_ms": st.prefill_ms / pn if pn else 0.0, "prompt_per_second": st.prefill_tps,
        "predicted_n": gn, "predicted_ms": st.decode_ms,
        "predicted_per_token_ms": st.decode_ms / (gn - 1) if gn > 1 else 0.0, "predicted_per_second": st.decode_tps,
        "draft_n": st.spec.drafted, "draft_n_accepted": st.spec.accepted,
        "ttft_ms": job.ttft_ms,
    }
