"""A request's meaning for the engine: sampling settings, prompt token ids, the output constraint,
per-request speculation settings and the chat template's messages.

Every function here is pure (no server state): it reads a validated request (:mod:`.parse`) and
the tokenizer, and raises :class:`~gemmaspec.server.apierror.APIError` (400, naming the field) for a
value the engine cannot run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import GemmaspecError
from ..multimodal import MARK, chat_image_ids, marked_prompt
from ..sampling import SamplingParams
from ..seeds import llama_seed
from ..speculative.options import parse_n_max
from .apierror import APIError
from .images import (IMAGE_PARTS, MEDIA_MARKER, image_bytes, media_data, no_projector, prepare_images,
                     refused_part)
from .parse import MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_STRINGS, ChatRequest, GenerationRequest
from .tools import parse_tools, render_history, with_tools_prompt


def _logit_bias(value, vocab: int, tokenizer) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` or llama-server's ``[[id or text, bias or false], ...]`` →
    ``((id, bias), ...)``; -100 or less, and ``false``, ban the token (bias -inf); a key that is text
    (``{"Hello": 5}`` or ``[["Hello", 5]]``, as llama-server takes both) stands for each of its tokens
    (tokenized as text: no special tokens)."""
    if value is None:
        return ()
    pairs = list(value.items()) if isinstance(value, dict) else value
    out: dict[int, float] = {}
    for pair in pairs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise APIError(400, "logit_bias must be {\"token id\": bias} or [[token, bias], ...]")
        key, bias = pair
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise APIError(400, f"logit_bias values must be numbers (got {bias!r} for {key!r})")
        elif bias <= -100:
            bias = -math.inf
        if isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str) and key.lstrip("-").isdigit():
            ids = [int(key)]
        elif isinstance(key, str) and key and tokenizer is not None:
            ids = tokenizer.encode_text(key, add_bos=False)  # as llama-server: no special tokens
        else:
            raise APIError(400, f"logit_bias key {key!r} is not a token id")
        for t in ids:
            if not 0 <= t < vocab:
                raise APIError(400, f"logit_bias token id {t} is outside the vocabulary (0..{vocab - 1})")
            out[t] = float(bias)
    return tuple(out.items())


MAX_CHOICES = 16
"""Most choices (``n``) an OpenAI request may ask for."""


def token_limit(req: GenerationRequest) -> tuple[str, int | None]:
    """``(field, value)`` of the request's token limit, as llama-server reads it: ``n_predict``, else
    ``max_completion_tokens`` (chat), else ``max_tokens``; ``(..., None)`` when none is given."""
    for name in ("n_predict", "max_completion_tokens", "max_tokens"):
        v = getattr(req, name, None)
        if v is not None:
            return name, v
    return "max_tokens", None


