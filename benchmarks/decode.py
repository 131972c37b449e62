"""Plain decoding speed: gemmaspec vs llama.cpp on the same GGUF, prompts and threads.

Each run is a cold process (load + prompt + 128 greedy tokens, EOS ignored so both make exactly
that many). Reports medians over --repeats runs per prompt: prefill and decode tokens/s, time to
the first token from process start, peak RSS, and ours/llama.cpp.

    python benchmarks/decode.py [--model PATH] [--threads 2] [--n 128] [--repeats 3] [--no-llama]

Writes benchmarks/results/decode.json and decode.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from common import PROMPTS, llama_python, machine, median, run_cold, write_results

from gemmaspec.loading.default_model import default_model_path


def ours(model, prompt, n, threads):
    r = run_cold([sys.executable, "-m", "gemmaspec", "generate", "-m", str(model), "-p", prompt, "-n", str(n),
                  "--temp", "0", "--ignore-eos", "-t", str(threads), "--json"])
    s = json.loads(r["stdout"].rstrip("\n").rsplit("\n", 1)[-1])  # --json: the stats are the last stdout line
    return {"prompt_tokens": s["prompt_tokens"], "prefill_tps": s["prefill_tps"], "generated": s["generated_tokens"],
            "decode_tps": s["decode_tps"], "ttft_ms": s["ttft_ms"], "cold_first_token_s": r["first_output_s"],
            "peak_rss_mb": r["peak_rss_mb"]}


def llama(py, model, prompt, n, threads):
    here = os.path.dirname(os.path.abspath(__file__))
    arg = json.dumps({"model": str(model), "prompt": prompt, "n": n, "threads": threads})
    r = run_cold([str(py), os.path.join(here, "llama_runner.py"), arg])
    d = json.loads(r["stderr"].strip().splitlines()[-1])
    d.update({"cold_first_token_s": r["first_output_s"], "peak_rss_mb": r["peak_rss_mb"]})
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    a = ap.parse_args()
    model = a.model or default_model_path()
    py = None if a.no_llama else llama_python()
    ours(model, "warm-up", 2, a.threads)  # builds the tokenizer cache and the kernels once
    rows, raw = [], {}
    for kind, prompt in PROMPTS.items():
        runs = {"gemmaspec": [ours(model, prompt, a.n, a.threads) for _ in range(a.repeats)]}
        if py:
            runs["llama.cpp"] = [llama(py, model, prompt, a.n, a.threads) for _ in range(a.repeats)]
        raw[kind] = runs
        med = {eng: {k: median([r.get(k) for r in rs]) for k in
                     ("prefill_tps", "decode_tps", "cold_first_token_s", "peak_rss_mb", "prompt_tokens")}
               for eng, rs in runs.items()}
        for eng, m in med.items():
            ratio = (m["decode_tps"] / med["llama.cpp"]["decode_tps"]) if "llama.cpp" in med and eng == "gemmaspec" else None
            rows.append((kind, eng, m, ratio))
    lines = [f"Machine: {machine()['cpu']}, {machine()['cores']} cores; {a.threads} threads; greedy; {a.n} new tokens; "
             f"median of {a.repeats} cold runs per prompt; model {os.path.basename(str(model))}", "",
             "| prompt | engine | prompt tokens | prefill tok/s | decode tok/s | cold start → first token (s) | peak RSS (MB) | decode ours/llama.cpp |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for kind, eng, m, ratio in rows:
        lines.append(f"| {kind} | {eng} | {m['prompt_tokens']:.0f} | {m['prefill_tps']:.1f} | {m['decode_tps']:.1f} | "
                     f"{m['cold_first_token_s']:.2f} | {m['peak_rss_mb']:.0f} | {'' if ratio is None else f'{ratio:.2f}x'} |")
    write_results("decode", {"machine": machine(), "settings": vars(a) | {"model": str(model)}, "runs": raw}, "\n".join(lines))


if __name__ == "__main__":
    main()
