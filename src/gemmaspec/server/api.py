"""The HTTP API: OpenAI-compatible endpoints plus llama-server's ``/health``, ``/props``, ``/slots``
and ``/metrics``, on FastAPI. See ``docs/server.md`` for usage.

Request bodies and responses are shaped in :mod:`.schema`; errors are OpenAI-style: 400 for
malformed JSON, missing or invalid fields and prompts longer than the context, 401 for a wrong or
missing API key, 404 for an unknown model or path, 503 while the model loads. Generation runs on the :class:`~gemmaspec.server.scheduler.Scheduler` thread; each
request gets its events through an asyncio queue.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import GemmaspecError
from ..sampling import SamplingParams
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .scheduler import Job, Scheduler
from .schema import (APIError, ChatRequest, chat_messages, CompletionRequest, Formatter, completion_prompt, json_body, sampling_params,
                     spec_overrides, sse, validate)

log = logging.getLogger("gemmaspec.server")

PUBLIC_PATHS = {"/", "/health", "/v1/health", "/v1/models", "/models"}  # llama-server's public set + the page


@dataclass
class ServeConfig:
    """What ``gemmaspec serve`` was asked for (see ``gemmaspec serve --help``).

    ``spec_type`` None picks the default: ``ngram-simple``, or with ``draft_model`` ``draft-mtp`` for an
    assistant checkpoint and ``draft-simple`` for a model. ``n_max`` is an int (0..15) or ``"auto"``.
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
        spec, make = drafter_factory(cfg.spec_type, engine, cfg.draft_model, cfg.p_min, cfg.ngram_size,
                                     cfg.ngram_min)
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
        req = validate(CompletionRequest, await json_body(request))
        e = info["engine"]
        params = sampling_params(req, req.max_tokens, e.ctx_size, default_max=16)
        ids = completion_prompt(req.prompt, e)
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, f"logprobs must be in 0..20 (got {req.logprobs})")
        return await _generate(request, req, "completions", ids, params, req.logprobs)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: Request):
        guard(request)
        req = validate(ChatRequest, await json_body(request))
        e = info["engine"]
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, max_tokens, e.ctx_size, default_max=-1)
        messages = chat_messages(req)
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
        n_max, n_min = spec_overrides(req, cfg)
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
        fmt = Formatter(kind, job.name, info["model_id"], e.tokenizer, logprobs)
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

    async def _stream(queue, fmt: "Formatter", job: Job):
        if fmt.kind == "chat":
            yield sse(fmt.chunk({"role": "assistant", "content": ""}, None))
        while True:
            what, payload = await queue.get()
            if what == "events":
                for ev in payload:
                    yield sse(fmt.event_chunk(ev))
            elif what == "done":
                yield sse(fmt.final_chunk(job))
                yield "data: [DONE]\n\n"
                return
            else:
                status, message = payload
                yield sse({"error": {"message": message, "type": APIError.TYPES.get(status, "server_error"),
                                      "code": status}})
                return

    return app


