"""The text a drafter is trained on, and where it comes from (licences recorded in docs/drafter.md).

Three sources, all on this machine or written by the target itself, none downloaded:

- ``pydoc``: the Python Language Reference and library topics that CPython ships as
  ``pydoc_data.topics`` (Python Software Foundation License 2.0): English technical prose with code.
- ``stdlib``: Python source files of the standard library of the running interpreter (same licence).
- ``self``: what the target writes, greedy, when continuing :data:`SELF_PROMPTS` (prompts written for
  this project; the target's own output is what a drafter will be asked to predict).

Held-out prompts (the speculative benchmark's and tests') are never in the corpus: :func:`build_corpus`
refuses a corpus that contains one of them verbatim.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import torch

SELF_PROMPTS = [
    # code
    "def binary_search(items, target):\n", "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef list_files(root):\n", "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n",
    "function fibonacci(n) {\n", "#include <stdio.h>\n\nint main(void) {\n",
    "SELECT name, email FROM users WHERE", "def parse_args():\n    parser = argparse.ArgumentParser(",
    "for i in range(10):\n", "def read_json(path):\n", "public class Point {\n    private int x;\n",
    "async def fetch(session, url):\n", "def test_addition():\n    assert", "<html>\n<head>\n<title>",
    "def count_words(text):\n", "const express = require('express');\n",
    # structured
    '{"id": 1, "title": "First post", "tags": [', "name,age,city\nAnna,28,Oslo\n",
    "- apples\n- oranges\n", "1. Preheat the oven to 180 degrees.\n2.", '[{"user": "kim", "score": 12},',
    "Monday: gym\nTuesday: reading\n", "| Country | Capital |\n|---|---|\n| France | Paris |\n",
    # prose
    "The old bridge over the river had stood for two hundred years.", "It was raining when the train reached the station.",
    "My grandmother kept a garden behind her house.", "The history of the printing press begins",
    "Bees are important to farmers because", "In the winter of 1912, the expedition", "The city woke slowly that morning.",
    "A good night's sleep helps the brain", "The first computers filled whole rooms.", "She opened the letter and read",
    "Volcanoes form when", "The recipe calls for three eggs,", "Our team started the project in March.",
    # questions and explanations
    "Q: What is photosynthesis?\nA:", "Q: How do magnets work?\nA:", "Q: Why do we have leap years?\nA:",
    "Q: What is the difference between weather and climate?\nA:", "Q: How does a refrigerator keep food cold?\nA:",
    "Q: What is an algorithm?\nA:", "Q: Why does ice float on water?\nA:", "Q: What does a CPU do?\nA:",
    "Explain how a bicycle stays upright.", "Explain what a database index is.", "Explain the water cycle.",
    "Summarize the plot of a detective story in three sentences.", "List five uses for a paperclip.",
    "Translate to French: Good morning, how are you?", "Write a haiku about the sea.",
    "Write an email to a colleague asking to move a meeting.", "Give three tips for learning a language.",
    "The main causes of the First World War were", "To install the package, run",
    "Dear customer, thank you for", "Chapter 1\n\nThe village was quiet.",
]


def held_out_texts() -> list[str]:
    """The prompts drafters are evaluated on (benchmarks/speculative.py, tests/test_speculative.py,
    tests/test_shipped_drafter.py, and the ``gemmaspec bench`` suite),
    read from their files when present (a source checkout), so the check follows them."""
    root = Path(__file__).resolve().parents[3]
    out = []
    suite = Path(__file__).resolve().parents[1] / "bench" / "suite.jsonl"  # gemmaspec bench's prompts
    if suite.exists():
        for line in suite.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                texts = [rec.get("prompt")] + [m.get("content") for m in rec.get("messages") or []]
                out += [t for t in texts if isinstance(t, str) and len(t) >= 30]
    for rel in ("benchmarks/speculative.py", "benchmarks/common.py", "tests/test_speculative.py",
                "tests/test_shipped_drafter.py"):
        p = root / rel
        if p.exists():
            import ast

            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= 30:
                    out.append(node.value)
    return out


def pydoc_texts(max_chars: int) -> list[str]:
    import pydoc_data.topics as t

    out, total = [], 0
    for key in sorted(t.topics):
        text = t.topics[key]
        out.append(text[:max_chars - total])
        total += len(out[-1])
        if total >= max_chars:
            break
    return out


def stdlib_texts(max_chars: int, piece: int = 4000) -> list[str]:
    """Pieces of standard-library sources, a deterministic spread over the sorted top-level modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)
    out, total = [], 0
    for p in files[::3]:
        text = p.read_text(errors="replace")[:piece]
        out.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return out


