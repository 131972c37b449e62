"""llama-server's native endpoints: ``/health``, ``/props``, ``/slots`` (and slot save / restore /
erase), ``/metrics``, ``/tokenize``, ``/detokenize``, ``/apply-template``, ``/completion``,
``/infill``; and the chat page at ``/`` with its files under ``/static/``.

The API key is checked by the app-wide dependency (:func:`~gemmaspec.server.deps.require_key`);
the routes that read the model take :func:`~gemmaspec.server.deps.loaded` (503 while it loads).
"""

from __future__ import annotations

import asyncio
import functools
from importlib import resources

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response

from ..errors import GemmaspecError
from ..manage.catalog import is_base
from . import jobs
from .apierror import APIError
from .deps import loaded, server_state
from .metrics import CONTENT_TYPE_LATEST
from .parse import ChatRequest, NativeCompletionRequest, json_body, refuse_unsupported, validate
from .responses import NativeFormatter, TokenText, fingerprint, generation_settings, slot_fields
from .state import ServerState
from .tools import parse_tools
from .translate import (chat_prompt, check_slot, continuation, grammar_of, native_inputs, request_params,
                        spec_overrides, template_kwargs)

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index(st: ServerState = Depends(server_state)):
    """The chat page (``static/index.html``); 404 with ``--no-ui``."""
    if not st.cfg.ui:
        raise APIError(404, "the web UI is disabled (--no-ui)")
    return HTMLResponse(resources.files("gemmaspec.server").joinpath("static/index.html").read_text("utf-8"))


_STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".html": "text/html; charset=utf-8"}


@functools.lru_cache(maxsize=1)
def static_files() -> dict:
    """The chat page's files (``static/``, its vendored libraries and their licences), by path relative
    to it (``vendor/marked.esm.js``): only these are served, so no request path reaches another file."""
    out, todo = {}, [("", resources.files("gemmaspec.server").joinpath("static"))]
    while todo:
        prefix, folder = todo.pop()
        for f in folder.iterdir():
            if f.is_dir():
                todo.append((f"{prefix}{f.name}/", f))
            elif not f.name.startswith("."):
                out[prefix + f.name] = f
    return out


@router.get("/static/{name:path}", include_in_schema=False)
async def static(name: str, st: ServerState = Depends(server_state)):
    """A file of the chat page (scripts, styles, vendored libraries and their licences, as text);
    404 for any other name and with ``--no-ui``."""
    f = static_files().get(name) if st.cfg.ui else None
    if f is None:
        raise APIError(404, f"no such file: /static/{name}")
    kind = next((t for ext, t in _STATIC_TYPES.items() if name.endswith(ext)), "text/plain; charset=utf-8")
    return Response(f.read_bytes(), media_type=kind, headers={"Cache-Control": "no-cache"})


@router.get("/health")
@router.get("/v1/health")
async def health(st: ServerState = Depends(loaded)):
    """``{"status": "ok"}`` once the model has loaded (503 before, as llama-server)."""
    return {"status": "ok"}


@router.get("/props")
async def props(st: ServerState = Depends(loaded)):
    """llama-server's server properties: default generation settings, slots, model, template, speculation;
    and gemmaspec's ``is_base_model`` (the model's file has no chat template: a base model, which
    continues text rather than answering) and ``model_has_chat_template``."""
    e, m, cfg = st.engine, st.model, st.cfg
    return {
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": e.ctx_size,
                                        "speculative": m.spec_type != "none", "is_processing": False,
                                        "params": generation_settings(st), "prompt": "",
                                        "next_token": [{"has_next_token": True, "has_new_line": False,
                                                        "n_remain": -1, "n_decoded": 0}]},
        "total_slots": cfg.n_slots, "model_path": str(m.path), "chat_template": e.tokenizer.chat_template,
        "chat_template_caps": {}, "modalities": {"vision": m.vision is not None, "audio": False}, "build_info": fingerprint(),
        "model": m.model_id, "n_ctx": e.ctx_size, "batched_forward": st.scheduler.batched,
        "is_base_model": is_base(e.tokenizer), "model_has_chat_template": not is_base(e.tokenizer),
        "speculative": {"type": m.spec_type, "n_max": cfg.spec.n_max, "n_min": cfg.spec.n_min, "p_min": m.p_min,
                        "ngram_size": cfg.spec.ngram_size, "ngram_min": cfg.spec.ngram_min,
                        "draft_model": m.draft_file, "n_chosen": cfg.choose_n},
    }


