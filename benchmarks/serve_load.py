"""`gemmaspec serve` under load: 1, 2, 4 and 8 concurrent users, speculation on and off, real model.

Starts one server (`gemmaspec serve -np 8`, ngram-simple, n_max 3) and, for each user count, runs the
users as threads that each send --requests streamed completions one after another (--n tokens, greedy,
EOS ignored), first with speculation off for every request (llama-server's per-request
`speculative.n_max: 0`), then on; the two take turns per user count so both meet the same machine
load. Measured on the client: aggregate tokens/s (all completion tokens / the phase's wall time),
per-user tokens/s (each request's tokens after the first / time from its first to its last token,
averaged), time to first token p50/p95 (request sent → first token), and the acceptance rate from the
responses' `timings`.

    python benchmarks/serve_load.py [--n 64] [--requests 2] [--users 1,2,4,8] [--threads 2]

Writes benchmarks/results/serve_load.json and serve_load.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import ROOT, machine, write_results

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


def one_request(url: str, prompt: str, n: int, spec: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    if not spec:
        body["speculative.n_max"] = 0
    t0 = time.perf_counter()
    t_first = t_last = None
    final = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if "usage" in chunk:
                final = chunk
            else:  # one chunk per generated token (its text may be held back)
                t_first = t_first or now
                t_last = now
    tokens = final["usage"]["completion_tokens"]
    t = final["timings"]
    return {"tokens": tokens, "ttft_s": (t_first or t_last) - t0, "decode_s": (t_last - t_first) if t_first else 0.0,
            "wall_s": time.perf_counter() - t0, "draft_n": t["draft_n"], "draft_n_accepted": t["draft_n_accepted"]}


def phase(url: str, users: int, requests: int, n: int, spec: bool) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    barrier = threading.Barrier(users)

    def user(u):
        barrier.wait()
        for k in range(requests):
            res = one_request(url, PROMPTS[(u + k * users) % len(PROMPTS)], n, spec)
            with lock:
                results.append(res)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    ttft = sorted(r["ttft_s"] for r in results)
    pct = lambda q: ttft[min(len(ttft) - 1, int(round(q * (len(ttft) - 1))))]  # noqa: E731
    per_user = [(r["tokens"] - 1) / r["decode_s"] for r in results if r["decode_s"] > 0]
    drafted = sum(r["draft_n"] for r in results)
    return {"users": users, "spec": spec, "requests": len(results), "tokens": sum(r["tokens"] for r in results),
            "wall_s": wall, "aggregate_tps": sum(r["tokens"] for r in results) / wall,
            "per_user_tps": sum(per_user) / len(per_user) if per_user else 0.0,
            "ttft_p50_ms": pct(0.5) * 1e3, "ttft_p95_ms": pct(0.95) * 1e3,
            "acceptance": sum(r["draft_n_accepted"] for r in results) / drafted if drafted else None,
            "draft_n": drafted}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--requests", type=int, default=2, help="requests per user, one after another (default 2)")
    ap.add_argument("--users", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite the table from benchmarks/results/serve_load.json without measuring")
    a = ap.parse_args()
    if a.render_only:
        d = json.loads((ROOT / "benchmarks" / "results" / "serve_load.json").read_text())
        render(d["rows"], d["machine"], d["n"], d["requests_per_user"], d.get("threads", 2))
        return
    users = [int(u) for u in a.users.split(",")]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(a.threads, max(users), Path(tmp))
        try:
            one_request(url, PROMPTS[0], 8, True)  # warm-up
            rows = []
            for u in users:
                for spec in (False, True):
                    r = phase(url, u, a.requests, a.n, spec)
                    print(f"users {u} spec {'on ' if spec else 'off'}: {r['aggregate_tps']:.1f} tok/s aggregate, "
                          f"{r['per_user_tps']:.1f} per user, TTFT p50 {r['ttft_p50_ms']:.0f} ms", file=sys.stderr)
                    rows.append(r)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    m = machine()
    m["loadavg_1min_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    render(rows, m, a.n, a.requests, a.threads)


NOISE = 1.05  # run-to-run noise of aggregate tokens/s on this shared machine is about ±5%


def render(rows, m, n, requests, threads):
    """Write the JSON and the markdown table; speculation "stops paying" at the first user count
    where it gains less than the noise (aggregate tokens/s with it < 1.05x without it)."""
    users = sorted({r["users"] for r in rows})
    off = {r["users"]: r for r in rows if not r["spec"]}
    for r in rows:
        r["speedup"] = r["aggregate_tps"] / off[r["users"]]["aggregate_tps"] if r["spec"] else None
    stops = next((r["users"] for r in rows if r["spec"] and r["speedup"] < NOISE), None)
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores; {threads} threads; `gemmaspec serve -np {max(users)}` "
        f"(ngram-simple, n_max 3; off = per-request `speculative.n_max: 0`); greedy, {n} tokens per request "
        f"(EOS ignored), {requests} requests per user back to back, streamed; prompts: rewrite, JSON, code, "
        f"prose, QA in turn. 1-minute load average before/after: {m['loadavg_1min_before_after'][0]:.2f} / "
        f"{m['loadavg_1min_before_after'][1]:.2f} (the benchmark itself adds up to ~2).",
        "",
        "| users | speculation | aggregate tok/s | per-user tok/s | TTFT p50 (ms) | TTFT p95 (ms) | acceptance | "
        "aggregate vs off |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else ""
        lines.append(f"| {r['users']} | {'on' if r['spec'] else 'off'} | {r['aggregate_tps']:.1f} | "
                     f"{r['per_user_tps']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} | {acc} | {sp} |")
    verdict = (f"Speculation stops paying at {stops} concurrent users on this machine: from there it gains less "
               f"than the ~5% run-to-run noise in aggregate tokens/s." if stops else
               f"Speculation gained more than the ~5% noise at every user count measured (up to {max(users)}).")
    lines += ["", verdict]
    write_results("serve_load", {"machine": m, "n": n, "requests_per_user": requests, "threads": threads,
                                 "rows": rows, "speculation_stops_paying_at_users": stops}, "\n".join(lines))


if __name__ == "__main__":
    main()
