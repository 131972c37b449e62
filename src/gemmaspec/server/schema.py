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
import re
import time

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import GemmaspecError
from ..sampling import SamplingParams
from ..seeds import llama_seed
from ..speculative.options import parse_n_max
from .apierror import APIError  # noqa: F401 (re-exported: the server's error type)
from .scheduler import Job

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


# -- request bodies ----------------------------------------------------------------------------------
MAX_STOP_STRINGS = 64
"""Most stop strings a request may give."""
MAX_STOP_CHARS = 1024
"""Longest stop string, in characters (checking a token costs at most its own characters, see
:class:`~gemmaspec.streaming.StopStrings`, which builds nothing up front; the limits bound the request's size)."""
MAX_MESSAGES = 4096
"""Most messages a chat request may carry."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects in a request body."""


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    n_predict: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float | bool] | list[list] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True
    timings_per_token: bool = False  # llama-server's: timings in every streamed chunk
    return_progress: bool = False  # llama-server's: prompt-processing progress events in a stream
    verbose: bool = False  # llama-server's: the native result under "__verbose" (OpenAI endpoints)
    id_slot: int = -1  # llama-server's: run in this slot (-1: any)
    n_keep: int | None = None  # llama-server's: prompt tokens kept by a context shift (-1: all; default --keep)
    n_discard: int = 0  # llama-server's: tokens dropped per context shift (0: half)


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # OpenAI's four forms
    logprobs: int | None = None


class NativeCompletionRequest(GenerationRequest):
    """llama-server's ``POST /completion``."""

    prompt: str | dict | list[int | str | dict | list[int | str]]
    n_probs: int = 0
    logprobs: int | None = None  # llama-server's alias of n_probs (read when n_probs is not given)
    post_sampling_probs: bool = False
    response_fields: list[str] | None = None
    return_tokens: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict | None = None  # more template variables (llama-server's, vLLM's)


# Fields that change what a client gets and that gemmaspec does not implement: refused with a 400 that
# names them, never accepted and ignored. Each maps to a predicate on the value: True = refuse.
def _set(v) -> bool:
    return v not in (None, False, "", [], {})


def _below(limit):
    """Refuse a value that is not a number below ``limit`` (a sampler on at ``limit`` and above)."""
    return lambda v: v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v < limit)


