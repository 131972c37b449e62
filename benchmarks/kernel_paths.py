"""Decode speed by kernel instruction-set path and by OpenMP wait policy, quiet and under load.

Each run is a fresh ``gemmaspec generate`` process on the default model (greedy, EOS ignored, plain
decoding, ``--json``); the decode tokens/s of each configuration is the median of ``--repeats`` runs,
configurations taking turns, and each run records how many cores everything else on the machine kept
busy meanwhile (``/proc/stat``), since a shared machine is never quite quiet.

Paths (results/kernel_paths.*): ``GEMMASPEC_ISA`` = avx512 / avx2 / portable, those this CPU can run,
threads spinning (``OMP_WAIT_POLICY=active``) so that only the path varies.
Wait policies (results/wait_policy.*; ``--policies``, default all): gemmaspec's default (no variable
set), ``OMP_WAIT_POLICY=passive`` (libgomp's spin count 0), ``spin N`` = ``GOMP_SPINCOUNT=N`` (N may end
in k; 300k is libgomp's own default, 6-10 ms of ``pause`` on this Xeon) and ``OMP_WAIT_POLICY=active``
(spin for minutes), each on a quiet machine and with one busy process (``python -c 'while True:
pass'``) that this script starts before and stops after the run. About 10 s per run on a quiet machine.

    .venv/bin/python benchmarks/kernel_paths.py [--repeats 3] [--tokens 96] [--policies all|default,spin 3k,...]
                                                [--no-isa] [--no-wait]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from common import busy_process, cpu_busy_s, machine, median, write_results

from gemmaspec.kernels import cpu_supports

PROMPT = '{"users": [\n  {"id": 1, "name": "Alice", "email": "alice@example.com", "role": "admin"},'

# name -> the variables that choose the policy (everything else about OpenMP left unset)
POLICIES = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "passive"},
    "spin 1k": {"GOMP_SPINCOUNT": "1000"},
    "spin 3k": {"GOMP_SPINCOUNT": "3000"},
    "spin 10k": {"GOMP_SPINCOUNT": "10000"},
    "spin 30k": {"GOMP_SPINCOUNT": "30000"},
    "spin 300k (libgomp default)": {"GOMP_SPINCOUNT": "300000"},
    "active": {"OMP_WAIT_POLICY": "active"},
}
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def policy_env(name: str) -> dict:
    """The variables of a policy: one of ``POLICIES`` or ``spin N`` (``GOMP_SPINCOUNT=N``; N may end in k).
    Raises ValueError for anything else."""
    if name in POLICIES:
        return POLICIES[name]
    word, _, n = name.partition(" ")
    if word == "spin" and n.rstrip("k").isdigit():
        return {"GOMP_SPINCOUNT": str(int(n.rstrip("k")) * (1000 if n.endswith("k") else 1))}
    raise ValueError(f"unknown policy {name!r}: choose from {', '.join(POLICIES)} or 'spin N'")


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished, reaped children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def decode_tps(env: dict, tokens: int) -> tuple[float, float | None]:
    """One fresh ``gemmaspec generate`` process with ``env`` added to a copy of this process's
    environment from which the wait-policy variables are removed: its decode tokens/s, and the CPU
    that everything else on the machine used meanwhile (cores, averaged over the run; a busy process
    this script started counts; None where ``/proc/stat`` cannot be read)."""
    cmd = [sys.executable, "-m", "gemmaspec", "generate", "-p", PROMPT, "-n", str(tokens), "--temp", "0",
           "--ignore-eos", "--spec-type", "none", "--json"]
    base = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}  # each run chooses its own
    busy0, own0, t0 = cpu_busy_s(), children_cpu_s(), time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env={**base, **env}, timeout=600)
    busy1, own, wall = cpu_busy_s(), children_cpu_s() - own0, time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"gemmaspec failed: {res.stderr.strip()[-500:]}")
    others = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0 - own) / wall)
    return json.loads(res.stdout.strip().splitlines()[-1])["decode_tps"], others


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--policies", default="all",
                    help=f"comma-separated: all, or any of {', '.join(POLICIES)}, 'spin N'")
    ap.add_argument("--no-isa", action="store_true", help="skip the kernel-path rows (results/kernel_paths.*)")
    ap.add_argument("--no-wait", action="store_true", help="skip the wait-policy rows (results/wait_policy.*)")
    a = ap.parse_args()
    names = [] if a.no_wait else list(POLICIES) if a.policies == "all" else [p.strip() for p in a.policies.split(",")]
    try:
        envs = {n: policy_env(n) for n in names}
    except ValueError as e:
        ap.error(str(e))
    isas = [] if a.no_isa else [isa for isa in ("avx512", "avx2") if cpu_supports(isa)] + ["portable"]
    runs: dict[str, list[float]] = {}
    others: dict[str, list[float | None]] = {}

    def run(label: str, env: dict) -> None:
        tps, busy = decode_tps(env, a.tokens)
        runs.setdefault(label, []).append(tps)
        others.setdefault(label, []).append(busy)

    for _ in range(a.repeats):
        for isa in isas:
            run(f"isa {isa}", {"GEMMASPEC_ISA": isa, "OMP_WAIT_POLICY": "active"})  # spinning: only the path varies
        for name in names:
            run(f"wait {name} quiet", envs[name])
            with busy_process():
                run(f"wait {name} one busy process", envs[name])
    m = machine()

    def cores(xs):
        return ", ".join("?" if x is None else f"{x:.1f}" for x in xs)

    head = (f"Machine: {m['cpu']}, {m['cores']} cores; SIMD: {m['simd']}; default model, greedy, {a.tokens} tokens, "
            f"EOS ignored, plain decoding, default threads; median of {a.repeats} fresh processes per row, "
            "configurations taking turns.")
    for name, prefix, note in (
            ("kernel_paths", "isa ", " Threads spinning (OMP_WAIT_POLICY=active), so only the kernel path varies."),
            ("wait_policy", "wait ", " 'quiet': no load added by this script; 'one busy process': "
             "`python -c 'while True: pass'` started by it. Last column: cores that everything else on the machine "
             "kept busy during each run (the busy process included), from /proc/stat.")):
        rows = {k: v for k, v in runs.items() if k.startswith(prefix)}
        if not rows:
            continue
        lines = [head + note, "", "| configuration | decode tok/s (median) | runs | others' CPU (cores) |",
                 "|---|---:|---|---|"]
        for label, xs in rows.items():
            lines.append(f"| {label[len(prefix):]} | {median(xs):.1f} | {', '.join(f'{x:.1f}' for x in xs)} | "
                         f"{cores(others[label])} |")
        write_results(name, {"machine": m, "tokens": a.tokens, "repeats": a.repeats,
                             "policies": envs if prefix == "wait " else None,
                             "runs": rows, "others_cores": {k: others[k] for k in rows}}, "\n".join(lines))

if __name__ == "__main__":
    main()
