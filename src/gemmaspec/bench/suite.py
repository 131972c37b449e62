"""The prompt suite: what ``gemmaspec bench`` generates from, by text kind.

A suite is a JSONL file, one prompt per line: ``{"kind": str, "prompt": str, "max_tokens": int}`` or
``{"kind": str, "messages": [{"role": ..., "content": ...}, ...], "max_tokens": int}`` (a
conversation, run through the model's chat template / ``/v1/chat/completions``). ``max_tokens`` is
optional (the command's ``--max-tokens`` caps it). Blank lines and lines starting with ``#`` are
skipped. The shipped suite (``suite.jsonl``, written for gemmaspec) has ten kinds of ten prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

DEFAULT_SUITE = Path(__file__).resolve().parent / "suite.jsonl"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    """One suite entry: ``kind``; ``prompt`` (str) or ``messages`` (tuple of (role, content));
    ``max_tokens`` (None: the command's); ``index`` (its position within its kind, 0-based) and
    ``line`` (1-based line in the file)."""

    kind: str
    prompt: str | None
    messages: tuple | None
    max_tokens: int | None
    index: int
    line: int

    def message_dicts(self) -> list[dict]:
        return [{"role": r, "content": c} for r, c in self.messages or ()]


def _entry(obj, where: str, line: int) -> tuple:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - {"kind", "prompt", "messages", "max_tokens"}
    if unknown:
        raise InputError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; a line has kind, prompt or "
                         "messages, and optionally max_tokens")
    kind = obj.get("kind")
    if not isinstance(kind, str) or not kind.strip():
        raise InputError(f"{where}: 'kind' must be a non-empty string (got {kind!r})")
    has_p, has_m = "prompt" in obj, "messages" in obj
    if has_p == has_m:
        raise InputError(f"{where}: give exactly one of 'prompt' (a string) or 'messages' (a list)")
    prompt = messages = None
    if has_p:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise InputError(f"{where}: 'prompt' must be a non-empty string")
    else:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise InputError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        out = []
        for i, msg in enumerate(msgs):
            if (not isinstance(msg, dict) or msg.get("role") not in ROLES or not isinstance(msg.get("content"), str)):
                raise InputError(f"{where}: messages[{i}] must be {{\"role\": one of {'/'.join(ROLES)}, "
                                 f"\"content\": string}} (got {msg!r})")
            out.append((msg["role"], msg["content"]))
        messages = tuple(out)
    mt = obj.get("max_tokens")
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        raise InputError(f"{where}: 'max_tokens' must be a positive integer (got {mt!r})")
    return kind.strip(), prompt, messages, mt


def load_suite(source: str | Path = "default", kinds: list[str] | None = None,
               per_kind: int | None = None) -> list[Prompt]:
    """Read a suite file (``"default"``: the shipped one).

    Args:
        source: ``"default"`` or a JSONL path.
        kinds: keep only these kinds, in this order (None: all, in order of first appearance).
        per_kind: keep the first N prompts of each kind (None: all).

    Returns:
        The prompts, grouped by kind.

    Raises:
        InputError: unreadable file, a malformed line (named by its number), an empty suite, a kind
            asked for that the suite lacks, per_kind < 1.
    """
    path = DEFAULT_SUITE if str(source) == "default" else Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read the suite {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InputError(f"the suite {path} is not UTF-8 text") from None
    by_kind: dict[str, list[Prompt]] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        kind, prompt, messages, mt = _entry(obj, where, n)
        lst = by_kind.setdefault(kind, [])
        lst.append(Prompt(kind, prompt, messages, mt, len(lst), n))
    if not by_kind:
        raise InputError(f"the suite {path} has no prompts")
    if per_kind is not None and per_kind < 1:
        raise InputError(f"--prompts-per-kind must be at least 1 (got {per_kind})")
    if kinds:
        missing = [k for k in kinds if k not in by_kind]
        if missing:
            raise InputError(f"unknown kind(s) {', '.join(missing)}: the suite {path.name} has "
                             f"{', '.join(by_kind)}")
        order = list(dict.fromkeys(kinds))
    else:
        order = list(by_kind)
    return [p for k in order for p in by_kind[k][:per_kind]]
