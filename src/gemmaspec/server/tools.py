"""OpenAI tool calls (``tools``, ``tool_choice``) for models without tool tokens (Gemma 3).

Gemma 3's chat template has no tool syntax, so the tools are written into the prompt and the model is
asked to answer a call as one JSON object; the grammar machinery (:mod:`gemmaspec.grammar`) makes
sure that object is well formed and names a real function with arguments valid under its
``parameters`` schema:

- the system turn (Gemma folds it into the first user turn) gets :func:`tools_prompt`: the tools as
  JSON (name, description, parameters) and the reply format
  ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``;
- ``tool_choice: "required"`` or a named function: the reply is constrained to that object (only the
  named function for the latter); ``"auto"`` (the default when tools are given): the reply is either
  plain text (its first character is not ``{``) or that object; ``"none"``: no tools in the prompt,
  no constraint;
- the reply is parsed (:func:`parse_reply`) into ``message.tool_calls`` (``id``, ``type: function``,
  ``function.name``, ``function.arguments`` as a JSON string) with ``finish_reason: "tool_calls"``;
- history: an assistant message's ``tool_calls`` are written back in the same JSON after its text,
  and ``role: tool`` messages become a user turn, ``Tool result (NAME, id ID):`` and the content
  (consecutive results and a following user message share one turn, as the template alternates turns).

References: OpenAI's chat completions API (``tools``, ``tool_choice``, ``parallel_tool_calls``,
streamed ``tool_calls`` deltas); Google's Gemma 3 function-calling guide (tools described in the
prompt, calls as structured text).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..grammar import JSON_WHITESPACE, Grammar, GrammarError, checked, json_schema_grammar, strict_objects
from .apierror import APIError

TOOL_RESULT_HEADER = "Tool result ({name}, id {id}):"
"""The line that opens a tool result in a user turn."""


@dataclass
class ToolSpec:
    """A chat request's tools: ``tools`` (name → its ``function`` object, in order), ``choice``
    (``auto``, ``required``, ``none`` or a function name), ``parallel`` (``parallel_tool_calls``)."""

    tools: dict
    choice: str
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def forced(self) -> bool:
        """The reply must be a call (``required`` or a named function)."""
        return self.active and self.choice != "auto"


def parse_tools(body: dict) -> ToolSpec | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` from a chat request, checked.

    Raises:
        APIError: 400 naming the field: a tool that is not ``{"type": "function", "function": {"name":
            ...}}``, a repeated or malformed name, a ``parameters`` schema that does not compile, a
            ``tool_choice`` other than none/auto/required or a function among the tools.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise APIError(400, "'tool_choice' needs 'tools' (none were given)")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "invalid 'tools': a list of {\"type\": \"function\", \"function\": {...}}")
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"invalid 'tools[{i}]': only {{\"type\": \"function\", \"function\": {{...}}}} tools "
                                "are supported")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise APIError(400, f"invalid 'tools[{i}].function.name': 1-64 letters, digits, _ . - (got {name!r})")
        if name in out:
            raise APIError(400, f"invalid 'tools[{i}].function.name': {name!r} is given twice")
        params = fn.get("parameters")
        if params is None:  # left out or null: no arguments
            params = {"type": "object", "properties": {}}
        try:
            json_schema_grammar(params, f"tools[{i}].function.parameters")
        except GrammarError as exc:
            raise APIError(400, str(exc)) from None
        out[name] = {"name": name, "description": fn.get("description", ""), "parameters": params}
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
        if name not in out:
            raise APIError(400, f"invalid 'tool_choice': {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                                f"naming one of the tools ({', '.join(out)}); got {json.dumps(choice)[:200]}")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise APIError(400, f"invalid 'tool_choice': none, auto, required or a function (got {choice!r})")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(400, f"invalid 'parallel_tool_calls': true or false (got {parallel!r})")
    return ToolSpec(out, choice, parallel)


def tools_prompt(spec: ToolSpec) -> str:
    """The text added to the system turn: the tools and how to call them."""
    listed = [spec.tools[spec.choice]] if spec.choice in spec.tools else list(spec.tools.values())
    defs = json.dumps(listed, ensure_ascii=False)
    how = ('{"tool_calls": [{"name": "<function name>", "arguments": {<arguments, as its parameters say>}}]}')
    if spec.choice == "auto":
        rule = ("To call one or more of them, reply with only this JSON object and nothing else:\n" + how +
                "\nIf no function is needed, reply to the user in plain text.")
    elif spec.choice == "required":
        rule = "Reply by calling one or more of them, with only this JSON object and nothing else:\n" + how
    else:
        rule = f"Reply by calling the function {spec.choice}, with only this JSON object and nothing else:\n" + how
    one = "" if spec.parallel else "\nCall at most one function per reply."
    return (f"You can call these functions (tools):\n{defs}\n\n{rule}{one}\n"
            "Function results come back in the next user turn, after 'Tool result'.")


def _calls_schema(spec: ToolSpec) -> dict:
    names = [spec.choice] if spec.choice in spec.tools else list(spec.tools)
    items = [{"type": "object", "properties": {"name": {"const": n}, "arguments": spec.tools[n]["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    arr = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not spec.parallel or spec.choice in spec.tools:
        arr["maxItems"] = 1
    return {"type": "object", "properties": {"tool_calls": arr}, "required": ["tool_calls"],
            "additionalProperties": False}


def tools_grammar(spec: ToolSpec) -> Grammar | None:
    """The constraint on the reply: the call object (``required``, named), the call object or text
    not starting with ``{`` (``auto``), or None (``none``).

    Raises:
        APIError: 400 when the tools' schemas together do not compile.
    """
    import llguidance

    if not spec.active:
        return None
    schema = _calls_schema(spec)
    try:
        if spec.forced:
            return json_schema_grammar(schema, "tools")
        opts = json.dumps({"whitespace_pattern": JSON_WHITESPACE})
        lark = ("start: calls | TEXT\n"
                f"calls: %json {{\"x-guidance\": {opts}, \"allOf\": [{json.dumps(strict_objects(schema))}]}}\n"
                "TEXT: /([^{][\\s\\S]*)?/\n")
        return checked(llguidance.LLMatcher.grammar_from_lark(lark), "tools", "lark")
    except GrammarError as exc:
        raise APIError(400, str(exc)) from None


def render_history(messages: list[dict], raw) -> list[dict]:
    """Chat messages with OpenAI's tool parts turned into text the template renders: an assistant
    message's ``tool_calls`` appended as the call JSON, ``tool`` messages as user turns (merged with
    neighbouring user turns). ``raw`` are the request's messages (their extra fields)."""
    names = {}
    out: list[dict] = []
    for m, r in zip(messages, raw):
        extra = r.model_extra or {}
        role, content = m["role"], m["content"]
        if role == "assistant" and extra.get("tool_calls"):
            calls = []
            for c in extra["tool_calls"]:
                fn = (c or {}).get("function") or {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    pass
                calls.append({"name": fn.get("name", ""), "arguments": args})
                names[c.get("id")] = fn.get("name", "")
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            content = f"{content}\n{text}" if content else text
        if role == "tool":
            tid = extra.get("tool_call_id", "")
            head = TOOL_RESULT_HEADER.format(name=names.get(tid) or extra.get("name") or "function", id=tid or "-")
            content, role = f"{head}\n{content}", "user"
        if role == "user" and out and out[-1]["role"] == "user" and (m["role"] == "tool" or out[-1].get("_tool")):
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + content, "_tool": True}
            continue
        out.append({"role": role, "content": content, **({"_tool": True} if m["role"] == "tool" else {})})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def with_tools_prompt(messages: list[dict], spec: ToolSpec) -> list[dict]:
    """``messages`` with :func:`tools_prompt` at the end of the system message (one is added first)."""
    if not spec.active:
        return messages
    text = tools_prompt(spec)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def parse_reply(text: str, spec: ToolSpec) -> list[dict] | None:
    """OpenAI ``tool_calls`` from a reply, or None when the reply is not a call object naming the
    request's tools (then it is the message's content)."""
    s = text.strip()
    if not s.startswith("{"):
        return None
    try:
        obj = json.loads(s)
    except ValueError:
        return None
    calls = obj.get("tool_calls") if isinstance(obj, dict) else None
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for c in calls:
        if not isinstance(c, dict) or c.get("name") not in spec.tools:
            return None
        out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}})
    return out
