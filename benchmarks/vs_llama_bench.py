"""gemmaspec against llama.cpp's own ``llama-bench`` on the same GGUF, machine and threads: decode at
several context depths and prefill, alternating the two engines run by run.

llama.cpp's side: ``llama-bench -p P -n 0 -t T -o json`` and ``-p 0 -n N -d D`` (prompt processing
of P tokens; generation of N tokens after a context of D tokens), built once from the llama.cpp sources vendored in
llama-cpp-python's sdist (``common.llama_binaries``). gemmaspec's side: ``step_costs.py`` in a fresh
process (decode = one forward of 1 row at that context; prefill = the chunked forward of P tokens; its
verify curve and draft step come along). Each engine runs ``--repeats`` times, alternating; medians.

    python benchmarks/vs_llama_bench.py -m MODEL.gguf [-md ASSISTANT.gguf] [--depths 0,512,2048,4096]
                                        [--prefill 512,2048] [--threads 2] [--repeats 2] [--out NAME]

Writes benchmarks/results/<out>.json and .md (machine: CPU model and SIMD flags).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import llama_binaries, machine, median, user_env, write_results
from ttft import ttft

HERE = Path(__file__).parent


def llama_bench(binary: Path, model: str, threads: int, prefill: list[int], depths: list[int], n_gen: int) -> dict:
    """{"pp": {P: tokens/s}, "tg": {D: tokens/s}} from two llama-bench runs (-r 2 each): prompt processing
    at depth 0, then generation at each depth (one run with -p and -d together would time every prompt
    size at every depth)."""
    got = {"pp": {}, "tg": {}}
    for args in (["-p", ",".join(map(str, prefill)), "-n", "0"],
                 ["-p", "0", "-n", str(n_gen), "-d", ",".join(map(str, depths))]):
        cmd = [str(binary), "-m", model, "-t", str(threads), *args, "-r", "2", "-o", "json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=user_env())
        if out.returncode != 0:
            raise RuntimeError(f"llama-bench failed: {out.stderr[-2000:]}")
        for row in json.loads(out.stdout):
            if row["n_gen"] == 0:
                got["pp"][row["n_prompt"]] = row["avg_ts"]
            else:
                got["tg"][row.get("n_depth", 0)] = row["avg_ts"]
    return got


def ours(model: str, draft: str, threads: int, prefill: list[int], depths: list[int]) -> dict:
    """step_costs.py's JSON, run in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sc"
        cmd = [sys.executable, str(HERE / "step_costs.py"), "-m", model, "--threads", str(threads),
               "--ctx", ",".join(map(str, depths)), "--prefill", ",".join(map(str, prefill)), "--repeats", "5",
               "--out", str(out)]
        if draft:
            cmd += ["-md", draft]
        subprocess.run(cmd, check=True, timeout=7200)
        return json.loads(out.with_suffix(".json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-md", "--model-draft", default="")
    ap.add_argument("--depths", default="0,512,2048,4096")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--out", default="vs_llama_bench")
    ap.add_argument("--no-ttft", action="store_true", help="skip time to first token through the two servers")
    a = ap.parse_args()
    depths = [int(x) for x in a.depths.split(",")]
    prefill = [int(x) for x in a.prefill.split(",")]
    binaries = llama_binaries()
    runs = {"llama": [], "ours": [], "ttft": []}
    for r in range(a.repeats):
        print(f"run {r + 1}/{a.repeats}: llama-bench", file=sys.stderr)
        runs["llama"].append(llama_bench(binaries / "llama-bench", a.model, a.threads, prefill, depths, a.n_gen))
        print(f"run {r + 1}/{a.repeats}: gemmaspec", file=sys.stderr)
        runs["ours"].append(ours(a.model, a.model_draft, a.threads, prefill, depths))
        if not a.no_ttft:
            print(f"run {r + 1}/{a.repeats}: time to first token (gemmaspec serve, then llama-server)", file=sys.stderr)
            runs["ttft"].append(ttft(a.model, a.threads, repeats=3))
    table = {"decode": {}, "prefill": {}}
    for d in depths:
        lt = median([x["tg"][d] for x in runs["llama"] if d in x["tg"]])
        ot = median([x["contexts"][str(d)]["decode_tokens_per_s"] for x in runs["ours"]])
        table["decode"][d] = {"ours": ot, "llama": lt, "ratio": ot / lt}
    for p in prefill:
        lp = median([x["pp"][p] for x in runs["llama"] if p in x["pp"]])
        op = median([x["prefill"][str(p)]["tokens_per_s"] for x in runs["ours"]])
        table["prefill"][p] = {"ours": op, "llama": lp, "ratio": op / lp}
    if runs["ttft"]:
        ot = median([t for x in runs["ttft"] for t in x["ours"]])
        lt = median([t for x in runs["ttft"] for t in x["llama"]])
        table["ttft"] = {"ours": ot, "llama": lt, "ratio": ot / lt}
    last = runs["ours"][-1]
    m = machine()
    lines = [f"# gemmaspec vs llama-bench: {os.path.basename(a.model)}", "",
             f"Machine: {m.get('cpu', '?')} ({m.get('simd', '')}), {a.threads} threads; medians of {a.repeats} "
             f"alternating runs; llama-bench -r 2, tg{a.n_gen} at each depth.", "",
             "| | gemmaspec | llama.cpp (llama-bench) | ratio |", "|---|---:|---:|---:|"]
    for d, v in table["decode"].items():
        lines.append(f"| decode at context {d} (tokens/s) | {v['ours']:.2f} | {v['llama']:.2f} | {v['ratio']:.2f}x |")
    for p, v in table["prefill"].items():
        lines.append(f"| prefill of {p} tokens (tokens/s) | {v['ours']:.1f} | {v['llama']:.1f} | {v['ratio']:.2f}x |")
    if "ttft" in table:
        v = table["ttft"]
        lines.append(f"| time to first token, short prompt, through each server (s) | {v['ours']:.3f} | "
                     f"{v['llama']:.3f} (llama-server) | {v['ratio']:.2f}x |")
    lines += ["", "gemmaspec's verify cost t(k+1)/t(1), k = 1..7, and projected MTP speedup (last run):", "",
              "| context | " + " | ".join(f"k={k}" for k in range(1, 8)) + " | draft ms | projected MTP (A=2.68, k=2) |",
              "|---:|" + "---:|" * 9]
    for ctx, row in last["contexts"].items():
        lines.append(f"| {ctx} | " + " | ".join(f"{row['verify_ratio'][str(k)]:.2f}" for k in range(1, 8))
                     + f" | {row.get('draft_ms', float('nan')):.2f} | {row['projection']['speedup']:.2f}x |")
    lines += ["", f"gemmaspec peak RSS {last.get('peak_rss_mib', float('nan')):.0f} MiB; load {last['load_s']:.1f} s.",
              "The MTP figure is a projection from measured costs (A t(1) / (t(k+1) + k t_draft)), not a measured speedup."]
    write_results(a.out, {"machine": m, "model": a.model, "threads": a.threads, "table": table, "runs": runs},
                  "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