def sampling_params(req: GenerationRequest, ctx: int | None, default_max: int,
                    defaults: SamplingParams | None = None, tokenizer=None, max_n: int = 1) -> SamplingParams:
    """The request's :class:`SamplingParams`; unset fields take the server's defaults (``--temp``,
    ``--seed``, ``-n``...). ``seed`` may be any integer: it wraps to 32 bits as llama-server reads it
    (:func:`~gemmaspec.seeds.llama_seed`: -2 is seed 4294967294, -1 and 4294967295 a random one).
    The token limit is :func:`token_limit`'s: -1 means until a stop or a full context, 0 runs the
    prompt only (into the slot's cache; llama-server's ``n_predict: 0``); a limit above the context
    is accepted and generation ends at the context, as llama-server does. ``top_k`` 0 or below turns
    top-k off (llama.cpp's sampler skips k <= 0); ``repeat_last_n`` -1 covers the context size
    ``ctx`` (llama-server's n_ctx; None: the whole history). ``max_n``: the most choices (``n``) the
    endpoint takes.

    Raises:
        APIError: 400 naming the bad field.
    """
    if req.n != 1 and not (1 <= req.n <= max_n):
        raise APIError(400, f"n must be in 1..{max_n} (got {req.n})" if max_n > 1 else
                       f"only n = 1 is supported here (got {req.n})")
    d = defaults or SamplingParams()
    name, max_tokens = token_limit(req)
    if max_tokens is None:
        max_tokens = default_max
    elif max_tokens < -1:
        raise APIError(400, f"{name} must be at least 0, or -1 for no limit (got {max_tokens})")
    # a limit above the context is accepted, as llama-server does: generation ends at the context
    # (finish_reason "length", truncated), as with -1
    temp = d.temperature if req.temperature is None else req.temperature
    if not (math.isfinite(temp) and 0 <= temp <= 2):
        raise APIError(400, f"temperature must be between 0 and 2 (got {temp})")
    top_p = d.top_p if req.top_p is None else req.top_p
    if not (math.isfinite(top_p) and 0 <= top_p <= 1):  # 0 keeps the most likely token, as llama.cpp and OpenAI
        raise APIError(400, f"top_p must be between 0 and 1 (got {top_p})")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not (math.isfinite(v) and -2 <= v <= 2):
            raise APIError(400, f"{name} must be between -2 and 2 (got {v})")
    for name, ok, rule in (("min_p", lambda v: 0 <= v <= 1, "between 0 and 1 (0 disables it)"),
                           ("repeat_penalty", lambda v: math.isfinite(v) and v > 0, "> 0 (1 disables it)"),
                           ("repeat_last_n", lambda v: v >= -1, ">= 0 (0 disables it), or -1 for the whole context")):
        v = getattr(req, name)  # named as the request spells it (the library's messages use the flags')
        if v is not None and not ok(v):
            raise APIError(400, f"{name} must be {rule} (got {v})")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"too many stop strings: {len(stop)} (at most {MAX_STOP_STRINGS})")
    long = [s for s in stop if len(s) > MAX_STOP_CHARS]
    if long:
        raise APIError(400, f"a stop string is {len(long[0])} characters long (at most {MAX_STOP_CHARS})")
    vocab = tokenizer.vocab_size if tokenizer is not None else 1 << 30
    top_k = d.top_k if req.top_k is None else max(req.top_k, 0)  # llama.cpp's top-k is off at k <= 0
    last_n = d.repeat_last_n if req.repeat_last_n is None else req.repeat_last_n
    if last_n == -1:  # llama-server's: the context size
        last_n = ctx if ctx is not None else 1 << 31
    try:
        return SamplingParams(
            temperature=temp, top_p=top_p, top_k=top_k,
            min_p=d.min_p if req.min_p is None else req.min_p,
            repeat_penalty=d.repeat_penalty if req.repeat_penalty is None else req.repeat_penalty,
            repeat_last_n=last_n,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=_logit_bias(req.logit_bias, vocab, tokenizer),
            max_tokens=max_tokens, seed=d.seed if req.seed is None else llama_seed(req.seed),
            stop=tuple(s for s in stop if s), ignore_eos=req.ignore_eos).validate()
    except GemmaspecError as exc:
        raise APIError(400, str(exc)) from None


