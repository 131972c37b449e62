"""Constrained decoding: JSON schemas, GBNF and Lark grammars, through llguidance.

A :class:`Constraint` is one request's grammar state. At each position it gives the tokens the
grammar allows next (:meth:`Constraint.mask`, a bool tensor the sampler applies after the logit bias
and penalties, see :func:`gemmaspec.sampling.filtered_probs`), it advances over each generated
token (:meth:`Constraint.consume`), and it rolls back (:meth:`Constraint.rollback`), which
speculative verification needs: the target's distribution at each verify position is masked by the
grammar state after the drafts before it, and the state is then rolled back to the tokens kept.

The library was chosen by measurement on the default model's 262,144-token vocabulary
(``benchmarks/grammar_libs.py``, numbers in ``docs/server.md``): llguidance compiles a schema or a
grammar in about a millisecond and computes a mask in tens of microseconds for JSON (about 1 ms
for a character-class-heavy GBNF grammar); xgrammar compiles in 60-115 ms and its GBNF masks reach
80 ms at the 90th percentile; outlines-core compiles regular expressions only (no GBNF) and takes
1.4 s for a small schema and a minute for ``json_object``.

The one-time cost is llguidance's tokenizer (its token trie over the vocabulary, ~2-5 s), built on
first use and kept per tokenizer (:func:`llg_tokenizer`).

Sources: llguidance's Python API (``llguidance/_lib.pyi``), llama.cpp's GBNF
(``grammars/README.md``; converted to Lark by ``llguidance.gbnf_to_lark``), OpenAI's
``response_format``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .errors import InputError

# Between JSON tokens: nothing, a space, or a line break and some indentation, as llama.cpp's
# json-schema-to-grammar allows (``SPACE_RULE``); bounded, so a small model cannot spin on whitespace.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}


class GrammarError(InputError):
    """A schema or grammar that cannot be compiled; ``field`` names the request field it came from."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"invalid '{field}': {reason}")
        self.field, self.reason = field, reason


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint, ready to start requests (:meth:`constraint`).

    Attributes:
        source: llguidance's grammar text (JSON, ``{"grammars": [...]}``).
        kind: ``json_schema``, ``gbnf`` or ``lark`` (what the user gave).
        field: the request field it came from (for messages).
    """

    source: str
    kind: str
    field: str

    def constraint(self, tokenizer) -> "Constraint":
        """A fresh grammar state for one request on ``tokenizer`` (a
        :class:`~gemmaspec.tokenizer.GemmaTokenizer`); builds llguidance's tokenizer on first use."""
        return Constraint(self, tokenizer)


def checked(grammar: str, field: str, kind: str) -> Grammar:
    """``grammar`` (llguidance's grammar text) as a :class:`Grammar`, once llguidance accepts it.

    Raises:
        GrammarError: llguidance's reason it does not.
    """
    import llguidance

    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:
        raise GrammarError(field, err.strip())
    return Grammar(grammar, kind, field)


