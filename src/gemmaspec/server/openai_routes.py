"""OpenAI's endpoints: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (and their
spellings without ``/v1``), and llama-server's ``/v1/chat/completions/input_tokens``.

The API key is checked by the app-wide dependency (:func:`~gemmaspec.server.deps.require_key`);
each route here needs the model loaded (503 before, :func:`~gemmaspec.server.deps.loaded`).
"""

from __future__ import annotations

import asyncio

import uuid

from fastapi import APIRouter, Depends, Request

from ..sampling import SamplingParams
from . import jobs
from .apierror import APIError
from .deps import loaded
from .parse import ChatRequest, CompletionRequest, json_body, refuse_unsupported, validate
from .responses import Formatter, NativeFormatter, generation_settings
from .state import ServerState
from .tools import tools_grammar
from .translate import (MAX_CHOICES, chat_ids, check_context, check_slot, completion_prompts, grammar_of,
                        has_prompt_object, include_usage, native_inputs, request_params, spec_overrides)

router = APIRouter()


def verbose_formatter(st: ServerState, req, params: SamplingParams, ids: list[int]) -> NativeFormatter | None:
    """The ``__verbose`` result's formatter (``--verbose`` or the request's ``verbose: true``), else None.

    Raises:
        APIError: 400 for bad ``speculative.*`` fields.
    """
    if not (st.cfg.verbose or req.verbose):
        return None
    e = st.engine
    n_max, n_min, p_min = spec_overrides(req, st.cfg)
    return NativeFormatter(st.model.model_id, e.tokenizer, 0, False,
                           {**generation_settings(st, params, n_max, n_min, p_min), "n_ctx": e.ctx_size,
                            "model": st.model.model_id},
                           e.tokenizer.decode(ids))


@router.get("/v1/models")
@router.get("/models")
async def models(st: ServerState = Depends(loaded)):
    """The one model served, as OpenAI lists models (with llama-server's ``aliases``, ``tags``, ``meta``)."""
    e = st.engine
    return {"object": "list", "data": [{
        "id": st.model.model_id, "object": "model", "created": st.model.created, "owned_by": "gemmaspec",
        "aliases": st.model.aliases, "tags": list(st.cfg.tags),
        "meta": {"n_ctx": e.ctx_size, "n_vocab": e.tokenizer.vocab_size,
                 "architecture": getattr(e.model.config, "architecture", "")}}]}


@router.post("/chat/completions/input_tokens")
@router.post("/v1/chat/completions/input_tokens")
async def chat_input_tokens(request: Request, st: ServerState = Depends(loaded)):
    """llama-server's count of a chat request's prompt tokens, without generating."""
    body = await json_body(request)
    refuse_unsupported(body, chat=True)
    req = validate(ChatRequest, body)
    ids, _, _ = await _chat_ids(req, body, st)
    return {"input_tokens": len(ids)}


@router.post("/v1/completions")
async def completions(request: Request, st: ServerState = Depends(loaded)):
    """OpenAI's text completions: ``n`` choices of one or several prompts, whole or streamed."""
    body = await json_body(request)
    refuse_unsupported(body)
    req = validate(CompletionRequest, body)
    e = st.engine
    params = request_params(req, st.cfg, e, 16, MAX_CHOICES)
    prompts, images = await completion_inputs(req.prompt, st)
    if any(images) and req.n > 1:
        raise APIError(400, "n > 1 is not supported together with images (one choice per prompt with images)")
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts × n = {req.n} make {len(prompts) * req.n} choices (at most "
                            f"{MAX_CHOICES})")
    ids = prompts[0]
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(400, f"logprobs must be in 0..20 (got {req.logprobs})")
    grammar = grammar_of(body)
    rid, usage, verbose = f"cmpl-{uuid.uuid4().hex[:24]}", include_usage(req), verbose_formatter(st, req, params, ids)
    fmts = [Formatter("completions", rid, st.model.model_id, e.tokenizer, req.logprobs, usage,
                      timings_per_token=req.timings_per_token, verbose=verbose if i == 0 else None, index=i,
                      provenance=req.return_provenance)
            for i in range(len(prompts) * req.n)]
    check_slot(req.id_slot, st.cfg.n_slots)
    if len(fmts) > 1:  # OpenAI's order: prompt p's n choices are p*n .. p*n + n-1
        for p in prompts:  # all or none: check every prompt before any runs
            check_context(p, e.ctx_size, st.cfg.context_shift)
        return await jobs.generate_n(st, request, req, "completions", [p for p in prompts for _ in range(req.n)],
                                     params, req.logprobs, fmts, grammar, [im for im in images for _ in range(req.n)])
    return await jobs.generate(st, request, req, "completions", ids, params, req.logprobs, fmts[0],
                               want_slot=req.id_slot, grammar=grammar, images=images[0])


