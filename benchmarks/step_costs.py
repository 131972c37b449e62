"""What one target forward costs at a given context: decode (1 row), verify (k+1 rows), prefill, and an
MTP assistant's draft step, in one process on one model, medians of repeated timings.

Speculative decoding's speedup follows from these costs: a round drafts k tokens (k draft steps), then
verifies them in one forward of k+1 rows; at mean accepted length A (tokens per round, bonus included)
the projected speedup over plain decoding is

    A * t(1) / (t(k+1) + k * t_draft)

where t(n) is the forward over n rows at that context. The script prints t(k+1)/t(1) for k = 1..7 (the
verify cost curve) at each context, and the projection at the given acceptance (``--accept``, default
the seed article's measured 2.68 at draft length 2), labelled a projection.

Contexts are filled by a prefill of random token ids (chunked as the engine does); every timing is a
forward of fresh rows at that context followed by a rollback (the KV cache's own), so every repeat sees
the same context length.

    python benchmarks/step_costs.py -m MODEL.gguf [-md ASSISTANT.gguf] [--ctx 0,512,2048] [--threads 2]
                                    [--repeats 7] [--prefill 512] [--out NAME]

Writes benchmarks/results/<out>.json and .md (machine: CPU model and SIMD flags).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time

import torch

from common import machine, median, write_results

from gemmaspec.kernels import auto_q8_head, auto_q8_layers, resolve_act_quant
from gemmaspec.loading import product_weights
from gemmaspec.loading.engine import set_threads, step_bytes
from gemmaspec.loading.gguf import load_gguf
from gemmaspec.models.base import PREFILL_CHUNK


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, min(vocab, 200_000), (n,), generator=g)


def fill(model, cache, n: int, vocab: int):
    """Prefill n random tokens in chunks; returns (seconds, last forward output)."""
    ids = _ids(n, vocab, 1)
    t0 = time.perf_counter()
    out = None
    for s in range(0, n, PREFILL_CHUNK):
        out = model.forward(ids[s:s + PREFILL_CHUNK], cache)
    return time.perf_counter() - t0, out


def timed_forward(model, cache, rows: int, vocab: int, repeats: int) -> float:
    """Median ms of a forward over ``rows`` new tokens at the cache's length (all logits, as verify)."""
    base = cache.length
    ids = _ids(rows, vocab, 2)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        model.forward(ids, cache, all_logits=rows > 1)
        times.append((time.perf_counter() - t0) * 1e3)
        cache.rollback(base)
    return median(times[1:])