# keywords whose value is one schema, a list of schemas, or a name → schema map (JSON Schema 2020-12
# and draft 7); data keywords (const, enum, default, examples) are not walked
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "additionalProperties", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_objects(schema, *, _part: bool = False):
    """``schema`` with ``"additionalProperties": false`` on every object schema that lists
    ``properties`` and says nothing of extra keys, as llama.cpp's json-schema-to-grammar reads a
    missing ``additionalProperties`` (a small model otherwise adds keys that are not declared, such as
    the schema's own keywords). A new schema; the argument is not changed.

    Kept as they are: an explicit ``additionalProperties`` (``true`` or a schema) or
    ``unevaluatedProperties``; objects without ``properties`` (free-form, as ``{"type": "object"}``);
    schemas that hold part of one object's keys: the members of an ``allOf``, the ``anyOf``/``oneOf``
    members of a schema with its own ``properties``, and a schema whose ``$ref`` or combined members
    may declare keys of their own.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    has_props = isinstance(out.get("properties"), dict) or "patternProperties" in out
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = strict_objects(out[k])
    for k in _LIST:
        if isinstance(out.get(k), list):
            part = k == "allOf" or (k in ("anyOf", "oneOf") and has_props)
            out[k] = [strict_objects(s, _part=part) for s in out[k]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: strict_objects(s) for name, s in out[k].items()}
    declares = ("properties", "patternProperties", "additionalProperties", "$ref", "allOf", "anyOf", "oneOf")
    members = [m for k in ("allOf", "anyOf", "oneOf") if isinstance(schema.get(k), list) for m in schema[k]]
    if (isinstance(out.get("properties"), dict) and not _part
            and not any(k in out for k in ("additionalProperties", "unevaluatedProperties", "$ref"))
            and not any(isinstance(m, dict) and any(k in m for k in declares) for m in members)):
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema, field: str = "json_schema") -> Grammar:
    """A grammar for JSON text valid under ``schema`` (a dict, ``True``, or a JSON string of one).

    ``{"type": "object"}`` is OpenAI's ``json_object``: any JSON object. An object schema with
    ``properties`` and no ``additionalProperties`` allows only the keys it lists
    (:func:`strict_objects`). Keywords the compiler does not implement (an unknown ``format``) are
    errors, so every output validates.

    Raises:
        GrammarError: not a schema, or one the compiler rejects (the reason is llguidance's).
    """
    import llguidance

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise GrammarError(field, f"not JSON ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(field, f"a JSON schema is an object (got {type(schema).__name__})")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(strict_objects(schema), overrides=_JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(field, str(exc)) from None
    return checked(grammar, field, "json_schema")


def gbnf_grammar(text: str, field: str = "grammar") -> Grammar:
    """A grammar from llama.cpp's GBNF (``root ::= ...``); Lark text is accepted too.

    Raises:
        GrammarError: not text, or it does not parse (no ``root`` rule, an undefined rule...).
    """
    import llguidance

    if not isinstance(text, str) or not text.strip():
        raise GrammarError(field, "a grammar is non-empty GBNF text (root ::= ...)")
    try:
        grammar = llguidance.grammar_from("gbnf", text)
    except Exception as exc:  # noqa: BLE001 - the converter raises bare Exception on bad input
        reason = str(exc).removeprefix("Failed to convert the grammar from GBNF to Lark: ")
        raise GrammarError(field, reason) from None
    return checked(grammar, field, "gbnf")


_llg_lock = threading.Lock()


def llg_tokenizer(tokenizer):
    """llguidance's view of ``tokenizer`` (its ``tokenizers`` JSON, our vocabulary size and stop
    ids as end-of-sequence tokens), built once per tokenizer object (seconds) and kept on it."""
    with _llg_lock:
        got = getattr(tokenizer, "_llg", None)
        if got is None:
            import llguidance

            got = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                         eos_token=sorted(tokenizer.stop_ids))
            tokenizer._llg = got
        return got


class Constraint:
    """One request's grammar state (an llguidance ``LLMatcher``).

    Args:
        grammar: the compiled :class:`Grammar`.
        tokenizer: the request's :class:`~gemmaspec.tokenizer.GemmaTokenizer`.

    Raises:
        GrammarError: the grammar does not build on this vocabulary.
    """

    def __init__(self, grammar: Grammar, tokenizer):
        import llguidance

        self.grammar = grammar
        self.vocab = tokenizer.vocab_size
        self.matcher = llguidance.LLMatcher(llg_tokenizer(tokenizer), grammar.source, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(grammar.field, self.matcher.get_error())
        self._bits = torch.zeros((1, (self.vocab + 31) // 32), dtype=torch.int32)
        self.consumed = 0  # tokens consumed so far (rollback reference)

    def mask(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next (the stop ids only where it may end)."""
        # llguidance.torch's fill_next_token_bitmask does this, but importing it loads torch.compile
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")[:self.vocab]
        return torch.from_numpy(bits).bool()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from the current state (no state change)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def consume(self, token: int) -> None:
        """Advance over ``token``.

        Raises:
            RuntimeError: the grammar forbids it (a caller bug: tokens are drawn from the mask).
        """
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self.consumed += 1

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n > 0:
            if not self.matcher.rollback(n):
                raise RuntimeError(f"grammar rollback of {n} tokens failed: {self.matcher.get_error()}")
            self.consumed -= n

    @property
    def done(self) -> bool:
        """Whether the grammar has reached an end it cannot extend (only a stop token may follow)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """Whether the text so far is complete under the grammar."""
        return self.matcher.is_accepting()
