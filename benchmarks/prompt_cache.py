"""Prompt-cache reuse on a multi-turn chat: the second turn's time to first token with and without it.

One ``gemmaspec serve`` (the default model, ``-np 1``, greedy). Each repeat runs the same two-turn
conversation twice: once with ``cache_prompt`` true (llama-server's default: turn 2 finds turn 1's
prompt and reply in the slot and prefills only the new user message) and once with it false (turn 2
prefills the whole history). Turn 2 is streamed; its time to first token is measured at the client
(request sent -> first content chunk), and the server's ``timings`` say how many prompt tokens were
reused (``cache_n``) and run (``prompt_n``).

    python benchmarks/prompt_cache.py [--repeats 5] [--out prompt_cache]

Writes benchmarks/results/<out>.json and .md (medians).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx

from common import machine, median, tests_helper, write_results

SYSTEM = ("You answer questions about a small library's rules. The library opens at nine and closes at six on "
          "weekdays, and at four on Saturdays; it is closed on Sundays. Members may borrow up to eight books for "
          "three weeks and renew them twice unless someone else has reserved them. Late books cost ten cents a "
          "day, capped at the price of the book. Reference books, maps and the local newspaper archive never "
          "leave the building. The reading room is silent; the ground floor allows quiet talk. Printing costs "
          "five cents a page, and the two public computers can be booked for an hour at a time. ") * 3
TURN1 = "How many books can I borrow, and for how long?"
TURN2 = "And what happens if I bring them back a week late?"


def _turn(url: str, messages: list[dict], cache: bool, max_tokens: int) -> dict:
    """One streamed chat request: the reply text, client-side TTFT (ms) and the server's timings."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "cache_prompt": cache, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, timings = None, "", {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            for c in ev.get("choices", []):
                piece = (c.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = (time.perf_counter() - t0) * 1e3
                text += piece
            timings = ev.get("timings") or timings
    return {"text": text, "ttft_ms": ttft, "cache_n": timings.get("cache_n"), "prompt_n": timings.get("prompt_n")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="prompt_cache")
    a = ap.parse_args()
    server = tests_helper("conftest").ServerProcess(Path(tempfile.mkdtemp()), "-np", "1", "-c", "4096", "--temp", "0")
    runs = {"reuse": [], "no reuse": []}
    try:
        for _ in range(a.repeats):
            for mode, cache in (("reuse", True), ("no reuse", False)):
                history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURN1}]
                first = _turn(server.url, history, cache, 48)
                history += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": TURN2}]
                runs[mode].append(_turn(server.url, history, cache, 8))
    finally:
        server.close()
    med = {m: {k: median([r[k] for r in rs]) for k in ("ttft_ms", "cache_n", "prompt_n")} for m, rs in runs.items()}
    m = machine()
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores; `gemmaspec serve -np 1 -c 4096` (default model, default "
             f"speculation), greedy; a two-turn chat, turn 2 streamed; medians of {a.repeats} repeats, the modes "
             "taking turns. TTFT: request sent -> first content chunk, at the client.", "",
             "| turn 2 | prompt tokens reused (cache_n) | prompt tokens run (prompt_n) | TTFT (ms) |",
             "|---|---:|---:|---:|"]
    for mode, d in med.items():
        lines.append(f"| {mode} | {d['cache_n']:.0f} | {d['prompt_n']:.0f} | {d['ttft_ms']:.0f} |")
    ratio = med["no reuse"]["ttft_ms"] / med["reuse"]["ttft_ms"]
    lines += ["", f"Reuse makes turn 2's first token {ratio:.1f}x sooner."]
    write_results(a.out, {"machine": m, "repeats": a.repeats, "runs": runs, "medians": med}, "\n".join(lines))


if __name__ == "__main__":
    main()
