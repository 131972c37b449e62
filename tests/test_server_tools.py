"""OpenAI tool calls on /v1/chat/completions (issue 13): tools rendered into the prompt (Gemma 3 has no
tool tokens), replies constrained by the grammar machinery for ``required`` and named functions,
parsed into ``message.tool_calls`` with ``finish_reason: "tool_calls"``, streamed as OpenAI's
``tool_calls`` deltas, the same with and without speculation; ``role: tool`` messages and assistant
``tool_calls`` in the history; bad tools and choices are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import ServerProcess
from gemmaspec.server.apierror import APIError
from gemmaspec.server.tools import TOOL_RESULT_HEADER, parse_reply, parse_tools, render_history, tools_prompt

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"sunny\"}"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]


# ---- without a server -----------------------------------------------------------------------------------

@pytest.mark.parametrize("body,needle", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_and_choices_name_the_field(body, needle):
    with pytest.raises(APIError) as exc:
        parse_tools(body)
    assert exc.value.status == 400 and needle in exc.value.message


def test_the_prompt_and_the_parser_agree():
    spec = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    text = tools_prompt(spec)
    assert "get_weather" in text and "get_time" in text and '{"tool_calls": [{"name"' in text
    calls = parse_reply('{"tool_calls": [{"name": "get_time", "arguments": {"city": "Oslo"}}]}', spec)
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_time", "arguments": '{"city": "Oslo"}'}
    assert parse_reply('{"tool_calls": [{"name": "rm_rf", "arguments": {}}]}', spec) is None  # not a tool
    assert parse_reply("Sunny, 21 degrees.", spec) is None
    only = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert only.choice == "get_time" and "get_weather" not in tools_prompt(only)


# ---- through the server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("serve-tools"), "-np", "2", "-c", "1024",
                      "--spec-draft-n-max", "4", "--spec-ngram-size", "2", "--temp", "0")
    yield s
    s.close()


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed_calls(chunks):
    """OpenAI's streamed tool_calls deltas, accumulated as a client does."""
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            got = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            got["id"] = d.id or got["id"]
            if d.function:
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def _check_weather_args(name, arguments):
    args = json.loads(arguments)
    spec = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    assert set(args) == set(spec["required"]) and all(isinstance(args[k], str) for k in args)
    assert name != "get_weather" or args["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_whole_streamed_and_with_or_without_speculation(oai, choice):
    got = []
    for extra in ({}, {"speculative.n_max": 0}):
        kw = dict(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False,
                  max_tokens=60, extra_body=extra)
        r = oai.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].type == "function"
        call = c.message.tool_calls[0]
        assert call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        _check_weather_args(call.function.name, call.function.arguments)
        chunks = list(oai.chat.completions.create(stream=True, **kw))
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)
        streamed = _streamed_calls(chunks)
        assert [(s["name"], s["arguments"]) for s in streamed] == [(call.function.name, call.function.arguments)]
        assert streamed[0]["id"].startswith("call_")
        got.append((call.function.name, call.function.arguments))
    assert got[0] == got[1]


def test_auto_gives_text_or_a_valid_call_and_streams_the_same(oai):
    for messages in (ASK, [{"role": "user", "content": "Write one word: hello"}]):
        kw = dict(model="x", messages=messages, tools=[WEATHER, TIME], max_tokens=40)
        c = oai.chat.completions.create(**kw).choices[0]
        chunks = list(oai.chat.completions.create(stream=True, **kw))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        if c.finish_reason == "tool_calls":
            for call in c.message.tool_calls:
                _check_weather_args(call.function.name, call.function.arguments)
            assert [(s["name"], s["arguments"]) for s in _streamed_calls(chunks)] == \
                [(t.function.name, t.function.arguments) for t in c.message.tool_calls] and text == ""
        else:
            assert not c.message.tool_calls and not c.message.content.lstrip().startswith("{")
            assert text == c.message.content and not _streamed_calls(chunks)


def test_history_with_tool_calls_and_results(srv):
    body = {"messages": HISTORY, "tools": [WEATHER, TIME]}
    prompt = httpx.post(srv.url + "/apply-template", json=body, timeout=60).json()["prompt"]
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, ' in prompt
    results = (TOOL_RESULT_HEADER.format(name="get_weather", id="call_1") + '\n{"temp": 21, "sky": "sunny"}\n\n'
               + TOOL_RESULT_HEADER.format(name="get_time", id="call_2") + "\n14:05")
    assert f"<start_of_turn>user\n{results}<end_of_turn>\n<start_of_turn>model\n" in prompt  # one turn, two results
    assert prompt.count("<start_of_turn>user") == 2 and "You can call these functions" in prompt
    r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 8},
                   timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    msgs = render_history([{"role": m["role"], "content": m["content"] or ""} for m in HISTORY],
                          [type("M", (), {"model_extra": {k: v for k, v in m.items() if k not in ("role", "content")}})
                           for m in HISTORY])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]


@pytest.mark.parametrize("path,extra,needle", [
    ("/v1/completions", {"tools": [WEATHER]}, "tools"),
    ("/completion", {"tools": [WEATHER]}, "tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": None, "tool_calls": "nope"}]}, "tool_calls"),
])
def test_tool_fields_where_they_cannot_apply_are_400s(srv, path, extra, needle):
    body = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    r = httpx.post(srv.url + path, json={**body, **extra}, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