def completion_prompt(prompt, engine) -> list[int]:
    """Token ids of a completion prompt: text (special-token spellings such as ``<start_of_turn>``
    become those tokens, as in llama-server; BOS added when the model wants one and the text does not
    start with it), token ids (used as given), or llama-server's mix of both (BOS added when the first
    element is text). A list of one prompt (OpenAI's ``["text"]`` or ``[[ids]]``) is that prompt.

    Raises:
        APIError: 400 for several prompts, an id outside the vocabulary, or an empty prompt.
    """
    tok = engine.tokenizer
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request is supported (got {len(prompt)})")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tok.encode(prompt)
    else:
        vocab = tok.vocab_size
        bad = [t for t in prompt if isinstance(t, int) and not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        ids = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                ids.extend(tok.encode(p, add_bos=None if i == 0 else False))
            else:
                ids.append(p)
    if not ids:
        raise APIError(400, "the prompt is empty")
    return ids


def completion_prompts(prompt, engine) -> list[list[int]]:
    """The prompts of a ``/v1/completions`` request: OpenAI's list of several texts or of several
    token-id lists is several prompts; anything else is one (:func:`completion_prompt`)."""
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return [completion_prompt(p, engine) for p in prompt]
    return [completion_prompt(prompt, engine)]


def grammar_of(body: dict):
    """The constraint a request asks for, compiled: OpenAI's ``response_format`` (``json_object``,
    optionally with llama-server's ``schema``; ``json_schema`` with ``json_schema.schema``),
    llama-server's ``json_schema`` (a schema) or ``grammar`` (GBNF text); None when none is given.

    Raises:
        APIError: 400 naming the field and the reason (an unknown type, a schema or grammar that
            does not compile, more than one of them).
    """
    from ..grammar import GrammarError, gbnf_grammar, json_schema_grammar

    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise APIError(400, f"invalid 'response_format': an object with a 'type' (got {type(rf).__name__})")
        if rf.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(400, f"invalid 'response_format': type must be text, json_object or json_schema "
                                f"(got {rf.get('type')!r})")
        if rf["type"] == "text":
            rf = None
    given = (["response_format"] if rf else []) + [k for k in ("json_schema", "grammar") if body.get(k) not in (None, "")]
    if len(given) > 1:
        raise APIError(400, f"give one of 'response_format', 'json_schema' and 'grammar' (got {', '.join(given)})")
    if not given:
        return None
    field = given[0]
    try:
        if field == "grammar":
            return gbnf_grammar(body["grammar"], "grammar")
        if field == "json_schema":  # an empty schema means any object, as llama-server reads it
            return json_schema_grammar(body["json_schema"] or {"type": "object"}, "json_schema")
        if rf["type"] == "json_object":
            return json_schema_grammar(rf.get("schema") or {"type": "object"}, "response_format")
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if schema is None:
            schema = rf.get("schema")  # llama-server also reads response_format.schema
        if schema is None:
            raise APIError(400, "invalid 'response_format': type json_schema needs json_schema.schema "
                                "(the JSON schema the reply must follow)")
        return json_schema_grammar(schema or {"type": "object"}, "response_format")
    except GrammarError as exc:
        raise APIError(400, str(exc)) from None


@dataclass(frozen=True)
class MediaPrompt:
    """llama-server's prompt object with images: ``{"prompt_string": text, "multimodal_data": [base64]}``,
    each image standing at a :data:`~gemmaspec.server.images.MEDIA_MARKER` of the text."""

    text: str
    images: list  # (where, bytes) pairs
    where: str


def _prompt_object(p, where: str = "prompt", vision: bool = False):
    """llama-server's JSON-object prompt ``{"prompt_string": "text"}`` → its text (or mix); with a
    non-empty ``multimodal_data`` a :class:`MediaPrompt` (400 without a vision tower, ``vision``)."""
    if not isinstance(p, dict):
        return p
    text = p.get("prompt_string")
    if not (isinstance(text, str) or isinstance(text, list) and text
            and all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in text)):
        raise APIError(400, f"{where}: a prompt object needs 'prompt_string' (the prompt's text)")
    if p.get("multimodal_data") in (None, []):
        return text
    if not vision:
        raise no_projector(f"{where}.multimodal_data")
    if not isinstance(text, str):
        raise APIError(400, f"{where}.prompt_string must be text when the object has multimodal_data "
                            f"(with a {MEDIA_MARKER} marker where each image goes)")
    return MediaPrompt(text, media_data(p["multimodal_data"], f"{where}.multimodal_data"), where)


def native_prompts(prompt, engine) -> list[list[int]]:
    """The token ids of :func:`native_inputs` without a vision tower (text prompts only)."""
    return [ids for ids, _ in native_inputs(prompt, engine)]