UNSUPPORTED = {
    "tools": (_set, "tool calls are supported on /v1/chat/completions only"),
    "functions": (_set, "function calling is not supported"),
    "tool_choice": (lambda v: v not in (None, "none", "auto"), "tool calls are supported on /v1/chat/completions only"),
    "function_call": (lambda v: v not in (None, "none", "auto"), "function calling is not supported"),
    "echo": (_set, "echoing the prompt is not supported"),
    "suffix": (_set, "insertion (suffix) is not supported"),
    "best_of": (lambda v: v not in (None, 1), "only best_of = 1 is supported"),
    "mirostat": (lambda v: v not in (None, 0), "mirostat sampling is not supported"),
    "dry_multiplier": (lambda v: v not in (None, 0, 0.0), "DRY sampling is not supported"),
    "xtc_probability": (lambda v: v not in (None, 0, 0.0), "XTC sampling is not supported"),
    "typical_p": (lambda v: v not in (None, 1, 1.0), "typical-p sampling is not supported"),
    "dynatemp_range": (lambda v: v not in (None, 0, 0.0), "dynamic temperature is not supported"),
    "samplers": (_set, "a custom sampler order is not supported (the order is llama.cpp's default)"),
    "n_probs": (lambda v: v not in (None, 0), "n_probs belongs to /completion; use logprobs here"),
    "post_sampling_probs": (_set, "post_sampling_probs belongs to /completion (with n_probs); logprobs here are the "
                                  "model's"),
    "top_n_sigma": (_below(0), "top-n-sigma sampling is not supported (a negative value turns it off)"),
    "min_keep": (lambda v: v not in (None, 0, 1), "min_keep is not supported (the filters keep at least one token)"),
    "n_indent": (lambda v: v not in (None, 0), "n_indent (stopping on indentation) is not supported"),
    "t_max_predict_ms": (_below(1), "t_max_predict_ms (a time limit) is not supported; use max_tokens"),
    "adaptive_target": (_below(0), "adaptive sampling is not supported (a negative value turns it off)"),
    "n_cmpl": (lambda v: v not in (None, 1), "n_cmpl is not supported: use n on /v1/completions or "
                                             "/v1/chat/completions, or several prompts on /completion"),
    "grammar_lazy": (_set, "lazy grammars (grammar_triggers) are not supported: the grammar applies from "
                           "the first token"),
    "grammar_triggers": (_set, "lazy grammars (grammar_triggers) are not supported"),
    "tfs_z": (lambda v: v not in (None, 1, 1.0), "tail-free sampling is not supported"),
    "top_a": (lambda v: v not in (None, 0, 0.0), "top-a sampling is not supported"),
    "repetition_penalty": (lambda v: v not in (None, 1, 1.0), "vLLM's repetition_penalty is not supported: use "
                                                              "repeat_penalty (llama.cpp's, over repeat_last_n tokens)"),
    "min_tokens": (lambda v: v not in (None, 0), "min_tokens is not supported"),
    "stop_token_ids": (_set, "stop_token_ids is not supported: use stop strings, or logit_bias to ban tokens"),
    "include_stop_str_in_output": (_set, "include_stop_str_in_output is not supported (stop strings are never "
                                         "part of the output, as in llama-server)"),
    "use_beam_search": (_set, "beam search is not supported"),
    "length_penalty": (lambda v: v not in (None, 1, 1.0), "length_penalty (beam search) is not supported"),
    "prompt_logprobs": (_set, "prompt log-probabilities are not supported"),
    "guided_json": (_set, "vLLM's guided decoding is not supported here: use json_schema or response_format"),
    "guided_regex": (_set, "vLLM's guided decoding is not supported here: use grammar (GBNF)"),
    "guided_choice": (_set, "vLLM's guided decoding is not supported here: use grammar (GBNF)"),
    "guided_grammar": (_set, "vLLM's guided decoding is not supported here: use grammar (GBNF)"),
    "structured_outputs": (_set, "vLLM's structured_outputs is not supported here: use response_format, "
                                 "json_schema or grammar"),
    "web_search_options": (_set, "web search is not supported"),
    "lora": (_set, "LoRA adapters are not supported"),
    "audio": (_set, "audio output is not supported"),
    "modalities": (lambda v: v not in (None, ["text"]), "only text output is supported"),
}
NATIVE_OK = {"n_probs", "post_sampling_probs"}  # fields /completion implements
CHAT_OK = {"tools", "tool_choice"}  # fields chat implements (server/tools.py)


def refuse_unsupported(body: dict, native: bool = False, chat: bool = False) -> None:
    """Raise a 400 naming the first field of ``body`` that would change the output but is not implemented."""
    for name, (bad, why) in UNSUPPORTED.items():
        if native and name in NATIVE_OK or chat and name in CHAT_OK:
            continue
        if name in body and bad(body[name]):
            raise APIError(400, f"'{name}' is not supported by gemmaspec: {why} (drop the field)")


def _has_bool(v, depth: int = 0) -> bool:
    return isinstance(v, bool) or depth < 3 and isinstance(v, list) and any(_has_bool(x, depth + 1) for x in v)


def validate(model_cls, body: dict):
    """The request body as ``model_cls``; a field given as ``null`` counts as left out (OpenAI's
    fields are nullable, and llama-server treats null as absent), so it takes its default.

    Raises:
        APIError: 400 naming the first missing or invalid field.
    """
    if _has_bool(body.get("prompt")):  # pydantic would read true as token id 1
        raise APIError(400, "invalid value for 'prompt': true and false are not token ids")
    try:
        return model_cls.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"][:1]) or "body"
        detail = ".".join(str(p) for p in err["loc"])
        if err["type"] == "missing":
            raise APIError(400, f"missing required field '{detail}'") from None
        raise APIError(400, f"invalid value for '{field}' ({detail}: {err['msg']})") from None



