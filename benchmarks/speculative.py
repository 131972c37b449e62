"""Speculative decoding speed on the real model: plain vs drafters and draft lengths, by text kind.

A thin caller of `gemmaspec bench` (one measuring code path): one process, engine loaded once, one
user; greedy, --n tokens per request (EOS ignored) over the prompts below (three per text kind),
--repeats times with the configurations taking turns; ngram-simple (and draft-simple with -md, and
draft-mtp with the assistant shipped for the default model or --mtp PATH, and the two as one list:
ngram-simple,draft-mtp) at n-max 1, 2, 3, 4 and
auto, against no speculation; llama.cpp (llama-cpp-python, plain and its prompt-lookup decoding) side
by side unless --no-llama. Figures are defined in docs/benchmarks.md; with MTP, the cost of one
assistant draft step is measured after the sweep (mtp_step.json).

These PROMPTS are also the drafter's held-out evaluation prompts (gemmaspec.training reads them).

    python benchmarks/speculative.py [--n 128] [--repeats 3] [-md DRAFT.gguf] [--no-llama] [--mtp default|none|PATH]
    python benchmarks/speculative.py --render-only   # redraw report.md and the plots from results.json

Writes benchmarks/results/speculative/ (results.json, report.md, PNG plots). The older
benchmarks/results/speculative.json / .md (the README's table) came from this script's earlier,
self-contained version.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from common import ROOT, llama_python, median

from gemmaspec.cli import main as gemmaspec_main
from gemmaspec.engine import RequestStats
from gemmaspec.loading.engine import load_engine
from gemmaspec.manage.shipped import shipped_assistant
from gemmaspec.speculative.config import SpecConfig
from gemmaspec.speculative.plan import load_drafter
from gemmaspec.manage.default_model import default_model_path
from gemmaspec.sampling import SamplingParams

OUT = ROOT / "benchmarks" / "results" / "speculative"

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
    ap.add_argument("--render-only", action="store_true",
                    help="redraw report.md and the plots from benchmarks/results/speculative/results.json "
                         "(the MTP step line from mtp_step.json)")
    a = ap.parse_args()
    if a.render_only:
        rc = gemmaspec_main(["bench", "--report-only", "--out", str(OUT)])
        if rc == 0 and (OUT / "mtp_step.json").exists():
            drafts = json.loads((OUT / "results.json").read_text())["targets"][0].get("drafts") or {}
            mtp = (drafts.get("draft-mtp") or {}).get("path", "the MTP assistant")
            append_mtp_line(json.loads((OUT / "mtp_step.json").read_text()), mtp)
        sys.exit(rc)
    model = a.model or str(default_model_path())
    mtp = None if a.mtp == "none" else (shipped_assistant(model) if a.mtp == "default" else a.mtp)
    types = ["ngram-simple"] + (["draft-simple"] if a.model_draft else []) + (["draft-mtp"] if mtp else [])
    types += ["ngram-simple+draft-mtp"] if mtp else []  # n-gram where it matches, the assistant elsewhere
    with tempfile.TemporaryDirectory() as tmp:
        suite = Path(tmp) / "speculative.jsonl"
        suite.write_text("".join(json.dumps({"kind": k, "prompt": p}) + "\n" for k, ps in PROMPTS.items() for p in ps))
        argv = ["bench", "-m", model, "--suite", str(suite), "--spec-type", ",".join(types),
                "--spec-draft-n-max", "1,2,3,4,auto", "--users", "1", "--repeats", str(a.repeats),
                "--max-tokens", str(a.n), "-t", str(a.threads), "--out", str(OUT)]
        for d in (a.model_draft, mtp):
            if d:
                argv += ["-md", d]
        if not a.no_llama and llama_python():  # builds llama-cpp-python once if needed
            argv += ["--peer", "llama.cpp"]
        rc = gemmaspec_main(argv)
    if rc == 0 and mtp:
        engine = load_engine(model, ctx_size=2048, device="cpu", threads=a.threads)
        step = mtp_step_cost(engine, load_drafter(SpecConfig("draft-mtp", mtp), engine),
                             SamplingParams(temperature=0, max_tokens=a.n, ignore_eos=True))
        (OUT / "mtp_step.json").write_text(json.dumps(step, indent=2))
        append_mtp_line(step, mtp)
    print((OUT / "report.md").read_text() if (OUT / "report.md").exists() else "", end="")
    sys.exit(rc)


def append_mtp_line(step: dict, mtp: str) -> None:
    """Add the assistant's measured draft-step cost (``mtp_step_cost``) to report.md."""
    line = (f"MTP assistant {os.path.basename(mtp)}: one draft step {step['step_ms']:.2f} ms "
            f"= {step['fraction_of_target_step']:.3f} of a target decode step ({step['target_step_ms']:.1f} ms); "
            f"weights {step['weights_mib']:.1f} MiB.")
    with open(OUT / "report.md", "a") as f:
        f.write("\n" + line + "\n")


def mtp_step_cost(engine, drafter, params) -> dict:
    """Median wall time of one assistant draft step (``assistant.draft_step``: the step and the greedy
    pick, as ``MTPDrafter`` runs it) during a greedy run, against
    the median target decode step of a plain run on the same prompt; the assistant's weight bytes."""
    import time

    asst = drafter.assistant
    times = []
    name = "draft_step_p" if drafter.p_min > 0 else "draft_step"  # what MTPDrafter calls
    orig = getattr(asst, name)

    def timed(*args, **kw):
        t = time.perf_counter()
        r = orig(*args, **kw)
        times.append(time.perf_counter() - t)
        return r

    ids = engine.tokenizer.encode(PROMPTS["prose"][0])
    setattr(asst, name, timed)
    try:
        st = RequestStats()
        for _ev in engine.generate(ids, params, drafter, n_max=3, stats=st):
            pass
    finally:
        delattr(asst, name)
    plain = RequestStats()
    for _ev in engine.generate(ids, params, stats=plain):
        pass
    step = median(times) * 1e3
    target = plain.decode_ms / max(1, plain.generated_tokens - 1)
    nbytes = sum(int(getattr(w, "nbytes", 0)) for w in asst.weights.values())
    return {"step_ms": step, "target_step_ms": target, "fraction_of_target_step": step / target,
            "weights_mib": nbytes / 2**20}


if __name__ == "__main__":
    main()
