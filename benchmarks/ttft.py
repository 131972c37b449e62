"""Time to first token through each engine's own server: gemmaspec ``serve`` and llama.cpp's
``llama-server`` (built by ``common.llama_binaries``), same GGUF, threads and prompt, one at a time.

TTFT here = from sending a streamed ``POST /completion`` (llama-server's native endpoint, which both
serve) to the first streamed chunk that carries text, in seconds, over localhost; ``cache_prompt`` is
false so every request prefills the whole prompt. The first request after start-up is a warm-up and is
not counted; the median of ``--repeats`` follows.

    python benchmarks/ttft.py -m MODEL.gguf [--threads 2] [--repeats 5] [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, llama_binaries, user_env

PROMPT = "Write a short story about a robot who learns to paint. Once upon a time,"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s: {log.read_text()[-2000:]}")


def first_token_s(port: int, prompt: str) -> float:
    """Seconds from sending the request to the first streamed chunk with non-empty ``content``."""
    body = json.dumps({"prompt": prompt, "n_predict": 4, "stream": True, "cache_prompt": False,
                       "temperature": 0.0})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    try:
        while True:
            line = resp.readline()
            if not line:
                raise RuntimeError("stream ended before any text")
            if line.startswith(b"data: ") and json.loads(line[6:]).get("content"):
                return time.perf_counter() - t0
    finally:
        conn.close()


def measure(cmd: list[str], port: int, prompt: str, repeats: int, env: dict | None = None) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    env=env)
        try:
            wait_healthy(port, proc, log)
            first_token_s(port, prompt)  # warm-up
            return [first_token_s(port, prompt) for _ in range(repeats)]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def ttft(model: str, threads: int = 2, repeats: int = 5, prompt: str = PROMPT, ctx: int = 4096) -> dict:
    """{"ours": [s, ...], "llama": [s, ...]} TTFT samples in seconds (see the module docstring)."""
    model = str(Path(model).resolve())
    port = free_port()
    ours = measure([sys.executable, "-m", "gemmaspec", "serve", "-m", model, "--port", str(port), "-t", str(threads),
                    "-c", str(ctx), "-np", "1", "--spec-type", "none"], port, prompt, repeats)
    port = free_port()
    llama = measure([str(llama_binaries() / "llama-server"), "-m", model, "--port", str(port), "-t", str(threads),
                     "-c", str(ctx), "-np", "1", "--no-webui"], port, prompt, repeats, env=user_env())
    return {"ours": ours, "llama": llama}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", default=PROMPT)
    a = ap.parse_args()
    got = ttft(a.model, a.threads, a.repeats, a.prompt)
    for k, v in got.items():
        print(f"{k}: median TTFT {statistics.median(v):.3f} s  ({', '.join(f'{x:.3f}' for x in v)})")


if __name__ == "__main__":
    main()