async def completion_inputs(prompt, st: ServerState) -> tuple[list[list[int]], list[list]]:
    """``/v1/completions`` prompts and their images: OpenAI's forms (:func:`completion_prompts`), or
    llama-server's prompt objects, with ``multimodal_data`` too (:func:`native_inputs`, as
    llama-server reads them here as on ``/completion``; images are encoded off the event loop)."""
    if not has_prompt_object(prompt):
        prompts = completion_prompts(prompt, st.engine)
        return prompts, [[] for _ in prompts]
    vision = st.model.vision
    got = native_inputs(prompt, st.engine) if vision is None else \
        await asyncio.to_thread(native_inputs, prompt, st.engine, vision)
    return [ids for ids, _ in got], [spans for _, spans in got]


def _top_logprobs(req: ChatRequest) -> int | None:
    """The chat request's alternatives per token (None: no log-probabilities).

    Raises:
        APIError: 400 for ``top_logprobs`` outside 0..20 or without ``logprobs: true``.
    """
    top = None
    if req.logprobs:
        top = req.top_logprobs or 0
        if not 0 <= top <= 20:
            raise APIError(400, f"top_logprobs must be in 0..20 (got {top})")
    elif req.top_logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true")
    return top


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat(request: Request, st: ServerState = Depends(loaded)):
    """OpenAI's chat completions, with tools, constrained output and ``n`` choices, whole or streamed."""
    body = await json_body(request)
    refuse_unsupported(body, chat=True)
    req = validate(ChatRequest, body)
    e = st.engine
    params = request_params(req, st.cfg, e, -1, MAX_CHOICES)
    ids, spec, images = await _chat_ids(req, body, st)
    top = _top_logprobs(req)
    grammar = grammar_of(body)
    if spec is not None and spec.active:
        if grammar is not None:
            raise APIError(400, f"'tools' cannot be combined with '{grammar.field}' (unless tool_choice is none)")
        grammar = tools_grammar(spec)
    tools = spec if spec is not None and spec.active else None
    if tools is not None and req.n > 1:
        raise APIError(400, "n > 1 is not supported together with tools (one choice per tool-calling request)")
    rid, usage, verbose = f"chatcmpl-{uuid.uuid4().hex[:24]}", include_usage(req), verbose_formatter(st, req, params, ids)
    fmts = [Formatter("chat", rid, st.model.model_id, e.tokenizer, top, usage, tools=tools,
                      timings_per_token=req.timings_per_token, verbose=verbose if i == 0 else None, index=i,
                      provenance=req.return_provenance)
            for i in range(req.n)]
    check_slot(req.id_slot, st.cfg.n_slots)
    if images and req.n > 1:
        raise APIError(400, "n > 1 is not supported together with images (one choice per request with images)")
    if req.n > 1:
        return await jobs.generate_n(st, request, req, "chat", [ids] * req.n, params, top, fmts, grammar)
    return await jobs.generate(st, request, req, "chat", ids, params, top, fmts[0], want_slot=req.id_slot,
                               grammar=grammar, images=images)


async def _chat_ids(req, body, st: ServerState):
    """:func:`chat_ids` with the loaded vision tower (``--mmproj``); images are decoded and encoded off
    the event loop."""
    vision = st.model.vision
    if vision is None:
        return chat_ids(req, body, st.engine.tokenizer)
    return await asyncio.to_thread(chat_ids, req, body, st.engine.tokenizer, vision, st.cfg.allow_image_urls)