def _depth_ok(obj, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            if d > limit:
                return False
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return True


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(obj) -> str | None:
    """Where in ``obj`` a string (or key) holds a lone surrogate (`` at 'a.b'``), or None."""
    stack = [(obj, "")]
    while stack:
        o, path = stack.pop()
        if isinstance(o, str):
            if _SURROGATE.search(o):
                return f" at '{path.lstrip('.')}'" if path else ""
        elif isinstance(o, dict):
            for k, v in o.items():
                if _SURROGATE.search(k):
                    return f" (a key) at '{path.lstrip('.')}'" if path else " (a key)"
                stack.append((v, f"{path}.{k}"))
        elif isinstance(o, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(o))
    return None


async def json_body(request: Request) -> dict:
    """The request body as a JSON object.

    Raises:
        APIError: 400 for a body that is not JSON, not an object, nested deeper than ``MAX_JSON_DEPTH``,
            or holding a lone surrogate (``"\\ud800"``: Python reads it, no tokenizer or encoder can).
    """
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:
        body = None
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})") from None
    if body is None and raw.strip() != b"null" or not _depth_ok(body, MAX_JSON_DEPTH):
        raise APIError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels of arrays "
                            "and objects)")
    if _SURROGATE_ESCAPE.search(raw):  # only an escape can carry one: raw UTF-8 cannot
        where = _lone_surrogate(body)
        if where is not None:
            raise APIError(400, f"the request body is not valid Unicode: a string{where} holds a lone UTF-16 "
                                "surrogate (\\ud800-\\udfff escape without its pair)")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


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


def _prompt_object(p, where: str = "prompt"):
    """llama-server's JSON-object prompt ``{"prompt_string": "text"}`` → its text (or mix); images
    (``multimodal_data``) are refused by name."""
    if not isinstance(p, dict):
        return p
    if p.get("multimodal_data"):
        raise APIError(400, f"{where}.multimodal_data: images are not supported by gemmaspec (a text-only model)")
    text = p.get("prompt_string")
    if not (isinstance(text, str) or isinstance(text, list) and text
            and all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in text)):
        raise APIError(400, f"{where}: a prompt object needs 'prompt_string' (the prompt's text)")
    return text