def draft_ms(target, assistant_path: str, cache, repeats: int) -> float | None:
    """Median ms of one assistant draft step (greedy, no p-min) over the target's cache, as the MTP
    drafter runs it (its KV view of the cache, one thread for the small ops)."""
    from gemmaspec.kernels import ops_on_one_thread
    from gemmaspec.speculative.drafters import MTPDrafter

    asst = load_gguf(assistant_path).model
    drafter = MTPDrafter(asst, target, cache)
    p = cache.length
    kv = drafter.target_kv(p)
    h = torch.randn(target.config.hidden_size)
    times = []
    with torch.inference_mode(), ops_on_one_thread():
        rope = asst.rope_at(p)
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            asst.draft_step(target.embed_row(1234), h, p, kv, rope)
            times.append((time.perf_counter() - t0) * 1e3)
    return median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-md", "--model-draft", default="")
    ap.add_argument("--ctx", default="0,512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefill", default="512", help="prefill lengths to time (comma list)")
    ap.add_argument("--max-k", type=int, default=7)
    ap.add_argument("--accept", type=float, default=2.68, help="mean accepted length for the projection")
    ap.add_argument("--accept-k", type=int, default=2, help="draft length that acceptance was measured at")
    ap.add_argument("--out", default="step_costs")
    a = ap.parse_args()
    set_threads(a.threads)
    t0 = time.perf_counter()
    loaded = load_gguf(a.model)
    load_s = time.perf_counter() - t0
    model, vocab = loaded.model, loaded.config.vocab_size
    act = resolve_act_quant(step_bytes(model))  # as load_engine does: --act-quant auto by the model's size
    head = getattr(model, "head", None)
    if auto_q8_head(step_bytes(model), head):  # as load_checkpoint does
        act += " (head q8_0)"
    if auto_q8_layers(step_bytes(model), [w for w in product_weights(model) if w is not head]):
        act += " (x8 layers q8_0)"
    warm = model.new_cache(64)
    model.forward(_ids(8, vocab, 0), warm)  # compiles the kernel if needed, starts the background regroup
    for th in threading.enumerate():  # timings below see the regrouped layout, as a long-running process does
        if th.name == "gemmaspec-regroup":
            th.join()
    model.forward(_ids(1, vocab, 0), warm)  # puts the regrouped copies in use
    ctxs = [int(x) for x in a.ctx.split(",")]
    result = {"machine": machine(), "model": os.path.basename(a.model), "threads": a.threads, "load_s": load_s,
              "act_quant": act,
              "prefill": {}, "contexts": {}}
    for n in (int(x) for x in a.prefill.split(",") if x):
        fill(model, model.new_cache(n + 16), 64, vocab)  # warm
        s, _ = fill(model, model.new_cache(n + 16), n, vocab)
        result["prefill"][n] = {"tokens_per_s": n / s}
        print(f"prefill {n}: {n / s:.1f} tokens/s", file=sys.stderr)
    cap = max(ctxs) + a.max_k + 16
    cache = model.new_cache(cap)
    for ctx in sorted(ctxs):
        if ctx > cache.length:
            fill(model, cache, ctx - cache.length, vocab)
        t = {k + 1: timed_forward(model, cache, k + 1, vocab, a.repeats) for k in range(0, a.max_k + 1)}
        row = {"decode_ms": t[1], "decode_tokens_per_s": 1e3 / t[1],
               "verify_ratio": {k: t[k + 1] / t[1] for k in range(1, a.max_k + 1)}, "forward_ms": t}
        d = draft_ms(model, a.model_draft, cache, a.repeats) if a.model_draft else None
        if d is not None:
            row["draft_ms"] = d
        k = a.accept_k
        row["projection"] = {"k": k, "accepted_length": a.accept,
                             "speedup": a.accept * t[1] / (t[k + 1] + k * (d or 0.0))}
        result["contexts"][ctx] = row
        print(f"ctx {ctx}: decode {t[1]:.1f} ms ({1e3 / t[1]:.2f} tok/s); verify t(k+1)/t(1) "
              + " ".join(f"{row['verify_ratio'][k]:.2f}" for k in range(1, a.max_k + 1))
              + (f"; draft {d:.2f} ms" if d is not None else "")
              + f"; projected MTP at A={a.accept} k={k}: {row['projection']['speedup']:.2f}x", file=sys.stderr)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    m = result["machine"]
    lines = [f"# Step costs: {result['model']}", "",
             f"Machine: {m.get('cpu', '?')}, {a.threads} threads, activations {act}. Load {load_s:.1f} s. "
             f"Medians of {a.repeats}.", "",
             "| context | decode ms | tok/s | " + " | ".join(f"t({k + 1})/t(1)" for k in range(1, a.max_k + 1))
             + " | draft ms | projected MTP |",
             "|---:|---:|---:|" + "---:|" * a.max_k + "---:|---:|"]
    for ctx, r in result["contexts"].items():
        lines.append(f"| {ctx} | {r['decode_ms']:.1f} | {r['decode_tokens_per_s']:.2f} | "
                     + " | ".join(f"{r['verify_ratio'][k]:.2f}" for k in range(1, a.max_k + 1))
                     + f" | {r.get('draft_ms', float('nan')):.2f} | {r['projection']['speedup']:.2f}x |")
    lines += ["", f"Peak RSS {result['peak_rss_mib']:.0f} MiB.", "", "Prefill: " + ", ".join(f"{n} tokens {v['tokens_per_s']:.1f} tokens/s"
                                         for n, v in result["prefill"].items()),
              "", f"Projected MTP = A t(1) / (t(k+1) + k t_draft) at A = {a.accept}, k = {a.accept_k} "
              "(the seed article's measured acceptance): a projection from measured costs, not a measured speedup."]
    write_results(a.out, result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