def native_inputs(prompt, engine, vision=None) -> list[tuple[list[int], list]]:
    """The prompts of a ``/completion`` request, as llama-server reads ``prompt``: text, token ids or a
    mix of both is one prompt, and so is a JSON object ``{"prompt_string": ...}`` holding one (with
    ``multimodal_data``: images at its ``<__media__>`` markers, for ``vision``, the loaded tower); a
    list of texts (or such objects), or a list of such lists, is several (answered with an array of
    results, in order). Each as ``(ids, image spans)``. Encoding images takes a while: with images,
    call it off the event loop.

    Raises:
        APIError: 400 for an empty list, an empty prompt, an id outside the vocabulary, a prompt
            object without ``prompt_string``, or images that cannot be used (no ``--mmproj``,
            marker count, bad base64 or image).
    """
    if isinstance(prompt, list) and not prompt:
        raise APIError(400, "the prompt is empty")
    has = vision is not None
    prompt = _prompt_object(prompt, "prompt", has)
    if isinstance(prompt, list) and any(isinstance(p, dict) for p in prompt):  # objects among several prompts
        if any(isinstance(p, int) for p in prompt):
            raise APIError(400, "prompt: a prompt object can only stand among other prompts, not among token ids")
        prompt = [_prompt_object(p, f"prompt[{i}]", has) for i, p in enumerate(prompt)]
        if len(prompt) == 1:
            prompt = prompt[0]
        elif all(isinstance(p, str) for p in prompt):
            pass
        else:
            prompt = [p if isinstance(p, (list, MediaPrompt)) else [p] for p in prompt]
    several = isinstance(prompt, list) and (all(isinstance(p, str) for p in prompt) and len(prompt) > 1
                                             or any(isinstance(p, (list, MediaPrompt)) for p in prompt))
    if not several:
        return [_native_input(prompt, engine, vision)]
    if not all(isinstance(p, (str, MediaPrompt)) or isinstance(p, list) and all(isinstance(x, (int, str)) for x in p)
               for p in prompt):
        raise APIError(400, "prompt: a list of prompts holds only texts or lists (of token ids and texts)")
    return [_native_input(p, engine, vision) for p in prompt]


def _native_input(p, engine, vision) -> tuple[list[int], list]:
    if not isinstance(p, MediaPrompt):
        return completion_prompt(p, engine), []
    try:
        return marked_prompt(engine.tokenizer, vision.model, p.text, prepare_images(p.images, vision), MEDIA_MARKER)
    except GemmaspecError as exc:
        raise APIError(400, f"{p.where}: {exc}") from None


def has_prompt_object(prompt) -> bool:
    """Whether a ``/v1/completions`` prompt is (or lists) llama-server's prompt objects."""
    return isinstance(prompt, dict) or isinstance(prompt, list) and any(isinstance(p, dict) for p in prompt)


def spec_overrides(req, cfg) -> tuple[int | str, int, float | None]:
    """llama-server's per-request ``speculative.n_max`` / ``speculative.n_min`` / ``speculative.p_min``
    as ``(n_max, n_min, p_min)``: n_max 0 (or below, as llama-server clamps it) turns drafting off for
    the request, n_min is clamped to 0..n_max as llama-server does; p_min (0..1) is the
    draft probability below which a model drafter (``draft-mtp``, ``draft-simple``) stops its round,
    None when the request leaves it to the server (``--spec-draft-p-min``); the server's settings
    otherwise. A drafter without a probability (``ngram-simple``) ignores p_min, as llama-server's does.

    Raises:
        APIError: 400 naming the field for a value of the wrong type or out of range.
    """
    extra = req.model_extra or {}
    n_max, n_min = extra.get("speculative.n_max"), extra.get("speculative.n_min")
    p_min = extra.get("speculative.p_min")
    out_max = cfg.spec.n_max if n_max is None else n_max
    out_min = cfg.spec.n_min if n_min is None else n_min
    if not isinstance(out_max, (int, str)) or isinstance(out_max, bool) or (isinstance(out_max, str) and out_max != "auto"):
        raise APIError(400, f"speculative.n_max must be a number or 'auto' (got {n_max!r})")
    if isinstance(out_max, int) and out_max < 0:  # llama-server's max(n_max, 0): off
        out_max = 0
    try:
        out_max = parse_n_max(out_max, "speculative.n_max")
    except GemmaspecError as exc:
        raise APIError(400, str(exc)) from None
    if not (isinstance(out_min, int) and not isinstance(out_min, bool)):
        raise APIError(400, f"speculative.n_min must be a number (got {n_min!r})")
    out_min = max(out_min, 0) if out_max == "auto" else max(min(out_min, out_max), 0)  # llama-server's clamps
    if p_min is not None and not (isinstance(p_min, (int, float)) and not isinstance(p_min, bool)
                                  and 0.0 <= p_min <= 1.0):
        raise APIError(400, f"speculative.p_min must be a number in [0, 1] (got {p_min!r})")
    return out_max, out_min, None if p_min is None else float(p_min)


