"""Speculative decoding speed on the real model: plain vs drafters and draft lengths, by text kind.

One process, engine loaded once; each configuration generates --n greedy tokens (EOS ignored) per
prompt, --repeats times, the configurations taking turns; medians reported. llama.cpp's plain decode on the same prompt runs in the
same invocation (cold process, llama-cpp-python), unless --no-llama.

    python benchmarks/speculative.py [--n 128] [--repeats 3] [-md DRAFT.gguf] [--no-llama]

Writes benchmarks/results/speculative.json and speculative.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from common import llama_python, machine, median, write_results

from gemmaspec.engine import RequestStats
from gemmaspec.loader import load_drafter, load_engine
from gemmaspec.loading.default_model import default_model_path
from gemmaspec.sampling import SamplingParams

PROMPTS = {
    "code": "Write a Python function that parses a CSV file and returns the rows as dictionaries.\n",
    "rewrite": "Rewrite the following list in the same order, with each line prefixed by a dash:\n"
               + "".join(f"item number {i}: the quick brown fox jumps over the lazy dog\n" for i in range(1, 12))
               + "Rewritten list:\n",
    "json": 'Convert to JSON: name Alice, age 30, city Paris.\n{"name": "Alice", "age": 30, "city": "Paris"}\n'
            "Convert to JSON: name Bob, age 25, city Rome.\n",
    "prose": "Write a short story about a robot who learns to paint.\n",
    "qa": "Question: Why is the sky blue?\nAnswer:",
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("-md", "--model-draft", default=None, help="also measure draft-simple with this draft model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-llama", action="store_true")
    a = ap.parse_args()
    model = a.model or str(default_model_path())
    engine = load_engine(model, ctx_size=2048, device="cpu", threads=a.threads)
    configs = [("plain", "none", 0)] + [(f"ngram n={n}", "ngram-simple", n) for n in (1, 2, 3, 4)]
    configs.append(("ngram auto", "ngram-simple", "auto"))
    if a.model_draft:
        configs += [(f"draft n={n}", "draft-simple", n) for n in (2, 3)]
    drafters = {}
    for name, st, _ in configs:
        drafters[name] = load_drafter(st, engine, a.model_draft if st == "draft-simple" else None)
    params = SamplingParams(temperature=0, max_tokens=a.n, ignore_eos=True)
    engine.forward_costs()
    results, lines = {}, []
    llama_py = None if a.no_llama else llama_python()
    for kind, prompt in PROMPTS.items():
        ids = engine.tokenizer.encode(prompt)
        results[kind] = {}
        runs = {name: [] for name, _, _ in configs}
        for _ in range(a.repeats):  # round-robin, so drift on a shared machine hits every config alike
            for name, _, n_max in configs:
                st = RequestStats()
                for _ev in engine.generate(ids, params, drafters[name], n_max, st):
                    pass
                runs[name].append({"decode_tps": st.decode_tps, **st.spec.to_dict()})
        for name, _, _ in configs:
            rs = runs[name]
            results[kind][name] = {"runs": rs, "decode_tps": median([r["decode_tps"] for r in rs]),
                                   "acceptance_rate": rs[-1]["acceptance_rate"],
                                   "mean_accepted_length": rs[-1]["mean_accepted_length"]}
            print(kind, name, f"{results[kind][name]['decode_tps']:.1f} tok/s", file=sys.stderr)
        if llama_py:
            from decode import llama

            lr = [llama(llama_py, model, prompt, a.n, a.threads)["decode_tps"] for _ in range(a.repeats)]
            results[kind]["llama.cpp plain"] = {"decode_tps": median(lr)}
    names = [c[0] for c in configs] + ([] if a.no_llama else ["llama.cpp plain"])
    lines.append(f"Machine: {machine()['cpu']}, {machine()['cores']} cores; {a.threads} threads; greedy; {a.n} tokens "
                 f"(EOS ignored); median of {a.repeats}; model {os.path.basename(model)}. Cells: decode tokens/s "
                 "(speedup over our plain; acceptance rate, mean accepted length).")
    lines += ["", "| prompt | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for kind, res in results.items():
        base = res["plain"]["decode_tps"]
        cells = []
        for n in names:
            r = res[n]
            if n in ("plain", "llama.cpp plain") or "acceptance_rate" not in r:
                cells.append(f"{r['decode_tps']:.1f}")
            else:
                cells.append(f"{r['decode_tps']:.1f} ({r['decode_tps'] / base:.2f}x; {r['acceptance_rate']:.2f}, "
                             f"{r['mean_accepted_length']:.2f})")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    write_results("speculative", {"machine": machine(), "settings": vars(a) | {"model": model}, "results": results},
                  "\n".join(lines))


if __name__ == "__main__":
    main()