@router.get("/slots")
async def slots(request: Request, st: ServerState = Depends(loaded)):
    """llama-server's slot list; 501 with ``--no-slots``, 503 with ``?fail_on_no_slot=1`` when all are busy."""
    if not st.cfg.slots_endpoint:
        raise APIError(501, "This server does not support slots endpoint (started with --no-slots)",
                       "not_supported_error")
    out = [{"speculative": st.model.spec_type != "none", **s}
           for s in st.scheduler.slots_info(lambda job, last: slot_fields(st, job, last))]
    if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in out):
        raise APIError(503, "no slot available", "unavailable_error")  # llama-server's ?fail_on_no_slot=1
    return out


@router.post("/slots/{id_slot}")
async def slot_action(id_slot: str, request: Request, st: ServerState = Depends(server_state)):
    """``?action=save|restore|erase`` on slot ``id_slot`` (files in ``--slot-save-path``; 501 without it,
    400 for a bad slot, action or file name, 503 while loading)."""
    cfg = st.cfg
    if not cfg.slot_save_path:
        raise APIError(501, "This server does not support slots action: start it with --slot-save-path DIR",
                       "not_supported_error")
    st.require_model()
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
            name = slot_files.check_filename(body.get("filename"))
            op = slot_files.save if action == "save" else slot_files.restore
            fn = lambda s: op(s, cfg.slot_save_path, name, st.model.path.name)  # noqa: E731
        return await asyncio.wrap_future(st.scheduler.slot_action(int(id_slot), fn))
    except GemmaspecError as exc:
        raise APIError(400, str(exc)) from None
    except RuntimeError as exc:
        raise APIError(503, str(exc)) from None