@torch.inference_mode()
def self_generated(model, tokenizer, prompts: list[str], n: int = 160, batch: int = 8) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by the target (``n`` tokens each; EOS ends one early),
    ``batch`` sequences per forward (``forward_batch``; solo forwards for a model without it).

    Returns:
        Token ids of prompt + continuation, per prompt.
    """
    out = []
    for i in range(0, len(prompts), batch):
        group = [tokenizer.encode(p) for p in prompts[i:i + batch]]
        caches = [model.new_cache(len(g) + n + 1) for g in group]
        last = []
        for g, c in zip(group, caches):
            o = model.forward(torch.tensor(g), c)
            last.append(int(o.logits[-1].argmax()))
        seqs = [list(g) + [t] for g, t in zip(group, last)]
        alive = [t != tokenizer.eos_id for t in last]
        for _ in range(n - 1):
            idx = [j for j, a in enumerate(alive) if a]
            if not idx:
                break
            if hasattr(model, "forward_batch"):
                outs = model.forward_batch([(torch.tensor([seqs[j][-1]]), caches[j]) for j in idx])
            else:
                outs = [model.forward(torch.tensor([seqs[j][-1]]), caches[j]) for j in idx]
            for j, o in zip(idx, outs):
                t = int(o.logits[-1].argmax())
                seqs[j].append(t)
                if t == tokenizer.eos_id:
                    alive[j] = False
        out.extend(seqs)
    return out


def build_corpus(model, tokenizer, pydoc_chars: int = 200_000, stdlib_chars: int = 150_000,
                 self_tokens: int = 160, prompts: list[str] | None = None) -> tuple[list[list[int]], dict]:
    """Token sequences of the three sources and a description (source, licence, pieces, tokens, a
    key hashing the token ids).

    Raises:
        ValueError: a held-out prompt appears verbatim in the corpus text.
    """
    texts = {"pydoc": pydoc_texts(pydoc_chars), "stdlib": stdlib_texts(stdlib_chars)}
    held = held_out_texts()
    for src, items in texts.items():
        for text in items:
            for h in held:
                if h.strip() and h.strip() in text:
                    raise ValueError(f"held-out prompt found in the {src} corpus: {h[:60]!r}")
    for p in prompts or SELF_PROMPTS:
        if any(p.strip() in h or h.strip() in p for h in held):
            raise ValueError(f"a self-generation prompt overlaps a held-out prompt: {p[:60]!r}")
    seqs, info = [], {}
    for src, items in texts.items():
        ids = [tokenizer.encode(t) for t in items]
        seqs += ids
        info[src] = {"pieces": len(ids), "tokens": sum(map(len, ids)), "chars": sum(map(len, items)),
                     "licence": "Python Software Foundation License 2.0"}
    if self_tokens:
        gen = self_generated(model, tokenizer, prompts or SELF_PROMPTS, self_tokens)
        seqs += gen
        info["self"] = {"pieces": len(gen), "tokens": sum(map(len, gen)),
                        "licence": "the target's own output from prompts written for gemmaspec"}
    key = hashlib.sha256(json.dumps(seqs).encode()).hexdigest()[:16]
    info["key"] = key
    info["tokens"] = sum(map(len, seqs))
    return seqs, info
