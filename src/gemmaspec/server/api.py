"""The HTTP API: OpenAI-compatible endpoints plus llama-server's native ones (``/completion``,
``/tokenize``, ``/detokenize``, ``/apply-template``, ``/health``, ``/props``, ``/slots``, ``/metrics``),
on FastAPI. See ``docs/server.md`` for usage and the conformance table.

Request bodies and responses are shaped in :mod:`.schema`; errors are OpenAI-style: 400 for
malformed JSON, missing, invalid or unsupported fields and prompts longer than the context, 401 for a
wrong or missing API key, 403/400/415/413 from :mod:`.security` (foreign origin, foreign Host, a body
that is not JSON, a body too large), 404 for an unknown path, 503 while the model loads. Generation runs on the :class:`~gemmaspec.server.scheduler.Scheduler` thread; each
request gets its events through an asyncio queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..errors import GemmaspecError
from ..request import RequestOptions
from ..sampling import SamplingParams, ban_end_of_generation
from ..seeds import SEED_RANDOM
from ..streaming import stop_matcher
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .scheduler import Job, Scheduler
from .schema import (MAX_CHOICES, APIError, ChatRequest, chat_messages, CompletionRequest, Formatter, NativeCompletionRequest,
                     NativeFormatter, completion_prompts, fingerprint, grammar_of, native_prompts, json_body, refuse_unsupported,
                     sampling_params, spec_overrides, sse, validate)
from .security import MAX_BODY_BYTES, Guard, key_matches
from .tools import parse_tools, render_history, tools_grammar, with_tools_prompt

log = logging.getLogger("gemmaspec.server")
_groups = itertools.count(1)  # numbers of requests that run several jobs (Job.group)

PUBLIC_PATHS = {"/", "/health", "/v1/health", "/v1/models", "/models"}  # llama-server's public set + the page
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


@dataclass
class ServeConfig:
    """What ``gemmaspec serve`` was asked for (see ``gemmaspec serve --help``).

    ``spec_type`` None picks the default: ``--spec-type default`` (for the default model
    ``ngram-simple,draft-mtp`` with the assistant shipped for it, else ``ngram-simple``), or with
    ``draft_model`` ``draft-mtp`` for an assistant checkpoint and ``draft-simple`` for a model; a list
    (``ngram-simple,draft-mtp``) as :func:`~gemmaspec.speculative.options.parse_spec_type`. ``p_min``
    None: the model drafter's own (0.3 for the shipped assistant, else 0; ``/props`` shows the value in
    use). ``n_max`` is an int (0..15) or ``"auto"``.
    ``defaults`` are the sampling settings a request gets for the fields it leaves out (``--temp``,
    ``--seed``...); ``n_predict`` (``-n``) the token limit for every endpoint (None: 16 for
    ``/v1/completions``, no limit for chat and ``/completion``). ``allowed_hosts``, ``cors_origins`` and
    ``max_body`` go to :class:`~gemmaspec.server.security.Guard`. ``slot_save_path``: the directory
    for ``POST /slots/{id}?action=save|restore`` (None: slot actions answer 501). ``alias``: the
    model's names, comma-separated (``/v1/models`` reports the alphabetically first as ``id`` and all
    as ``aliases``, with ``tags``, as llama-server). ``verbose`` (``--verbose``): every OpenAI response
    carries ``__verbose``; ``slots_endpoint`` False (``--no-slots``): ``GET /slots`` answers 501;
    ``metrics_endpoint`` False (``--no-metrics``): ``GET /metrics`` answers 501; ``ui`` False
    (``--no-ui``): ``/`` answers 404. ``chat_template``: Jinja text replacing the model's
    template (``--chat-template``, ``--chat-template-file``).
    """

    model: str | None = None
    draft_model: str | None = None
    spec_type: str | None = None
    n_max: int | str = 3
    n_min: int = 0
    p_min: float | None = None
    ngram_size: int = 4
    ngram_min: int = 1
    ctx_size: int | None = None
    n_slots: int = 4
    device: str = "auto"
    threads: int | None = None
    api_key: str | None = None
    alias: str | None = None
    defaults: SamplingParams = SamplingParams()
    n_predict: int | None = None
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    max_body: int = MAX_BODY_BYTES
    slot_save_path: str | None = None
    verbose: bool = False
    slots_endpoint: bool = True
    metrics_endpoint: bool = True
    ui: bool = True
    tags: tuple[str, ...] = ()
    chat_template: str | None = None
    context_shift: bool = False
    n_keep: int = 0


# -- the app -----------------------------------------------------------------------------------------
class _JobStream(StreamingResponse):
    """Server-sent events for one job; whatever ends the response (the last event, a client that
    went away, a cancelled task) releases the job's slot."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        async def watch():  # a client gone before the first event (e.g. during prefill) is noticed too
            while (await receive())["type"] != "http.disconnect":
                pass
            self._on_close()

        watcher = asyncio.create_task(watch())
        try:
            await super().__call__(scope, receive, send)
        finally:
            watcher.cancel()
            self._on_close()