def spec_choose(req, cfg) -> bool:
    """Whether a request's draft lengths are chosen per round from measured costs: the server's
    setting (``--spec-draft-n-fixed`` off), unless the request sends gemmaspec's
    ``speculative.n_fixed: true`` (draft ``speculative.n_max`` every round).

    Raises:
        APIError: 400 for a ``speculative.n_fixed`` that is not a boolean.
    """
    fixed = (req.model_extra or {}).get("speculative.n_fixed")
    if fixed is not None and not isinstance(fixed, bool):
        raise APIError(400, f"speculative.n_fixed must be true or false (got {fixed!r})")
    return cfg.choose_n if fixed is None else not fixed


def chat_messages(req: ChatRequest, images: list | None = None, allow_urls: bool = False) -> list[dict]:
    """The chat template's messages from a chat request: roles checked (``developer`` becomes
    ``system``), text content parts joined. ``tool`` messages and assistant ``tool_calls`` pass
    through here as they are; :func:`gemmaspec.server.tools.render_history` turns them into text.
    With ``images`` (a list, when a vision tower is loaded) each ``image_url`` part appends
    ``(where, bytes)`` to it and leaves :data:`gemmaspec.multimodal.MARK` in the content.

    Raises:
        APIError: 400 for an unknown role, a missing content, or a content part that is neither text
            nor (with ``images``) an image; audio parts are refused by name.
    """
    if len(req.messages) > MAX_MESSAGES:
        raise APIError(400, f"too many messages: {len(req.messages)} (at most {MAX_MESSAGES})")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if m.role not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}].role must be system, developer, user, assistant or tool "
                                f"(got {m.role!r})")
        calls = (m.model_extra or {}).get("tool_calls")
        if calls is not None and (m.role != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                for c in calls)):
            raise APIError(400, f"messages[{i}].tool_calls must be an assistant message's list of "
                                "{\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
        if content is None and m.role != "assistant":
            raise APIError(400, f"messages[{i}].content is missing: a {m.role} message needs text")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") == "text" and not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}].text must be a string")
                if part.get("type") in IMAGE_PARTS and images is not None:
                    where = f"messages[{i}].content[{j}]"
                    images.append((where, image_bytes(part, where, allow_urls)))
                    parts.append(MARK)
                    continue
                if part.get("type") != "text":
                    raise refused_part(part.get("type") or "untyped", f"messages[{i}].content[{j}]", images is not None)
                parts.append(part["text"])
            content = "".join(parts)
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return messages


def request_params(req: GenerationRequest, cfg, engine, default_max: int, max_n: int = 1) -> SamplingParams:
    """:func:`sampling_params` with the server's settings: its defaults (``cfg.defaults``), its token
    limit (``-n``, ``cfg.n_predict``; else the endpoint's ``default_max``) and the engine's context.

    Raises:
        APIError: 400 naming the bad field.
    """
    default = cfg.n_predict if cfg.n_predict is not None else default_max
    return sampling_params(req, engine.ctx_size, default_max=default, defaults=cfg.defaults,
                           tokenizer=engine.tokenizer, max_n=max_n)


def check_slot(id_slot: int, n_slots: int) -> None:
    """Raises:
        APIError: 400 unless ``id_slot`` is -1 (any slot) or a slot in ``0..n_slots - 1``."""
    if not -1 <= id_slot < n_slots:
        raise APIError(400, f"id_slot must be -1 (any) or a slot in 0..{n_slots - 1} (got {id_slot})")


