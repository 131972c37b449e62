"""Request bodies: the OpenAI and llama-server request models, the refusal of fields gemmaspec does
not implement, and reading a body as JSON.

Request bodies are validated here (not by FastAPI) so that every bad input gets an OpenAI-style
error, ``{"error": {"message", "type", "code"}}`` with the HTTP status as ``code`` (llama-server's
convention; :class:`~gemmaspec.server.apierror.APIError`). References: OpenAI's API reference
(completions, chat completions) and llama.cpp ``tools/server/README.md``. What a request asks of the
engine is read in :mod:`.translate`; responses are shaped in :mod:`.responses`.
"""

from __future__ import annotations

import json
import re

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .apierror import APIError

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
    """The fields every generation endpoint takes (OpenAI's and llama-server's); other fields are
    kept (``model_extra``: ``speculative.n_max`` and the like) and checked against :data:`UNSUPPORTED`."""

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
    return_provenance: bool = False  # gemmaspec's: where each token came from (drafter or target)
    id_slot: int = -1  # llama-server's: run in this slot (-1: any)
    n_keep: int | None = None  # llama-server's: prompt tokens kept by a context shift (-1: all; default --keep)
    n_discard: int = 0  # llama-server's: tokens dropped per context shift (0: half)


class CompletionRequest(GenerationRequest):
    """OpenAI's ``POST /v1/completions``."""

    # OpenAI's four forms, and llama-server's prompt objects ({"prompt_string", "multimodal_data"})
    prompt: str | list[int] | list[str] | list[list[int]] | dict | list[str | dict | list[int | str]]
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
    """One chat message; ``content`` text or content parts (checked in
    :func:`~gemmaspec.server.translate.chat_messages`), extra fields (``tool_calls``...) kept."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None


class ChatRequest(GenerationRequest):
    """OpenAI's ``POST /v1/chat/completions`` (with llama-server's and vLLM's template fields)."""

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


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
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


_BOM = b"\xef\xbb\xbf"


def _utf8_problem(raw: bytes, exc: UnicodeDecodeError) -> tuple[bytes, str]:
    """The bytes at fault in ``raw`` (where ``exc`` found them) and what is wrong with them, in words."""
    b = raw[exc.start:exc.start + 3]
    if len(b) >= 2 and b[0] == 0xED and 0xA0 <= b[1] <= 0xBF:
        return b, "an encoded UTF-16 surrogate (U+D800-U+DFFF are not characters)"
    bad = raw[exc.start:exc.end]
    if 0x80 <= b[0] <= 0xBF:
        return bad, "a continuation byte without its lead byte (text in another encoding, such as Latin-1?)"
    if b[0] in (0xC0, 0xC1) or b[0] >= 0xF5:
        return bad, "a byte UTF-8 never uses (text in another encoding, such as Latin-1?)"
    if exc.end - exc.start == 1 and len(b) >= 2 and 0x80 <= b[1] <= 0xBF:  # the lead refuses this 2nd byte
        return raw[exc.start:exc.start + 2], "an overlong or out-of-range sequence (not a character)"
    if exc.reason == "unexpected end of data" or "continuation" in exc.reason:
        return bad, ("a multi-byte sequence cut short (a character split, or text in another encoding, "
                     "such as Latin-1?)")
    return bad, exc.reason  # anything else, in Python's words


def utf8_text(raw: bytes) -> str:
    """``raw`` decoded strictly as UTF-8, as ``json.loads`` of bytes reads it but without letting
    encoded surrogates through: a leading byte-order mark is skipped, and a UTF-16 or UTF-32 body
    (which ``json.loads`` recognises by its first bytes) is decoded strictly in its encoding.

    Raises:
        APIError: 400 naming the first bytes that are not UTF-8 (Latin-1 text, a cut multi-byte
            sequence, an encoded surrogate), where they are and what is wrong with them.
    """
    enc = json.detect_encoding(raw)
    if enc.startswith(("utf-16", "utf-32")):
        try:
            return raw.decode(enc)
        except UnicodeDecodeError as exc:
            raise APIError(400, f"the request body is not valid {enc.upper()} (at byte {exc.start}: "
                                f"{exc.reason}); send JSON as UTF-8") from None
    skip = len(_BOM) if raw.startswith(_BOM) else 0
    try:
        return raw[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        bad, why = _utf8_problem(raw[skip:], exc)
        raise APIError(400, f"the request body is not valid UTF-8: {bad.hex(' ')} at byte {skip + exc.start}: "
                            f"{why}; send JSON as UTF-8") from None


async def json_body(request: Request) -> dict:
    """The request body as a JSON object.

    The bytes are decoded strictly as UTF-8 first (JSON's encoding, RFC 8259; a leading byte-order
    mark is skipped): ``json.loads`` of bytes would let an encoded surrogate (``b"\\xed\\xa0\\x80"``)
    through, and every string the engine sees must encode back to UTF-8.

    Raises:
        APIError: 400 for a body that is not UTF-8, not JSON, not an object, nested deeper than
            ``MAX_JSON_DEPTH``, or holding a lone surrogate (``"\\ud800"``: Python reads it, no
            tokenizer or encoder can).
    """
    text = utf8_text(await request.body())
    try:
        body = json.loads(text)
    except RecursionError:
        body = None
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})") from None
    if body is None and text.strip() != "null" or not _depth_ok(body, MAX_JSON_DEPTH):
        raise APIError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels of arrays "
                            "and objects)")
    if _SURROGATE_ESCAPE.search(text):  # only an escape can carry one: strict UTF-8 cannot
        where = _lone_surrogate(body)
        if where is not None:
            raise APIError(400, f"the request body is not valid Unicode: a string{where} holds a lone UTF-16 "
                                "surrogate (\\ud800-\\udfff escape without its pair)")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body