@router.get("/metrics")
async def prometheus(st: ServerState = Depends(server_state)):
    """Prometheus metrics (501 with ``--no-metrics``), with llama-server's ``Process-Start-Time-Unix``."""
    if not st.cfg.metrics_endpoint:
        raise APIError(501, "This server does not support metrics endpoint (started with --no-metrics)",
                       "not_supported_error")
    resp = Response(st.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
    # llama-server's header, spelled as it spells it (clients that read headers into a plain dict
    # look it up by that spelling; Starlette would lower-case it)
    resp.raw_headers.append((b"Process-Start-Time-Unix", str(st.started).encode()))
    return resp


# -- tokens and templates --------------------------------------------------------------------------------
@router.post("/tokenize")
async def tokenize(request: Request, st: ServerState = Depends(loaded)):
    """Text → token ids (``with_pieces``: with their text), as llama-server's ``/tokenize``:
    ``add_special`` adds BOS only where the model's vocabulary adds it (llama.cpp's
    ``llama_vocab::impl::tokenize``: ``add_special && add_bos``), and never a second one."""
    body = await json_body(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise APIError(400, "missing required field 'content' (the text to tokenize)")
    tok = st.engine.tokenizer
    add_bos = None if body.get("add_special", False) else False  # None: the tokenizer's own setting
    ids = tok.encode(content, add_bos=add_bos) if body.get("parse_special", True) \
        else tok.encode_text(content, add_bos=add_bos)
    if not body.get("with_pieces", False):
        return {"tokens": ids}
    text_of = TokenText(tok)
    out = []
    for t in ids:
        s, b = text_of(t)
        out.append({"id": t, "piece": s if not s.startswith("bytes:") else list(b)})
    return {"tokens": out}


@router.post("/detokenize")
async def detokenize(request: Request, st: ServerState = Depends(loaded)):
    """Token ids → text; 400 for ids that are not in the vocabulary."""
    body = await json_body(request)
    ids = body.get("tokens", [])
    vocab = st.engine.tokenizer.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise APIError(400, "'tokens' must be a list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return {"content": st.engine.tokenizer.decode(ids)}


@router.post("/apply-template")
async def apply_template(request: Request, st: ServerState = Depends(loaded)):
    """A chat request's prompt as the chat template renders it, without generating."""
    body = await json_body(request)
    req = validate(ChatRequest, body)
    messages = chat_prompt(req, parse_tools(body))
    agp, cont = continuation(req)
    try:
        return {"prompt": st.engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=agp, continue_final=cont, template_kwargs=template_kwargs(req))}
    except GemmaspecError as exc:
        raise APIError(400, str(exc)) from None


# -- generation ------------------------------------------------------------------------------------------
@router.post("/completion")
@router.post("/completions")
async def native_completion(request: Request, st: ServerState = Depends(loaded)):
    """llama-server's ``/completion``: one prompt, or several (an array of results, or one stream
    whose events carry their prompt's ``index``)."""
    body = await json_body(request)
    refuse_unsupported(body, native=True)
    req = validate(NativeCompletionRequest, body)
    e, model_id = st.engine, st.model.model_id
    params = request_params(req, st.cfg, e, -1)
    vision = st.model.vision
    inputs = native_inputs(req.prompt, e) if vision is None else \
        await asyncio.to_thread(native_inputs, req.prompt, e, vision)  # images: encoded off the event loop
    prompts, images = [ids for ids, _ in inputs], [spans for _, spans in inputs]
    if body.get("n_probs") is None and req.logprobs is not None:  # llama-server's alias
        req.n_probs = req.logprobs
    if not 0 <= req.n_probs <= 20:
        raise APIError(400, f"n_probs must be in 0..20 (got {req.n_probs})")
    check_slot(req.id_slot, st.cfg.n_slots)
    n_max, n_min, p_min = spec_overrides(req, st.cfg)
    grammar = grammar_of(body)
    if req.post_sampling_probs and grammar is not None:
        raise APIError(400, f"post_sampling_probs cannot be combined with '{grammar.field}'")
    settings = {**generation_settings(st, params, n_max, n_min, p_min), "n_probs": req.n_probs, "n_ctx": e.ctx_size,
                "model": model_id, "post_sampling_probs": req.post_sampling_probs,
                "timings_per_token": req.timings_per_token}
    fmts = [NativeFormatter(model_id, e.tokenizer, req.n_probs, req.return_tokens, settings,
                            e.tokenizer.decode(ids), timings_per_token=req.timings_per_token,
                            response_fields=req.response_fields, provenance=req.return_provenance)
            for ids in prompts]
    n_probs = req.n_probs if req.n_probs else None
    if len(prompts) == 1:
        return await jobs.generate(st, request, req, "completion", prompts[0], params, n_probs, fmts[0],
                                   want_slot=req.id_slot, grammar=grammar, images=images[0])
    return await jobs.generate_prompts(st, request, req, prompts, params, n_probs, fmts, grammar, images)


@router.post("/infill")
async def infill(request: Request, st: ServerState = Depends(loaded)):
    """llama-server's fill-in-the-middle endpoint. The request is checked as llama-server checks it
    (``input_prefix`` / ``input_suffix`` / ``prompt`` strings, ``input_extra`` a list of
    ``{"filename": string, "text": string}``: 400 otherwise); then, as llama-server does for a
    model whose vocabulary has no FIM prefix / suffix / middle tokens, a 501: Gemma 3 and Gemma 4
    have none (their vocabulary spells ``<|fim_prefix|>`` as six ordinary tokens)."""
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