def check_context(ids: list[int], n_ctx: int, context_shift: bool) -> None:
    """Raises:
        APIError: 400 (llama-server's ``exceed_context_size_error``) for a prompt of ``n_ctx`` tokens
            or more, unless ``context_shift`` (``--context-shift``: the prompt is cut instead, see
            :class:`~gemmaspec.engine.RequestState`)."""
    if len(ids) >= n_ctx and not context_shift:
        raise APIError(400, f"request ({len(ids)} tokens) exceeds the available context size ({n_ctx} "
                            f"tokens), try increasing it", "exceed_context_size_error",  # llama-server's words
                       n_prompt_tokens=len(ids), n_ctx=n_ctx)


def include_usage(req: GenerationRequest) -> bool | None:
    """``stream_options.include_usage``: None when ``stream_options`` is not given.

    Raises:
        APIError: 400 for ``stream_options`` without ``stream: true``, or a value that is not a bool.
    """
    opts = req.stream_options
    if opts is None:
        return None
    if not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true")
    v = opts.get("include_usage")
    if v is not None and not isinstance(v, bool):
        raise APIError(400, f"stream_options.include_usage must be true or false (got {v!r})")
    return bool(v)


# -- chat ------------------------------------------------------------------------------------------------
def continuation(req: ChatRequest) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final)`` for a chat request, as llama-server decides:
    a final assistant message is continued (prefilled: the reply goes on from its text) unless
    ``continue_final_message: false``; ``continue_final_message: true`` with
    ``add_generation_prompt: true`` is a 400.

    Raises:
        APIError: 400 for two assistant messages at the end, both flags true, a continuation without
            a final assistant message or of one holding ``tool_calls``.
    """
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


TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "date_string",
                          "datetime"})
"""The chat template's own variables, which ``chat_template_kwargs`` cannot set."""


def template_kwargs(req: ChatRequest) -> dict | None:
    """``chat_template_kwargs``: more variables for the chat template, as llama-server and vLLM
    take them; None for none.

    Raises:
        APIError: 400 when they would replace one of :data:`TEMPLATE_OWN`.
    """
    kw = req.chat_template_kwargs
    if kw and TEMPLATE_OWN.intersection(kw):
        raise APIError(400, f"chat_template_kwargs cannot set {', '.join(sorted(TEMPLATE_OWN.intersection(kw)))}")
    return kw or None


def chat_prompt(req: ChatRequest, spec, images: list | None = None, allow_urls: bool = False) -> list[dict]:
    """The template's messages: tool parts of the history as text, the tools (``spec``, a
    :class:`~gemmaspec.server.tools.ToolSpec` or None) in the system turn; ``images`` as in
    :func:`chat_messages`.

    Raises:
        APIError: 400 as :func:`chat_messages`.
    """
    messages = render_history(chat_messages(req, images, allow_urls), req.messages)
    return with_tools_prompt(messages, spec) if spec is not None else messages


def chat_ids(req: ChatRequest, body: dict, tokenizer, vision=None, allow_urls: bool = False
             ) -> tuple[list[int], object, list]:
    """A chat request's prompt ids, its tools (a :class:`~gemmaspec.server.tools.ToolSpec` or
    None) and its images (:class:`~gemmaspec.multimodal.ImageSpan`, encoded by ``vision``, the loaded
    tower or None): rendered with the template, the generation prompt or the continuation of a final
    assistant message as the request says; ``allow_urls`` (``--allow-image-urls``): ``http(s)`` image
    URLs are fetched. Encoding (and fetching) images takes a while: call it off the event loop.

    Raises:
        APIError: 400 for bad messages, tools, images or template variables, or a template that fails.
    """
    spec = parse_tools(body)
    raw = [] if vision is not None else None
    messages = chat_prompt(req, spec, raw, allow_urls)
    agp, cont = continuation(req)
    opts = {"add_generation_prompt": agp, "continue_final": cont, "template_kwargs": template_kwargs(req)}
    try:
        if raw:
            ids, spans = chat_image_ids(tokenizer, vision.model, messages, prepare_images(raw, vision), **opts)
            return ids, spec, spans
        return tokenizer.encode_chat(messages, **opts), spec, []
    except GemmaspecError as exc:
        raise APIError(400, str(exc)) from None
