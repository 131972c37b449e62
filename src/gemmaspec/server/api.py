"""The HTTP API: OpenAI-compatible endpoints plus llama-server's ``/health``, ``/props``, ``/slots``
and ``/metrics``, on FastAPI. See ``docs/server.md`` for usage.

Request bodies are parsed here (not by FastAPI's validation) so that every bad input gets an
OpenAI-style error, ``{"error": {"message", "type", "code"}}`` with the HTTP status as ``code``
(llama-server's convention): 400 for malformed JSON, missing or invalid fields and prompts longer
than the context, 401 for a wrong or missing API key, 404 for an unknown model or path, 503 while
the model loads. Generation runs on the :class:`~gemmaspec.server.scheduler.Scheduler` thread; each
request gets its events through an asyncio queue.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import GemmaspecError
from ..sampling import SamplingParams
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .scheduler import Job, Scheduler

log = logging.getLogger("gemmaspec.server")

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
PUBLIC_PATHS = {"/", "/health", "/v1/health", "/v1/models", "/models"}  # llama-server's public set + the page


@dataclass
class ServeConfig:
    """What ``gemmaspec serve`` was asked for (see ``gemmaspec serve --help``).

    ``spec_type`` None picks the default: ``ngram-simple``, or with ``draft_model`` ``draft-mtp`` for a
    Gemma 4 target and ``draft-simple`` otherwise. ``n_max`` is an int (0..15) or ``"auto"``.
    """

    model: str | None = None
    draft_model: str | None = None
    spec_type: str | None = None
    n_max: int | str = 3
    n_min: int = 0
    p_min: float = 0.0
    ngram_size: int = 4
    ngram_min: int = 1
    ctx_size: int | None = None
    n_slots: int = 4
    device: str = "auto"
    threads: int | None = None
    api_key: str | None = None
    alias: str | None = None


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
class _GenerationRequest(BaseModel):
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


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


def _validate(model_cls, body: dict):
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"][:1]) or "body"
        detail = ".".join(str(p) for p in err["loc"])
        if err["type"] == "missing":
            raise APIError(400, f"missing required field '{detail}'") from None
        raise APIError(400, f"invalid value for '{field}' ({detail}: {err['msg']})") from None


# -- the app -----------------------------------------------------------------------------------------
class _JobStream(StreamingResponse):
    """Server-sent events for one job; whatever ends the response (the last event, a client that
    went away, a cancelled task) releases the job's slot."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def create_app(cfg: ServeConfig, on_ready=None, on_load_error=None) -> FastAPI:
    """The FastAPI application; the model loads on the scheduler thread when the app starts.

    Args:
        cfg: the server's settings.
        on_ready: called once the model is loaded (scheduler thread).
        on_load_error: called with the exception if loading fails (scheduler thread).
    """
    info: dict[str, Any] = {}

    def load():
        from ..loader import drafter_factory, load_engine
        from ..loading.default_model import default_model_path

        t0 = time.perf_counter()
        path = Path(cfg.model) if cfg.model else default_model_path()
        engine = load_engine(path, ctx_size=cfg.ctx_size, device=cfg.device, threads=cfg.threads)
        spec = cfg.spec_type
        if spec is None:
            from ..models.gemma4 import Gemma4Model

            spec = ("draft-mtp" if isinstance(engine.model, Gemma4Model) else "draft-simple") if cfg.draft_model \
                else "ngram-simple"
        make = drafter_factory(spec, engine, cfg.draft_model, cfg.p_min, cfg.ngram_size, cfg.ngram_min)
        if cfg.n_max == "auto" and spec != "none":
            engine.forward_costs()
        names = {path.name, path.stem, str(path), str(cfg.model or "")}
        info.update(engine=engine, path=path, spec_type=spec, model_id=cfg.alias or path.name,
                    names={n for n in names | {cfg.alias or ""} if n}, load_s=time.perf_counter() - t0,
                    created=int(time.time()))
        return engine, make

    def ready():
        log.info("model %s loaded in %.2f s: context %d, %d slots, speculative %s (n_max %s)%s",
                 info["model_id"], info["load_s"], info["engine"].ctx_size, cfg.n_slots, info["spec_type"],
                 cfg.n_max, "" if scheduler.batched else "; this model has no batched forward, slots take turns")
        if on_ready:
            on_ready()

    metrics = Metrics(running=lambda: scheduler.running(), waiting=lambda: scheduler.queued())
    scheduler = Scheduler(load, cfg.n_slots, metrics, on_ready=ready, on_load_error=on_load_error)

    async def lifespan(app):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.close)

    app = FastAPI(title="gemmaspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.info, app.state.cfg = scheduler, metrics, info, cfg

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if request.url.path.endswith("completions"):
            metrics.failed("chat" if "chat" in request.url.path else "completions")
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = f"no such endpoint: {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return APIError(exc.status_code, msg).response()

    def guard(request: Request, need_model: bool = True) -> None:
        if cfg.api_key and request.url.path not in PUBLIC_PATHS:
            auth = request.headers.get("authorization", "")
            given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            if not given or not hmac.compare_digest(given.encode(), cfg.api_key.encode()):
                raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'")
        if need_model and not scheduler.ready.is_set():
            raise APIError(503, "Loading model")

    # -- read-only endpoints -----------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(resources.files("gemmaspec.server").joinpath("static/index.html").read_text("utf-8"))

    @app.get("/health")
    @app.get("/v1/health")
    async def health(request: Request):
        guard(request)
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request):
        guard(request)
        e = info["engine"]
        return {"object": "list", "data": [{
            "id": info["model_id"], "object": "model", "created": info["created"], "owned_by": "gemmaspec",
            "meta": {"n_ctx": e.ctx_size, "n_vocab": e.tokenizer.vocab_size,
                     "architecture": getattr(e.model.config, "architecture", "")}}]}

    @app.get("/props")
    async def props(request: Request):
        guard(request)
        e, d = info["engine"], SamplingParams()
        return {
            "model": info["model_id"], "model_path": str(info["path"]), "n_ctx": e.ctx_size,
            "total_slots": cfg.n_slots, "batched_forward": scheduler.batched,
            "speculative": {"type": info["spec_type"], "n_max": cfg.n_max, "n_min": cfg.n_min, "p_min": cfg.p_min,
                            "ngram_size": cfg.ngram_size, "ngram_min": cfg.ngram_min, "draft_model": cfg.draft_model},
            "default_generation_settings": {"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
                                            "min_p": d.min_p, "repeat_penalty": d.repeat_penalty,
                                            "max_tokens_completions": 16, "max_tokens_chat": None},
            "chat_template": e.tokenizer.chat_template,
        }

    @app.get("/slots")
    async def slots(request: Request):
        guard(request)
        return scheduler.slots_info()

    @app.get("/metrics")
    async def prometheus(request: Request):
        guard(request, need_model=False)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # -- generation ----------------------------------------------------------------------------------
    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        guard(request)
        req = _validate(CompletionRequest, await _json_body(request))
        e = info["engine"]
        params = _sampling(req, req.max_tokens, e.ctx_size, default_max=16)
        ids = _completion_prompt(req.prompt, e)
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, f"logprobs must be in 0..20 (got {req.logprobs})")
        return await _generate(request, req, "completions", ids, params, req.logprobs)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: Request):
        guard(request)
        req = _validate(ChatRequest, await _json_body(request))
        e = info["engine"]
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _sampling(req, max_tokens, e.ctx_size, default_max=-1)
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
        try:
            ids = e.tokenizer.encode_chat(messages)
        except GemmaspecError as exc:
            raise APIError(400, str(exc)) from None
        top = None
        if req.logprobs:
            top = req.top_logprobs or 0
            if not 0 <= top <= 20:
                raise APIError(400, f"top_logprobs must be in 0..20 (got {top})")
        elif req.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true")
        return await _generate(request, req, "chat", ids, params, top)

    async def _generate(request: Request, req, kind: str, ids: list[int], params: SamplingParams, logprobs):
        e = info["engine"]
        if req.model is not None and req.model not in info["names"]:
            raise APIError(404, f"model '{req.model}' not found; this server serves '{info['model_id']}'",
                           "not_found_error")
        if len(ids) >= e.ctx_size:
            raise APIError(400, f"the prompt is {len(ids)} tokens, the context is {e.ctx_size}: shorten the prompt "
                                f"or start the server with a larger -c", "exceed_context_size_error",
                           n_prompt_tokens=len(ids), n_ctx=e.ctx_size)
        n_max, n_min = _spec_overrides(req, cfg)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        job = Job(ids, params, emit, n_max, n_min, logprobs, name=f"{prefix}-{uuid.uuid4().hex[:24]}", endpoint=kind)
        try:
            scheduler.submit(job)
        except RuntimeError as exc:
            raise APIError(503, str(exc)) from None
        fmt = _Formatter(kind, job.name, info["model_id"], e.tokenizer, logprobs)
        if req.stream:
            return _JobStream(_stream(queue, fmt, job), on_close=lambda: scheduler.cancel(job))
        events = []
        try:
            while True:
                try:
                    what, payload = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        scheduler.cancel(job)
                        return Response(status_code=499)
                    continue
                if what == "events":
                    events.extend(payload)
                elif what == "done":
                    return fmt.whole(events, job)
                else:
                    raise APIError(*payload)
        finally:
            scheduler.cancel(job)  # a no-op once the job is done

    async def _stream(queue, fmt: "_Formatter", job: Job):
        if fmt.kind == "chat":
            yield _sse(fmt.chunk({"role": "assistant", "content": ""}, None))
        while True:
            what, payload = await queue.get()
            if what == "events":
                for ev in payload:
                    yield _sse(fmt.event_chunk(ev))
            elif what == "done":
                yield _sse(fmt.final_chunk(job))
                yield "data: [DONE]\n\n"
                return
            else:
                status, message = payload
                yield _sse({"error": {"message": message, "type": APIError.TYPES.get(status, "server_error"),
                                      "code": status}})
                return

    return app


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _sampling(req: _GenerationRequest, max_tokens: int | None, ctx: int, default_max: int) -> SamplingParams:
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


def _completion_prompt(prompt, engine) -> list[int]:
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


def _spec_overrides(req, cfg: ServeConfig) -> tuple[int | str, int]:
    """llama-server's per-request ``speculative.n_max`` / ``speculative.n_min`` (n_max 0 turns drafting
    off for the request); the server's settings otherwise."""
    extra = req.model_extra or {}
    n_max, n_min = extra.get("speculative.n_max"), extra.get("speculative.n_min")
    out_max = cfg.n_max if n_max is None else n_max
    out_min = cfg.n_min if n_min is None else n_min
    if not (out_max == "auto" or (isinstance(out_max, int) and not isinstance(out_max, bool) and 0 <= out_max <= 15)):
        raise APIError(400, f"speculative.n_max must be in 0..15 or 'auto' (got {n_max!r})")
    if not (isinstance(out_min, int) and not isinstance(out_min, bool) and out_min >= 0):
        raise APIError(400, f"speculative.n_min must be >= 0 (got {n_min!r})")
    return out_max, out_min


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Formatter:
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