def native_prompts(prompt, engine) -> list[list[int]]:
    """The prompts of a ``/completion`` request, as llama-server reads ``prompt``: text, token ids or a
    mix of both is one prompt, and so is a JSON object ``{"prompt_string": ...}`` holding one; a list
    of texts (or such objects), or a list of such lists, is several (answered with an array of
    results, in order).

    Raises:
        APIError: 400 for an empty list, an empty prompt, an id outside the vocabulary, or a prompt
            object without ``prompt_string`` or with images (``multimodal_data``).
    """
    if isinstance(prompt, list) and not prompt:
        raise APIError(400, "the prompt is empty")
    prompt = _prompt_object(prompt)
    if isinstance(prompt, list) and any(isinstance(p, dict) for p in prompt):  # objects among several prompts
        if any(isinstance(p, int) for p in prompt):
            raise APIError(400, "prompt: a prompt object can only stand among other prompts, not among token ids")
        prompt = [_prompt_object(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if len(prompt) == 1:
            prompt = prompt[0]
        elif all(isinstance(p, str) for p in prompt):
            pass
        else:
            prompt = [p if isinstance(p, list) else [p] for p in prompt]
    several = isinstance(prompt, list) and (all(isinstance(p, str) for p in prompt) and len(prompt) > 1
                                             or any(isinstance(p, list) for p in prompt))
    if not several:
        return [completion_prompt(prompt, engine)]
    if not all(isinstance(p, str) or isinstance(p, list) and all(isinstance(x, (int, str)) for x in p) for p in prompt):
        raise APIError(400, "prompt: a list of prompts holds only texts or lists (of token ids and texts)")
    return [completion_prompt(p, engine) for p in prompt]


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
    out_max = cfg.n_max if n_max is None else n_max
    out_min = cfg.n_min if n_min is None else n_min
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


def chat_messages(req: ChatRequest) -> list[dict]:
    """The chat template's messages from a chat request: roles checked (``developer`` becomes
    ``system``), text content parts joined. ``tool`` messages and assistant ``tool_calls`` pass
    through here as they are; :func:`gemmaspec.server.tools.render_history` turns them into text.

    Raises:
        APIError: 400 for an unknown role, a missing content, or a non-text content part.
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
                if part.get("type") != "text":
                    kind = part.get("type") or "untyped"
                    raise APIError(400, f"messages[{i}].content[{j}]: '{kind}' parts are not supported by gemmaspec "
                                        "(a text-only model): only text content parts")
                parts.append(part["text"])
            content = "".join(parts)
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return messages


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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


class Formatter:
    """Builds OpenAI response objects (whole or streamed chunks) for one request.

    ``include_usage``: ``stream_options.include_usage`` (True: usage in a last chunk with no choices
    and ``usage: null`` in the others; False: no usage at all; None, not given: usage in the chunk
    with the finish reason, as llama-server does). ``tools``: the chat request's
    :class:`~gemmaspec.server.tools.ToolSpec` when it may call tools (replies that are calls become
    ``tool_calls`` with ``finish_reason: "tool_calls"``). ``timings_per_token``: ``timings`` (so far)
    in every streamed chunk, not only the last. ``verbose``: a :class:`NativeFormatter` whose result
    (llama-server's ``/completion`` object, with the rendered ``prompt``) goes under ``__verbose``, in
    the whole response or the first of the finishing chunks, as llama-server does with ``--verbose``."""

    def __init__(self, kind: str, rid: str, model: str, tokenizer, logprobs: int | None,
                 include_usage: bool | None = None, tools=None, timings_per_token: bool = False,
                 verbose: "NativeFormatter | None" = None, index: int = 0):
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
        lp = self._lp([ev]) if ev.tokens else None
        self.offset += len(ev.text)
        self.text.append(ev.text)
        self.n_sent += len(ev.tokens)
        extra = {"timings": _timings(job, self.n_sent)} if self.timings_per_token and job is not None else {}
        return self.chunk({"content": ev.text} if self.kind == "chat" else ev.text, None, lp, **extra)

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
    every streamed event."""

    def __init__(self, model: str, tokenizer, n_probs: int, return_tokens: bool, settings: dict, prompt: str,
                 timings_per_token: bool = False, response_fields: list[str] | None = None):
        self.model, self.n_probs, self.return_tokens = model, n_probs, return_tokens
        self.text_of = TokenText(tokenizer)
        self.settings, self.prompt = settings, prompt
        self.timings_per_token = timings_per_token
        self.response_fields = response_fields or None
        self.n_sent = 0  # tokens streamed so far

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
        out = {"index": 0, "content": ev.text, "tokens": list(ev.tokens), "stop": False, "id_slot": job.slot,
               "tokens_predicted": job.stats.generated_tokens, "tokens_evaluated": job.stats.prompt_tokens}
        self.n_sent += len(ev.tokens)
        if self.timings_per_token:
            out["timings"] = _timings(job, self.n_sent)
        if self.n_probs:
            out["completion_probabilities"] = self._probs([ev])
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
    """OpenAI's ``usage`` for the choices of one request (n > 1: each prompt counted once; the choices
    of one prompt share its id list)."""
    prompt = sum({id(j.prompt_ids): j.stats.prompt_tokens for j in jobs}.values())
    done = sum(j.stats.generated_tokens for j in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


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
    return {
        "prompt_n": pn, "prompt_ms": st.prefill_ms,
        "prompt_per_token_ms": st.prefill_ms / pn if pn else 0.0, "prompt_per_second": st.prefill_tps,
        "predicted_n": gn, "predicted_ms": decode_ms,
        "predicted_per_token_ms": decode_ms / (gn - 1) if gn > 1 else 0.0,
        "predicted_per_second": (gn - 1) / (decode_ms / 1e3) if gn > 1 and decode_ms > 0 else 0.0,
        "cache_n": job.cache_n, "draft_n": st.spec.drafted, "draft_n_accepted": st.spec.accepted,
        "ttft_ms": job.ttft_ms,
    }
