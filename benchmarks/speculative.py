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
from gemmaspec.loader import load_drafter, load_engine, shipped_assistant
from gemmaspec.loading.default_model import default_model_path
from gemmaspec.sampling import SamplingParams

PARAGRAPH = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
             "the members agreed to raise the library's funding by ten percent and to postpone the new parking lot "
             "until the spring. The chair thanked everyone for their patience and closed the meeting at nine.")
PROMPTS = {  # three prompts per text kind; a kind's speed is over all three (one prompt's alignment luck averages out)
    "code": [
        "Write a Python function that parses a CSV file and returns the rows as dictionaries.\n",
        "Write a JavaScript function that debounces another function, with comments.\n",
        "Write a SQL query that lists the ten customers with the highest total order value, then explain it.\n",
    ],
    "rewrite": [
        "Rewrite the following list in the same order, with each line prefixed by a dash:\n"
        + "".join(f"item number {i}: the quick brown fox jumps over the lazy dog\n" for i in range(1, 12))
        + "Rewritten list:\n",
        f"Repeat the following paragraph exactly.\n{PARAGRAPH}\nRepeated paragraph:\n",
        "Correct the spelling in this text and write it out in full:\nThe comittee met on tuesday to reveiw the "
        "budjet for the comming year. After a long discusion, the members agred to raise the librarys funding.\n"
        "Corrected text:\n",
    ],
    "json": [
        'Convert to JSON: name Alice, age 30, city Paris.\n{"name": "Alice", "age": 30, "city": "Paris"}\n'
        "Convert to JSON: name Bob, age 25, city Rome.\n",
        "Convert this table to a JSON array of objects:\nname | age | city\nAlice | 30 | Paris\nBob | 25 | Rome\n"
        "Carol | 41 | Berlin\nDave | 35 | Madrid\nJSON:\n",
        "Write a JSON object describing a book with the fields title, author, year, isbn and genres (a list).\n",
    ],
    "prose": [
        "Write a short story about a robot who learns to paint.\n",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.\n",
        "Describe a walk through a forest in autumn.\n",
    ],
    "qa": [
        "Question: Why is the sky blue?\nAnswer:",
        "Question: What causes the seasons on Earth?\nAnswer:",
        "Question: How does a vaccine train the immune system?\nAnswer:",
    ],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("-md", "--model-draft", default=None, help="also measure draft-simple with this draft model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--mtp", default="default",
                    help="MTP assistant GGUF for the draft-mtp columns ('default': the one shipped for the default "
                         "model, when the target is the default model; 'none': no MTP columns)")
    a = ap.parse_args()
    model = a.model or str(default_model_path())
    engine = load_engine(model, ctx_size=2048, device="cpu", threads=a.threads)
    configs = [("plain", "none", 0)] + [(f"ngram n={n}", "ngram-simple", n) for n in (1, 2, 3, 4)]
    configs.append(("ngram auto", "ngram-simple", "auto"))
    if a.model_draft:
        configs += [(f"draft n={n}", "draft-simple", n) for n in (2, 3)]
    mtp = None if a.mtp == "none" else (shipped_assistant(model) if a.mtp == "default" else a.mtp)
    if mtp:
        configs += [(f"mtp n={n}", "draft-mtp", n) for n in (1, 2, 3, 4)] + [("mtp auto", "draft-mtp", "auto")]
    drafters = {}
    for name, st, _ in configs:
        drafters[name] = load_drafter(st, engine, a.model_draft if st == "draft-simple" else mtp if st == "draft-mtp"
                                      else None)
    params = SamplingParams(temperature=0, max_tokens=a.n, ignore_eos=True)
    engine.forward_costs()
    results, lines = {}, []
    llama_py = None if a.no_llama else llama_python()
    names = [c[0] for c in configs]
    for kind, prompts in PROMPTS.items():
        per_prompt = []
        for prompt in prompts:
            ids = engine.tokenizer.encode(prompt)
            runs = {name: [] for name in names}
            for _ in range(a.repeats):  # round-robin, so drift on a shared machine hits every config alike
                for name, _, n_max in configs:
                    st = RequestStats()
                    for _ev in engine.generate(ids, params, drafters[name], n_max, st):
                        pass
                    runs[name].append({"decode_tps": st.decode_tps, "decode_s": st.decode_ms / 1e3,
                                       "decoded": st.generated_tokens - 1, **st.spec.to_dict()})
            rec = {"prompt": prompt, "configs": runs}
            if llama_py:
                from decode import llama

                rec["llama.cpp plain"] = [llama(llama_py, model, prompt, a.n, a.threads) for _ in range(a.repeats)]
            per_prompt.append(rec)
            print(kind, {n: round(median([r["decode_tps"] for r in runs[n]]), 1) for n in names}, file=sys.stderr, flush=True)
        results[kind] = {"prompts": per_prompt, "summary": _summary(per_prompt, names)}
    results["mixed (all 15)"] = {"summary": _summary([p for k in PROMPTS for p in results[k]["prompts"]], names)}
    if mtp:
        results["mtp_step"] = mtp_step_cost(engine, drafters["mtp n=3"], params)
        lines.append(f"MTP assistant {os.path.basename(mtp)}: one draft step {results['mtp_step']['step_ms']:.2f} ms "
                     f"= {results['mtp_step']['fraction_of_target_step']:.3f} of a target decode step "
                     f"({results['mtp_step']['target_step_ms']:.1f} ms); weights {results['mtp_step']['weights_mib']:.1f} MiB.")
        lines.append("")
    cols = names + ([] if a.no_llama else ["llama.cpp plain"])
    lines.append(f"Machine: {machine()['cpu']}, {machine()['cores']} cores; {a.threads} threads; greedy; {a.n} tokens "
                 f"(EOS ignored); three prompts per kind, each run {a.repeats} times (configurations taking turns); "
                 f"model {os.path.basename(model)}. Cells: decode tokens/s over the kind's prompts (total tokens / "
                 "total time, each prompt's median run) (speedup over our plain; acceptance rate, mean accepted length); "
                 "last column: auto against the best fixed n-max of that row.")
    lines += ["", "| text kind | " + " | ".join(cols) + " | auto / best fixed |", "|---|" + "---:|" * (len(cols) + 1)]
    for kind, res in results.items():
        if "summary" not in res:
            continue
        sm = res["summary"]
        base = sm["plain"]["tps"]
        cells = []
        for n in cols:
            r = sm.get(n)
            if r is None:
                cells.append("")
            elif n in ("plain", "llama.cpp plain"):
                cells.append(f"{r['tps']:.1f}")
            else:
                cells.append(f"{r['tps']:.1f} ({r['tps'] / base:.2f}x; {r['acceptance_rate']:.2f}, {r['mean_len']:.2f})")
        best = max(sm[n]["tps"] for n in names if n.startswith("ngram n="))
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {sm['ngram auto']['tps'] / best:.3f} |")
    write_results("speculative", {"machine": machine(), "settings": vars(a) | {"model": model}, "results": results},
                  "\n".join(lines))


def mtp_step_cost(engine, drafter, params) -> dict:
    """Median wall time of one assistant draft step (``assistant.step``) during a greedy run, against
    the median target decode step of a plain run on the same prompt; the assistant's weight bytes."""
    import time

    asst = drafter.assistant
    times = []
    orig = asst.step

    def timed(*args, **kw):
        t = time.perf_counter()
        r = orig(*args, **kw)
        times.append(time.perf_counter() - t)
        return r

    ids = engine.tokenizer.encode(PROMPTS["prose"][0])
    asst.step = timed
    try:
        st = RequestStats()
        for _ev in engine.generate(ids, params, drafter, 3, st):
            pass
    finally:
        del asst.step
    plain = RequestStats()
    for _ev in engine.generate(ids, params, None, 0, plain):
        pass
    step = median(times) * 1e3
    target = plain.decode_ms / max(1, plain.generated_tokens - 1)
    nbytes = sum(int(getattr(w, "nbytes", 0)) for w in asst.weights.values())
    return {"step_ms": step, "target_step_ms": target, "fraction_of_target_step": step / target,
            "weights_mib": nbytes / 2**20}


def _summary(per_prompt: list, names: list) -> dict:
    """Per configuration: tokens/s over the prompts (sum of decoded tokens / sum of each prompt's median
    decode time), pooled acceptance rate and mean accepted length."""
    out = {}
    for n in names:
        toks = secs = drafted = accepted = steps = 0
        for p in per_prompt:
            rs = sorted(p["configs"][n], key=lambda r: r["decode_s"])
            mid = rs[len(rs) // 2]
            toks += mid["decoded"]
            secs += mid["decode_s"]
            drafted += mid["draft_n"]
            accepted += mid["draft_n_accepted"]
            steps += mid["verify_steps"]
        out[n] = {"tps": toks / secs, "acceptance_rate": accepted / drafted if drafted else 0.0,
                  "mean_len": 1 + accepted / steps if steps else 1.0}
    if per_prompt and "llama.cpp plain" in per_prompt[0]:
        toks = secs = 0.0
        for p in per_prompt:
            rs = sorted(p["llama.cpp plain"], key=lambda r: r["decode_tps"])
            mid = rs[len(rs) // 2]
            toks += mid.get("n_decoded", 127)
            secs += mid.get("n_decoded", 127) / mid["decode_tps"]
        out["llama.cpp plain"] = {"tps": toks / secs}
    return out


if __name__ == "__main__":
    main()