def create_app(cfg: ServeConfig, on_ready=None, on_load_error=None) -> FastAPI:
    """The FastAPI application; the model loads on the scheduler thread when the app starts.

    Args:
        cfg: the server's settings.
        on_ready: called once the model is loaded (scheduler thread).
        on_load_error: called with the exception if loading fails (scheduler thread).
    """
    info: dict[str, Any] = {}
    started = int(time.time())

    def load():
        from ..loader import drafter_factory, drafter_file, load_engine
        from ..loading.default_model import default_model_path

        t0 = time.perf_counter()
        path = Path(cfg.model) if cfg.model else default_model_path()
        engine = load_engine(path, ctx_size=cfg.ctx_size, device=cfg.device, threads=cfg.threads)
        if cfg.chat_template is not None:
            engine.tokenizer.chat_template = cfg.chat_template
        spec, make = drafter_factory(cfg.spec_type, engine, cfg.draft_model, cfg.p_min, cfg.ngram_size,
                                     cfg.ngram_min)
        if cfg.n_max == "auto" and spec != "none":
            engine.forward_costs()
        names = {path.name, path.stem, str(path), str(cfg.model or "")}
        aliases = sorted({a.strip() for a in (cfg.alias or "").split(",") if a.strip()})
        info.update(p_min=cfg.p_min if cfg.p_min is not None else getattr(make, "p_min", 0.0),
                    draft_file=drafter_file(spec, cfg.draft_model, str(path)))  # -md, or the shipped assistant
        info.update(engine=engine, path=path, spec_type=spec, model_id=aliases[0] if aliases else path.name,
                    aliases=aliases, names={n for n in names | set(aliases) if n}, load_s=time.perf_counter() - t0,
                    created=int(time.time()))
        return engine, make

    def ready():
        from .. import kernels
        from ..speculative.options import spec_model_type

        log.info("model %s loaded in %.2f s: context %d, %d slots, speculative %s (n_max %s%s)%s%s",
                 info["model_id"], info["load_s"], info["engine"].ctx_size, cfg.n_slots, info["spec_type"],
                 cfg.n_max, f", p_min {info['p_min']:g}" if spec_model_type(info["spec_type"]) else "", "; int8 activations (--act-quant q8_0)" if kernels.act_quant() == "q8_0" else "",
                 "" if scheduler.batched else "; this model has no batched forward, slots take turns")
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
    if cfg.cors_origins:  # as browsers write Origin (a trailing slash or upper case in the flag would never match)
        from .security import normalize_origin

        app.add_middleware(CORSMiddleware, allow_origins=[normalize_origin(o) for o in cfg.cors_origins], allow_methods=["GET", "POST"],
                           allow_headers=["*"], allow_credentials="*" not in cfg.cors_origins)
    app.add_middleware(Guard, allowed_hosts=cfg.allowed_hosts, cors_origins=cfg.cors_origins, max_body=cfg.max_body)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        path = request.url.path
        if path.endswith(("completions", "completion")):
            metrics.failed("chat" if "chat" in path else "completions" if path.startswith("/v1/") else "completion")
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = f"no such endpoint: {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return APIError(exc.status_code, msg).response()

    def guard(request: Request, need_model: bool = True) -> None:
        if cfg.api_key and request.url.path not in PUBLIC_PATHS:
            auth = request.headers.get("authorization", "")
            given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            if not given or not key_matches(given, cfg.api_key):
                raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'")
        if need_model and not scheduler.ready.is_set():
            raise APIError(503, "Loading model")

    # -- read-only endpoints -----------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def index():
        if not cfg.ui:
            raise APIError(404, "the web UI is disabled (--no-ui)")
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
            "aliases": info["aliases"], "tags": list(cfg.tags),
            "meta": {"n_ctx": e.ctx_size, "n_vocab": e.tokenizer.vocab_size,
                     "architecture": getattr(e.model.config, "architecture", "")}}]}

    def settings(params: SamplingParams | None = None, n_max=None, n_min=None, p_min=None) -> dict:
        """llama-server's ``params`` / ``generation_settings`` for a request (default: the server's); the
        seed as llama-server shows it, a uint32 (4294967295: a random one)."""
        p = params or cfg.defaults
        n_pred = p.max_tokens if params is not None else (cfg.n_predict if cfg.n_predict is not None else -1)
        return {"n_predict": n_pred, "max_tokens": n_pred, "seed": SEED_RANDOM if p.seed < 0 else p.seed,
                "temperature": p.temperature,
                "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "repeat_last_n": p.repeat_last_n,
                "repeat_penalty": p.repeat_penalty, "presence_penalty": p.presence_penalty,
                "frequency_penalty": p.frequency_penalty, "logit_bias": logit_bias_json(p, info["engine"].tokenizer.stop_ids),
                **OFF_SAMPLERS, "stop": list(p.stop), "ignore_eos": p.ignore_eos, "n_probs": 0,
                "samplers": ["logit_bias", "penalties", "top_k", "top_p", "min_p", "temperature"],
                "speculative.n_max": cfg.n_max if n_max is None else n_max,
                "speculative.n_min": cfg.n_min if n_min is None else n_min,
                "speculative.p_min": info["p_min"] if p_min is None else p_min}

    def describe(job, last=None) -> dict:
        """A slot's llama-server fields: the running request's (``job``), or the last one's
        parameters with an idle ``next_token`` (nothing remains, nothing decoded)."""
        st = job.stats if job else None
        left = job.options.tokens_left(st.generated_tokens) if job else None
        task = job or last
        o = task.options
        return {"id_task": task.id_task, "speculative": info["spec_type"] != "none",
                "params": settings(o.params, o.n_max, o.n_min, o.p_min),
                "next_token": [{"has_next_token": job is not None, "has_new_line": False,  # a list, as llama-server's
                                "n_remain": -1 if left is None else left,
                                "n_decoded": st.generated_tokens if st else 0}]}

    @app.get("/props")
    async def props(request: Request):
        guard(request)
        e = info["engine"]
        return {
            "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": e.ctx_size,
                                            "speculative": info["spec_type"] != "none", "is_processing": False,
                                            "params": settings(), "prompt": "",
                                            "next_token": [{"has_next_token": True, "has_new_line": False,
                                                            "n_remain": -1, "n_decoded": 0}]},
            "total_slots": cfg.n_slots, "model_path": str(info["path"]), "chat_template": e.tokenizer.chat_template,
            "chat_template_caps": {}, "modalities": {"vision": False, "audio": False}, "build_info": fingerprint(),
            "model": info["model_id"], "n_ctx": e.ctx_size, "batched_forward": scheduler.batched,
            "speculative": {"type": info["spec_type"], "n_max": cfg.n_max, "n_min": cfg.n_min, "p_min": info["p_min"],
                            "ngram_size": cfg.ngram_size, "ngram_min": cfg.ngram_min, "draft_model": info["draft_file"]},
        }

    @app.get("/slots")
    async def slots(request: Request):
        guard(request)
        if not cfg.slots_endpoint:
            raise APIError(501, "This server does not support slots endpoint (started with --no-slots)",
                           "not_supported_error")
        out = [{"speculative": info["spec_type"] != "none", **s} for s in scheduler.slots_info(describe)]
        if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in out):
            raise APIError(503, "no slot available", "unavailable_error")  # llama-server's ?fail_on_no_slot=1
        return out

    @app.post("/slots/{id_slot}")
    async def slot_action(id_slot: str, request: Request):
        guard(request, need_model=False)
        if not cfg.slot_save_path:
            raise APIError(501, "This server does not support slots action: start it with --slot-save-path DIR",
                           "not_supported_error")
        guard(request)
        action = request.query_params.get("action")
        if not id_slot.isdigit() or not int(id_slot) < cfg.n_slots:
            raise APIError(400, f"no slot {id_slot!r}: slots are 0..{cfg.n_slots - 1}")
        if action not in ("save", "restore", "erase"):
            raise APIError(400, f"invalid action {action!r}: save, restore or erase (/slots/ID?action=save)")
        body = await json_body(request)
        from . import slots as slot_files

        try:
            if action == "erase":
                fn = slot_files.erase
            else:
                path = Path(cfg.slot_save_path) / slot_files.check_filename(body.get("filename"))
                op = slot_files.save if action == "save" else slot_files.restore
                fn = lambda s: op(s, path, info["path"].name)  # noqa: E731
            return await asyncio.wrap_future(scheduler.slot_action(int(id_slot), fn))
        except GemmaspecError as exc:
            raise APIError(400, str(exc)) from None
        except RuntimeError as exc:
            raise APIError(503, str(exc)) from None

    @app.get("/metrics")
    async def prometheus(request: Request):
        guard(request, need_model=False)
        if not cfg.metrics_endpoint:
            raise APIError(501, "This server does not support metrics endpoint (started with --no-metrics)",
                           "not_supported_error")
        resp = Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
        # llama-server's header, spelled as it spells it (clients that read headers into a plain dict
        # look it up by that spelling; Starlette would lower-case it)
        resp.raw_headers.append((b"Process-Start-Time-Unix", str(started).encode()))
        return resp

    # -- tokens and templates (llama-server) -----------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(request: Request):
        guard(request)
        body = await json_body(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise APIError(400, "missing required field 'content' (the text to tokenize)")
        tok = info["engine"].tokenizer
        ids = tok.encode(content, add_bos=bool(body.get("add_special", False))) if body.get("parse_special", True) \
            else tok.encode_text(content, add_bos=bool(body.get("add_special", False)))
        if not body.get("with_pieces", False):
            return {"tokens": ids}
        from .schema import TokenText

        text_of = TokenText(tok)
        out = []
        for t in ids:
            s, b = text_of(t)
            out.append({"id": t, "piece": s if not s.startswith("bytes:") else list(b)})
        return {"tokens": out}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        guard(request)
        body = await json_body(request)
        ids = body.get("tokens", [])
        vocab = info["engine"].tokenizer.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "'tokens' must be a list of token ids")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return {"content": info["engine"].tokenizer.decode(ids)}

    def chat_prompt(req, spec) -> list[dict]:
        """The template's messages: tool parts of the history as text, the tools in the system turn."""
        messages = render_history(chat_messages(req), req.messages)
        return with_tools_prompt(messages, spec) if spec is not None else messages

    def template_kwargs(req) -> dict | None:
        """``chat_template_kwargs``: more variables for the chat template, as llama-server and vLLM
        take them (the template's own ones, ``messages`` and the like, cannot be replaced: a 400)."""
        kw = req.chat_template_kwargs
        fixed = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "date_string", "datetime"}
        if kw and fixed.intersection(kw):
            raise APIError(400, f"chat_template_kwargs cannot set {', '.join(sorted(fixed.intersection(kw)))}")
        return kw or None

    def chat_ids(req, body: dict) -> tuple[list[int], object]:
        """A chat request's prompt ids (and its tools): rendered with the template, the generation
        prompt or the continuation of a final assistant message as the request says."""
        spec = parse_tools(body)
        messages = chat_prompt(req, spec)
        agp, cont = continuation(req)
        try:
            return info["engine"].tokenizer.encode_chat(messages, add_generation_prompt=agp, continue_final=cont,
                                                        template_kwargs=template_kwargs(req)), spec
        except GemmaspecError as exc:
            raise APIError(400, str(exc)) from None

    @app.post("/apply-template")
    async def apply_template(request: Request):
        guard(request)
        body = await json_body(request)
        req = validate(ChatRequest, body)
        messages = chat_prompt(req, parse_tools(body))
        agp, cont = continuation(req)
        try:
            return {"prompt": info["engine"].tokenizer.apply_chat_template(
                messages, add_generation_prompt=agp, continue_final=cont, template_kwargs=template_kwargs(req))}
        except GemmaspecError as exc:
            raise APIError(400, str(exc)) from None

    @app.post("/chat/completions/input_tokens")
    @app.post("/v1/chat/completions/input_tokens")
    async def chat_input_tokens(request: Request):
        """llama-server's count of a chat request's prompt tokens, without generating."""
        guard(request)
        body = await json_body(request)
        refuse_unsupported(body, chat=True)
        req = validate(ChatRequest, body)
        ids, _ = chat_ids(req, body)
        return {"input_tokens": len(ids)}

    # -- generation ----------------------------------------------------------------------------------
    def params_for(req, default_max, max_n=1):
        e = info["engine"]
        default = cfg.n_predict if cfg.n_predict is not None else default_max
        return sampling_params(req, e.ctx_size, default_max=default,
                               defaults=cfg.defaults,
                               tokenizer=e.tokenizer, max_n=max_n)

    @app.post("/v1/completions")
    async def completions(request: Request):
        guard(request)
        body = await json_body(request)
        refuse_unsupported(body)
        req = validate(CompletionRequest, body)
        e = info["engine"]
        params = params_for(req, 16, MAX_CHOICES)
        prompts = completion_prompts(req.prompt, e)
        if len(prompts) * req.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts × n = {req.n} make {len(prompts) * req.n} choices (at most "
                                f"{MAX_CHOICES})")
        ids = prompts[0]
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, f"logprobs must be in 0..20 (got {req.logprobs})")
        grammar = grammar_of(body)
        rid, usage, verbose = f"cmpl-{uuid.uuid4().hex[:24]}", _include_usage(req), verbose_formatter(req, params, ids)
        fmts = [Formatter("completions", rid, info["model_id"], e.tokenizer, req.logprobs, usage,
                          timings_per_token=req.timings_per_token, verbose=verbose if i == 0 else None, index=i)
                for i in range(len(prompts) * req.n)]
        check_slot(req)
        if len(fmts) > 1:  # OpenAI's order: prompt p's n choices are p*n .. p*n + n-1
            for p in prompts:  # all or none: check every prompt before any runs
                _check_context(p)
            return await _generate_n(request, req, "completions", [p for p in prompts for _ in range(req.n)], params,
                                     req.logprobs, fmts, grammar)
        return await _generate(request, req, "completions", ids, params, req.logprobs, fmts[0], want_slot=req.id_slot,
                               grammar=grammar)

    @app.post("/completion")
    @app.post("/completions")
    async def native_completion(request: Request):
        guard(request)
        body = await json_body(request)
        refuse_unsupported(body, native=True)
        req = validate(NativeCompletionRequest, body)
        e = info["engine"]
        params = params_for(req, -1)
        prompts = native_prompts(req.prompt, e)
        if body.get("n_probs") is None and req.logprobs is not None:  # llama-server's alias
            req.n_probs = req.logprobs
        if not 0 <= req.n_probs <= 20:
            raise APIError(400, f"n_probs must be in 0..20 (got {req.n_probs})")
        check_slot(req)
        n_max, n_min, p_min = spec_overrides(req, cfg)
        grammar = grammar_of(body)
        if req.post_sampling_probs and grammar is not None:
            raise APIError(400, f"post_sampling_probs cannot be combined with '{grammar.field}'")
        fmts = [NativeFormatter(info["model_id"], e.tokenizer, req.n_probs, req.return_tokens,
                                {**settings(params, n_max, n_min, p_min), "n_probs": req.n_probs, "n_ctx": e.ctx_size,
                                 "model": info["model_id"], "post_sampling_probs": req.post_sampling_probs,
                                 "timings_per_token": req.timings_per_token},
                                e.tokenizer.decode(ids), timings_per_token=req.timings_per_token,
                                response_fields=req.response_fields) for ids in prompts]
        n_probs = req.n_probs if req.n_probs else None
        if len(prompts) == 1:
            return await _generate(request, req, "completion", prompts[0], params, n_probs, fmts[0],
                                   want_slot=req.id_slot, grammar=grammar)
        for ids in prompts:  # all or none: check every prompt before any runs
            _check_context(ids)
        group = next(_groups)
        if req.stream:  # one stream, each event tagged with its prompt's index (llama-server's)
            queue: asyncio.Queue = asyncio.Queue()
            jobs = []
            try:
                for i, ids in enumerate(prompts):
                    jobs.append(await _submit(req, "completion", ids, params, n_probs, fmts[i], queue, req.id_slot,
                                              grammar, tag=i, group=group))
            except BaseException:
                for j in jobs:
                    scheduler.cancel(j)
                raise
            return _JobStream(_native_multi_stream(queue, fmts, jobs),
                              on_close=lambda: [scheduler.cancel(j) for j in jobs])
        got = await asyncio.gather(*[_generate(request, req, "completion", ids, params, n_probs, fmts[i],
                                               want_slot=req.id_slot, grammar=grammar, group=group)
                                     for i, ids in enumerate(prompts)], return_exceptions=True)
        for r in got:
            if isinstance(r, BaseException):
                raise r
            if isinstance(r, Response):  # the client left
                return r
        return [{**r, "index": i} for i, r in enumerate(got)]

    @app.post("/infill")
    async def infill(request: Request):
        """llama-server's fill-in-the-middle endpoint. The request is checked as llama-server checks it
        (``input_prefix`` / ``input_suffix`` / ``prompt`` strings, ``input_extra`` a list of
        ``{"filename": string, "text": string}``: 400 otherwise); then, as llama-server does for a
        model whose vocabulary has no FIM prefix / suffix / middle tokens, a 501: Gemma 3 and Gemma 4
        have none (their vocabulary spells ``<|fim_prefix|>`` as six ordinary tokens)."""
        guard(request)
        body = await json_body(request)
        for field in ("input_prefix", "input_suffix", "prompt"):
            if field in body and not isinstance(body[field], str):
                raise APIError(400, f"'{field}' must be a string")
        extra = body.get("input_extra", [])
        if not isinstance(extra, list):
            raise APIError(400, "'input_extra' must be an array of {\"filename\": string, \"text\": string}")
        for chunk in extra:
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
                raise APIError(400, "each 'input_extra' chunk must have a 'text' field with a string value")
            if "filename" in chunk and not isinstance(chunk["filename"], str):
                raise APIError(400, "an 'input_extra' chunk's 'filename' must be a string")
        raise APIError(501, "Infill is not supported by this model: prefix token is missing. suffix token is missing. "
                            "middle token is missing. (Gemma's vocabulary has no fill-in-the-middle tokens; "
                            "use /completion with the text before the gap)")

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: Request):
        guard(request)
        body = await json_body(request)
        refuse_unsupported(body, chat=True)
        req = validate(ChatRequest, body)
        e = info["engine"]
        params = params_for(req, -1, MAX_CHOICES)
        ids, spec = chat_ids(req, body)
        top = None
        if req.logprobs:
            top = req.top_logprobs or 0
            if not 0 <= top <= 20:
                raise APIError(400, f"top_logprobs must be in 0..20 (got {top})")
        elif req.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true")
        grammar = grammar_of(body)
        if spec is not None and spec.active:
            if grammar is not None:
                raise APIError(400, f"'tools' cannot be combined with '{grammar.field}' (unless tool_choice is none)")
            grammar = tools_grammar(spec)
        tools = spec if spec is not None and spec.active else None
        if tools is not None and req.n > 1:
            raise APIError(400, "n > 1 is not supported together with tools (one choice per tool-calling request)")
        rid, usage, verbose = f"chatcmpl-{uuid.uuid4().hex[:24]}", _include_usage(req), verbose_formatter(req, params, ids)
        fmts = [Formatter("chat", rid, info["model_id"], e.tokenizer, top, usage, tools=tools,
                          timings_per_token=req.timings_per_token, verbose=verbose if i == 0 else None, index=i)
                for i in range(req.n)]
        check_slot(req)
        if req.n > 1:
            return await _generate_n(request, req, "chat", [ids] * req.n, params, top, fmts, grammar)
        return await _generate(request, req, "chat", ids, params, top, fmts[0], want_slot=req.id_slot, grammar=grammar)

    def check_slot(req) -> None:
        if not -1 <= req.id_slot < cfg.n_slots:
            raise APIError(400, f"id_slot must be -1 (any) or a slot in 0..{cfg.n_slots - 1} (got {req.id_slot})")

    def continuation(req) -> tuple[bool, bool]:
        """``(add_generation_prompt, continue_final)`` for a chat request, as llama-server decides:
        a final assistant message is continued (prefilled: the reply goes on from its text) unless
        ``continue_final_message: false``; ``continue_final_message: true`` with
        ``add_generation_prompt: true`` is a 400."""
        agp = True if req.add_generation_prompt is None else req.add_generation_prompt
        cont = req.continue_final_message
        last = req.messages[-1]
        if cont is None and last.role == "assistant":
            if len(req.messages) >= 2 and req.messages[-2].role == "assistant":
                raise APIError(400, "Cannot have 2 or more assistant messages at the end of the list.")
            cont, agp = True, False
        if cont and agp:
            raise APIError(400, "Cannot set both add_generation_prompt and continue_final_message to true.")
        if cont and last.role != "assistant":
            raise APIError(400, "continue_final_message needs a final assistant message to continue")
        if cont and (last.model_extra or {}).get("tool_calls"):
            raise APIError(400, "Cannot continue an assistant message that contains tool calls (tool_calls); "
                                "send continue_final_message: false")
        return agp, bool(cont)

    def verbose_formatter(req, params: SamplingParams, ids: list[int]) -> NativeFormatter | None:
        """The ``__verbose`` result's formatter (``--verbose`` or the request's ``verbose: true``)."""
        if not (cfg.verbose or req.verbose):
            return None
        e = info["engine"]
        n_max, n_min, p_min = spec_overrides(req, cfg)
        return NativeFormatter(info["model_id"], e.tokenizer, 0, False,
                               {**settings(params, n_max, n_min, p_min), "n_ctx": e.ctx_size, "model": info["model_id"]},
                               e.tokenizer.decode(ids))

    def _include_usage(req) -> bool | None:
        opts = req.stream_options
        if opts is None:
            return None
        if not req.stream:
            raise APIError(400, "stream_options is only allowed with stream: true")
        v = opts.get("include_usage")
        if v is not None and not isinstance(v, bool):
            raise APIError(400, f"stream_options.include_usage must be true or false (got {v!r})")
        return bool(v)

    def _check_context(ids: list[int]) -> None:
        n_ctx = info["engine"].ctx_size
        if len(ids) >= n_ctx and not cfg.context_shift:  # with it, the prompt is cut (RequestState)
            raise APIError(400, f"request ({len(ids)} tokens) exceeds the available context size ({n_ctx} "
                                f"tokens), try increasing it", "exceed_context_size_error",  # llama-server's words
                           n_prompt_tokens=len(ids), n_ctx=n_ctx)

    async def _submit(req, kind: str, ids: list[int], params: SamplingParams, logprobs, fmt, queue: asyncio.Queue,
                      want_slot: int = -1, grammar=None, tag=None, group=None) -> Job:
        """Queue one generation; its events arrive on ``queue`` (as ``(tag, item)`` when ``tag`` is given)."""
        e = info["engine"]
        # any model name is accepted while one model is served (llama-server does the same)
        _check_context(ids)
        n_max, n_min, p_min = spec_overrides(req, cfg)
        if params.stop:  # build the stop-string automaton here, not on the scheduler thread
            await asyncio.to_thread(stop_matcher, tuple(params.stop))
        constraint = None
        if grammar is not None:  # here too (the first one builds llguidance's tokenizer, seconds)
            try:
                constraint = await asyncio.to_thread(grammar.constraint, e.tokenizer)
            except GemmaspecError as exc:
                raise APIError(400, str(exc)) from None
        loop = asyncio.get_running_loop()

        def emit(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item if tag is None else (tag, item))
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        name = getattr(fmt, "id", None) or f"cmpl-{uuid.uuid4().hex[:24]}"
        options = RequestOptions(params, n_max=n_max, n_min=n_min, p_min=p_min, logprobs=logprobs, constraint=constraint,
                                 post_sampling=bool(getattr(req, "post_sampling_probs", False)),
                                 context_shift=cfg.context_shift,
                                 n_keep=cfg.n_keep if req.n_keep is None else req.n_keep, n_discard=req.n_discard)
        job = Job(ids, options, emit, name=name, endpoint=kind, want_slot=want_slot, cache_prompt=req.cache_prompt,
                  progress=req.return_progress and req.stream, group=group)
        try:
            scheduler.submit(job)
        except RuntimeError as exc:
            raise APIError(503, str(exc)) from None
        return job

    async def _generate(request: Request, req, kind: str, ids: list[int], params: SamplingParams, logprobs, fmt,
                        want_slot: int = -1, grammar=None, group=None):
        queue: asyncio.Queue = asyncio.Queue()
        job = await _submit(req, kind, ids, params, logprobs, fmt, queue, want_slot, grammar, group=group)
        if req.stream:
            gen = _native_stream(queue, fmt, job) if kind == "completion" else _stream(queue, fmt, job)
            return _JobStream(gen, on_close=lambda: scheduler.cancel(job))

        async def watch():  # the client's disconnect, noticed at once (not when tokens stop flowing)
            while (await request.receive())["type"] != "http.disconnect":
                pass
            scheduler.cancel(job)
            queue.put_nowait(("gone", None))

        watcher = asyncio.create_task(watch())
        events = []
        try:
            while True:
                what, payload = await queue.get()
                if what == "events":
                    events.extend(payload)
                elif what == "progress":
                    pass
                elif what == "done":
                    return fmt.final(events, job) if kind == "completion" else fmt.whole(events, job)
                elif what == "gone":
                    return Response(status_code=499)
                else:
                    raise APIError(*payload)
        finally:
            watcher.cancel()
            scheduler.cancel(job)  # a no-op once the job is done

    async def _generate_n(request: Request, req, kind: str, prompts: list[list[int]], params: SamplingParams,
                          logprobs, fmts: list[Formatter], grammar):
        """Several choices (``n`` > 1, or several prompts on ``/v1/completions``): one job each, choice i
        running ``prompts[i]`` (the same list object for the choices of one prompt), in parallel as
        slots allow; a given seed S gives choice i the seed S + i, so choices differ and repeat. Merged
        into one response or one stream whose chunks carry their choice's ``index``; usage counts each
        prompt once and every choice's tokens."""
        each = [params if params.seed < 0 else replace(params, seed=params.seed + i) for i in range(len(fmts))]
        group = next(_groups)
        if req.stream:
            queue: asyncio.Queue = asyncio.Queue()
            jobs: list[Job] = []
            try:
                for i, fmt in enumerate(fmts):
                    jobs.append(await _submit(req, kind, prompts[i], each[i], logprobs, fmt, queue, req.id_slot,
                                              grammar=grammar, tag=i, group=group))
            except BaseException:
                for j in jobs:
                    scheduler.cancel(j)
                raise
            return _JobStream(_multi_stream(queue, fmts, jobs), on_close=lambda: [scheduler.cancel(j) for j in jobs])
        got = await asyncio.gather(*[_generate(request, req, kind, prompts[i], each[i], logprobs, fmt,
                                               want_slot=req.id_slot, grammar=grammar, group=group)
                                     for i, fmt in enumerate(fmts)],
                                   return_exceptions=True)
        for r in got:
            if isinstance(r, BaseException):
                raise r
            if isinstance(r, Response):  # the client left
                return r
        out = got[0]
        out["choices"] = [r["choices"][0] for r in got]
        prompt = sum({id(p): r["usage"]["prompt_tokens"] for p, r in zip(prompts, got)}.values())
        done = sum(r["usage"]["completion_tokens"] for r in got)
        out["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        return out

    async def _multi_stream(queue, fmts: list[Formatter], jobs: list[Job]):
        if fmts[0].kind == "chat":
            for f in fmts:
                yield sse(f.first_chunk())
        left = len(jobs)
        while left:
            i, (what, payload) = await queue.get()
            if what == "progress":
                yield sse(fmts[i].progress_chunk(payload))
            elif what == "events":
                for ev in payload:
                    yield sse(fmts[i].event_chunk(ev, jobs[i]))
            elif what == "done":
                left -= 1
                for c in fmts[i].final_chunks(jobs[i], usage_jobs=jobs if not left else []):
                    yield sse(c)
            else:
                yield _sse_error(payload)
                return
        yield "data: [DONE]\n\n"

    async def _stream(queue, fmt: "Formatter", job: Job):
        if fmt.kind == "chat":
            yield sse(fmt.first_chunk())
        held = [] if fmt.tools is not None else None  # events held back while the reply may be a tool call
        while True:
            what, payload = await queue.get()
            if what == "progress":
                yield sse(fmt.progress_chunk(payload))
            elif what == "events":
                for ev in payload:
                    if held is not None:
                        held.append(ev)
                        start = "".join(e.text for e in held).lstrip()
                        if not start or start.startswith("{"):
                            continue
                        for e in held:  # plain text: stream it from here on
                            yield sse(fmt.event_chunk(e, job))
                        held = None
                        continue
                    yield sse(fmt.event_chunk(ev, job))
            elif what == "done":
                finish = None
                if held is not None:
                    calls = fmt.tool_calls("".join(e.text for e in held), job)
                    if calls:
                        for c in fmt.tool_call_chunks(calls):
                            yield sse(c)
                        finish = "tool_calls"
                    else:
                        for e in held:
                            yield sse(fmt.event_chunk(e, job))
                for c in fmt.final_chunks(job, finish):
                    yield sse(c)
                yield "data: [DONE]\n\n"
                return
            else:
                yield _sse_error(payload)
                return

    async def _native_multi_stream(queue, fmts: list[NativeFormatter], jobs: list[Job]):
        left = len(jobs)
        while left:
            i, (what, payload) = await queue.get()
            if what == "progress":
                yield sse({**fmts[i].progress_chunk(payload, jobs[i]), "index": i})
            elif what == "events":
                for ev in payload:
                    yield sse({**fmts[i].event_chunk(ev, jobs[i]), "index": i})
            elif what == "done":
                yield sse({**fmts[i].final([], jobs[i], content="", tokens=[]), "index": i})
                left -= 1
            else:
                yield _sse_error(payload)
                return

    async def _native_stream(queue, fmt: NativeFormatter, job: Job):
        while True:
            what, payload = await queue.get()
            if what == "progress":
                yield sse(fmt.progress_chunk(payload, job))
            elif what == "events":
                for ev in payload:
                    yield sse(fmt.event_chunk(ev, job))
            elif what == "done":
                yield sse(fmt.final([], job, content="", tokens=[]))
                return
            else:
                yield _sse_error(payload)
                return

    return app


def _sse_error(payload) -> str:
    status, message = payload
    return sse({"error": {"message": message, "type": APIError.TYPES.get(status, "server_error"), "code": status}})
