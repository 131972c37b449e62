"""Object schemas with ``properties`` and no ``additionalProperties`` allow only their keys (issue 33,
item 3), as llama.cpp's json-schema-to-grammar reads them: tool arguments, ``response_format``
json_schema and ``/completion``'s ``json_schema``. Checked on the compiled grammars with a byte-level
tokenizer (one token per byte), no model needed."""

from __future__ import annotations

import llguidance
import pytest

from gemmaspec.grammar import json_schema_grammar, strict_objects
from gemmaspec.server.tools import parse_tools, tools_grammar
from gemmaspec.server.translate import grammar_of


class _Bytes:
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]

    def __call__(self, s):
        return list(s)


@pytest.fixture(scope="module")
def byte_tok():
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def accepts(tok, grammar, text: str) -> bool:
    """Whether ``grammar`` matches all of ``text`` (every byte allowed, and complete at the end)."""
    m = llguidance.LLMatcher(tok, grammar.source, log_level=0)
    assert not m.is_error(), m.get_error()
    ids = list(text.encode())
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


PARAMS = {"type": "object", "properties": {
    "city": {"type": "string"},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}},  # nested: strict too
    "extra": {"type": "object"}}}  # no properties: free-form
OPEN = {**PARAMS, "additionalProperties": True}


def _call(args: str) -> str:
    return '{"tool_calls": [{"name": "weather", "arguments": ' + args + '}]}'


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "weather"}}],
                         ids=["required", "auto", "named"])
def test_tool_arguments_allow_only_declared_keys(byte_tok, choice):
    spec = parse_tools({"tools": [{"type": "function", "function": {"name": "weather", "parameters": PARAMS}}],
                        "tool_choice": choice})
    g = tools_grammar(spec)
    assert accepts(byte_tok, g, _call('{"city": "Paris"}'))
    assert accepts(byte_tok, g, _call('{"city": "Paris", "where": {"lat": 1.5}, "extra": {"any": [1]}}'))
    assert not accepts(byte_tok, g, _call('{"city": "Paris", "properties": "x"}'))  # an undeclared key
    assert not accepts(byte_tok, g, _call('{"where": {"lat": 1, "lon": 2}}'))  # nested undeclared key
    # the schema the user gave is left as it was (the prompt shows it unchanged)
    assert "additionalProperties" not in spec.tools["weather"]["parameters"]


def test_tool_arguments_with_additional_properties_true_keep_extra_keys(byte_tok):
    spec = parse_tools({"tools": [{"type": "function", "function": {"name": "weather", "parameters": OPEN}}],
                        "tool_choice": "required"})
    g = tools_grammar(spec)
    assert accepts(byte_tok, g, _call('{"city": "Paris", "b": 2}'))
    assert not accepts(byte_tok, g, _call('{"where": {"lat": 1, "lon": 2}}'))  # the nested one is still strict


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PARAMS}}},
    {"response_format": {"type": "json_object", "schema": PARAMS}},
    {"json_schema": PARAMS},
], ids=["response_format.json_schema", "response_format.json_object", "completion.json_schema"])
def test_response_schemas_allow_only_declared_keys(byte_tok, body):
    g = grammar_of(body)
    assert accepts(byte_tok, g, '{"city": "Paris", "extra": {"free": true}}')
    assert not accepts(byte_tok, g, '{"city": "Paris", "b": 2}')


@pytest.mark.parametrize("schema,text,ok", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1, "b": 2}', False),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}, '{"a": 1, "b": 2}', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     '{"a": 1, "b": "x"}', True),
    ({"type": "object"}, '{"b": 2}', True),  # json_object: any object
    ({"type": "array", "items": {"type": "object", "properties": {"a": {"type": "integer"}}}}, '[{"a": 1, "b": 2}]', False),
    ({"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "string"}]}, '{"a": 1, "b": 2}', False),
    ({"$defs": {"P": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "$ref": "#/$defs/P"}, '{"a": 1, "b": 2}', False),
    # parts of one object stay open: allOf members, anyOf members beside the object's own properties
    ({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}, '{"a": 1, "b": 2}', True),
    ({"type": "object", "properties": {"k": {"type": "string"}}, "anyOf": [{"properties": {"a": {"type": "integer"}}}]},
     '{"k": "x", "a": 1}', True),
    # a schema that only adds required keys keeps the object strict
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, '{"a": 1, "b": 2}', False),
])
def test_json_schema_grammar_reads_a_missing_additional_properties_as_false(byte_tok, schema, text, ok):
    assert accepts(byte_tok, json_schema_grammar(schema), text) is ok


def test_strict_objects_walks_subschemas_but_not_data():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}}},
              "default": {"properties": {"y": 1}}, "enum": [{"properties": {}}]}
    got = strict_objects(schema)
    assert got["additionalProperties"] is False
    assert got["properties"]["properties"]["additionalProperties"] is False
    assert got["default"] == {"properties": {"y": 1}} and got["enum"] == [{"properties": {}}]
    assert "additionalProperties" not in schema  # not changed in place
