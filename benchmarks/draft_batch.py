"""What one batched MTP draft step costs for 1, 2, 4, 8 slots (``gs_assistant_steps``: the server's
batched drafting), against one slot's step; and what a whole drafting round costs when every one of the
B slots drafts ``--round-tokens`` tokens (``speculative.batch.mtp_batch``, Python's part included: the
server's drafting when the chooser drafts every slot in full): the issue-32 figure "draft cost per round
at 8 slots / 1 slot".

Each slot is a request on the default model (or -m) with its own KV cache, prefilled with a prompt of a
different length (contexts ~20-140 tokens by default, --words to lengthen), and the shipped assistant
(or -md) drafts one step for the first B of them at once; best and median of --repeats calls per B,
in both activation modes of the assistant (``--act none,q8_0``: fp32, and int8 as ``auto`` picks).

    python benchmarks/draft_batch.py [-m MODEL.gguf] [-md ASSISTANT.gguf] [--rows 1,2,4,8]
                                     [--repeats 60] [--words 100] [--act none,q8_0] [--out draft_batch]

Writes benchmarks/results/<out>.json and .md (machine: CPU model and SIMD flags).
"""

from __future__ import annotations

import argparse
import time

import torch

from common import machine, median, write_results

from gemmaspec import kernels
from gemmaspec.engine import RequestState
from gemmaspec.loading.engine import load_engine, set_threads
from gemmaspec.manage.default_model import default_model_path
from gemmaspec.models import assistant_step
from gemmaspec.request import RequestOptions
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.batch import mtp_batch
from gemmaspec.speculative.config import SpecConfig
from gemmaspec.speculative.plan import build, plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-md", "--model-draft", default=None, help="assistant GGUF (default: the shipped one)")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--words", type=int, default=100, help="length of the longest slot's prompt, in words")
    ap.add_argument("--act", default="none,q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--round-tokens", type=int, default=3, help="tokens each slot drafts in the round timing")
    ap.add_argument("--out", default="draft_batch")
    args = ap.parse_args()
    rows_list = [int(x) for x in args.rows.split(",")]
    set_threads(args.threads)
    engine = load_engine(args.model or default_model_path(), ctx_size=2048, device="cpu")
    factory = build(plan(SpecConfig("draft-mtp", draft_model=args.model_draft, p_min=0.0), engine.model_path), engine)
    words = " ".join(f"item{i}" for i in range(args.words))
    n = max(rows_list)
    slots, jobs = [], []
    for i in range(n):
        prompt = f"Prompt number {i}: " + words[: max(1, len(words) * (i + 1) // n)]
        cache = engine.model.new_cache(engine.ctx_size, engine.max_rollback)
        st = RequestState(engine, engine.tokenizer.encode(prompt),
                          RequestOptions(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)), None, cache=cache)
        st.prefill()
        st.finish_round(engine.model.forward(st.begin_round().tokens, cache))
        d = factory(cache)
        ctx = st.draft_context()
        p = len(ctx.tokens) - 1
        slots.append((engine.model.embed_row(ctx.tokens[-1]), ctx.hidden, p, d.target_kv(p), d.assistant.rope_at(p)))
        jobs.append((d, ctx, args.round_tokens))
    a = d.assistant
    results = []
    for act in args.act.split(","):
        kernels.set_act_quant(act)
        with torch.inference_mode():
            for b in rows_list:
                part = slots[:b]
                x = torch.stack([s[0] for s in part])
                h = torch.stack([s[1] for s in part])
                kv, ropes = [s[3] for s in part], [s[4] for s in part]
                if assistant_step.run_steps(a, x, h, kv, ropes) is None:
                    raise SystemExit("the batched C draft step does not apply to this assistant (no reduced Q4_0 head)")
                ts = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    assistant_step.run_steps(a, x, h, kv, ropes)
                    ts.append((time.perf_counter() - t) * 1e3)
                results.append({"act": act, "rows": b, "best_ms": min(ts), "median_ms": median(ts)})
    kernels.set_act_quant("auto")  # the server's mode: int8 drafting
    rounds = []
    for b in rows_list:
        mtp_batch(jobs[:b])
        ts = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            mtp_batch(jobs[:b])
            ts.append((time.perf_counter() - t) * 1e3)
        rounds.append({"slots": b, "tokens": args.round_tokens, "best_ms": min(ts), "median_ms": median(ts)})
    m = machine()
    lines = [f"# Batched MTP draft step: {m.get('cpu', '?')}, {args.threads} threads",
             "", f"contexts of the slots: {[s[2] for s in slots]}; {args.repeats} calls per cell", "",
             "| activations | rows | best ms | median ms | best / 1 row |", "|---|---:|---:|---:|---:|"]
    for r in results:
        one = next(x for x in results if x["act"] == r["act"] and x["rows"] == rows_list[0])
        lines.append(f"| {r['act']} | {r['rows']} | {r['best_ms']:.3f} | {r['median_ms']:.3f} | "
                     f"{r['best_ms'] / one['best_ms']:.2f}x |")
    lines += ["", f"A drafting round (`mtp_batch`, `--act-quant auto`), every slot drafting {args.round_tokens} tokens:",
              "", "| slots | best ms | median ms | median / 1 slot |", "|---:|---:|---:|---:|"]
    for r in rounds:
        lines.append(f"| {r['slots']} | {r['best_ms']:.3f} | {r['median_ms']:.3f} | "
                     f"{r['median_ms'] / rounds[0]['median_ms']:.2f}x |")
    write_results(args.out, {"machine": m, "threads": args.threads, "contexts": [s[2] for s in slots],
                             "results": results, "rounds": rounds}, "\n".join(lines))


if __name__ == "__main__":
    main()
