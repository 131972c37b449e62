"""`gemmaspec serve` under load: 1, 2, 4 and 8 concurrent users, speculation on and off, real model.

A thin caller of `gemmaspec bench --url` (one measuring code path): starts one server (`gemmaspec
serve -np 8`, ngram-simple, n_max 3) and has `gemmaspec bench` sweep the user counts with speculation
off (llama-server's per-request `speculative.n_max: 0`) and on, the two taking turns per user count,
over the five prompts below (one kind, "mixed"; each phase runs them cycled to a multiple of the
users, closed-loop users sending back to back), --requests repeats. Figures (aggregate and per-user
tokens/s, TTFT and ITL p50/p95, acceptance from the responses' `timings`, speedup, crossover) are
defined in docs/benchmarks.md.

    python benchmarks/serve_load.py [--n 64] [--requests 2] [--users 1,2,4,8] [--threads 2] [--render-only]

Writes benchmarks/results/serve_load/ (results.json, report.md, PNG plots). The older
benchmarks/results/serve_load.json / .md (the table in the README) came from this script's earlier,
self-contained version.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import ROOT

from gemmaspec.cli import main as gemmaspec_main

OUT = ROOT / "benchmarks" / "results" / "serve_load"

PROMPTS = [
    "Rewrite the following list in the same order, with each line prefixed by a dash:\n"
    + "".join(f"item number {i}: the quick brown fox jumps over the lazy dog\n" for i in range(1, 9))
    + "Rewritten list:\n",
    'Convert to JSON: name Alice, age 30, city Paris.\n{"name": "Alice", "age": 30, "city": "Paris"}\n'
    "Convert to JSON: name Bob, age 25, city Rome.\n",
    "Write a Python function that parses a CSV file and returns the rows as dictionaries.\n",
    "Write a short story about a robot who learns to paint.\n",
    "Question: Why is the sky blue?\nAnswer:",
]


def start_server(threads: int, slots: int, log_dir: Path):
    log = open(log_dir / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "gemmaspec", "serve", "--port", "0", "-np", str(slots), "-c", "1024",
                             "-t", str(threads), "--spec-type", "ngram-simple", "--spec-draft-n-max", "3"],
                            stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 300
    url = None
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"listening on (http://\S+)", (log_dir / "serve.log").read_text())
        if m and url is None:
            url = m.group(1)
        if url:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start: " + (log_dir / "serve.log").read_text()[-2000:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--requests", type=int, default=2, help="repeats of each phase (default 2)")
    ap.add_argument("--users", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--render-only", action="store_true",
                    help="redraw report.md and the plots from benchmarks/results/serve_load/results.json")
    a = ap.parse_args()
    if a.render_only:
        sys.exit(gemmaspec_main(["bench", "--report-only", "--out", str(OUT)]))
    users = [int(u) for u in a.users.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        suite = Path(tmp) / "serve_load.jsonl"
        suite.write_text("".join(json.dumps({"kind": "mixed", "prompt": p}) + "\n" for p in PROMPTS))
        proc, url = start_server(a.threads, max(users), Path(tmp))
        try:
            rc = gemmaspec_main(["bench", "--url", url, "--suite", str(suite), "--spec-type", "ngram-simple",
                                 "--spec-draft-n-max", "3", "--users", a.users, "--repeats", str(a.requests),
                                 "--max-tokens", str(a.n), "--out", str(OUT)])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print((OUT / "report.md").read_text() if (OUT / "report.md").exists() else "", end="")
    sys.exit(rc)


if __name__ == "__main__":
    main()
