"""Decode speed by kernel instruction-set path and by OpenMP wait policy, quiet and under load.

Each run is a fresh ``gemmaspec generate`` process on the default model (greedy, EOS ignored, plain
decoding, ``--json``); the decode tokens/s of each configuration is the median of ``--repeats`` runs,
configurations taking turns. Paths: ``GEMMASPEC_ISA`` = avx512 / avx2 / portable (those this CPU can
run; threads spinning). Wait policies: gemmaspec's default (passive when other processes already run on half the cores
at start), ``OMP_WAIT_POLICY`` = active (spinning) and passive, each on a quiet machine and with one busy process started by this script. About 5 minutes.

    .venv/bin/python benchmarks/kernel_paths.py [--repeats 3] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import machine, median, write_results

from gemmaspec.kernels import cpu_supports

PROMPT = '{"users": [\n  {"id": 1, "name": "Alice", "email": "alice@example.com", "role": "admin"},'


def decode_tps(env: dict, tokens: int) -> float:
    cmd = [sys.executable, "-m", "gemmaspec", "generate", "-p", PROMPT, "-n", str(tokens), "--temp", "0",
           "--ignore-eos", "--spec-type", "none", "--json"]
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # each run chooses its own
    res = subprocess.run(cmd, capture_output=True, text=True, env={**base, **env}, timeout=600)
    if res.returncode != 0:
        sys.exit(f"gemmaspec failed: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["decode_tps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    a = ap.parse_args()
    isas = [isa for isa in ("avx512", "avx2") if cpu_supports(isa)] + ["portable"]
    runs: dict[str, list[float]] = {}
    for _ in range(a.repeats):
        for isa in isas:
            env = {"GEMMASPEC_ISA": isa, "OMP_WAIT_POLICY": "active"}  # fixed, so only the kernel path varies
            runs.setdefault(f"isa {isa}", []).append(decode_tps(env, a.tokens))
        for policy in ("default", "active", "passive"):  # default: gemmaspec's own choice at start
            env = {} if policy == "default" else {"OMP_WAIT_POLICY": policy}
            runs.setdefault(f"wait {policy} quiet", []).append(decode_tps(env, a.tokens))
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                time.sleep(0.3)
                runs.setdefault(f"wait {policy} one busy process", []).append(decode_tps(env, a.tokens))
            finally:
                busy.kill()
                busy.wait()
    m = machine()
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores; SIMD: {m['simd']}; default model, greedy, {a.tokens} tokens, "
             f"EOS ignored, plain decoding, default threads; median of {a.repeats} fresh processes per row, "
             "configurations taking turns.", "",
             "| configuration | decode tok/s (median) | runs |", "|---|---:|---|"]
    for name, xs in runs.items():
        lines.append(f"| {name} | {median(xs):.1f} | {', '.join(f'{x:.1f}' for x in xs)} |")
    write_results("kernel_paths", {"machine": m, "tokens": a.tokens, "repeats": a.repeats, "runs": runs},
                  "\n".join(lines))


if __name__ == "__main__":
    main()
