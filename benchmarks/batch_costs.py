"""What the server's batched target forward costs on this machine: ``forward_batch`` over S slots, each at
a context of C tokens, with r rows per slot (r = 1: every slot decodes; r = n + 1: every slot verifies n
draft tokens), a few mixed rounds (one slot of 8 verifying 1 or 2 drafts, the rest decoding), and a
prefill; medians of repeated timings in one process, the model loaded as the server loads it
(``load_checkpoint``: ``--act-quant auto``'s choices per weight).

These are the verify costs the draft-length chooser weighs (docs/server.md, "Draft length per round"):
an extra row is worth drafting when its expected accepted tokens pay for it.

    python benchmarks/batch_costs.py [-m MODEL] [--slots 1,4,8] [--rows 1,2,3,4] [--ctx 100]
                                     [--repeats 7] [--prefill 256] [--threads 2] --out NAME

Writes benchmarks/results/<out>.json and .md (machine: CPU model and SIMD flags).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

from common import machine, median, write_results

from gemmaspec.kernels import act_quant
from gemmaspec.loading import load_checkpoint, product_weights
from gemmaspec.loading.engine import set_threads


def _ids(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(1000, 200_000, (n,), generator=g)


def timed(model, caches, spec: list[int], ctx: int, g, repeats: int) -> float:
    """Median ms of one forward_batch with spec[i] new rows on cache i (all logits, as a verify), each
    followed by a rollback to ``ctx``."""
    times = []
    for _ in range(repeats + 1):
        seqs = [(_ids(g, r), caches[i]) for i, r in enumerate(spec)]
        t0 = time.perf_counter()
        model.forward_batch(seqs, True)
        times.append((time.perf_counter() - t0) * 1e3)
        for i in range(len(spec)):
            caches[i].rollback(ctx)
    return median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the default model)")
    ap.add_argument("--slots", default="1,4,8")
    ap.add_argument("--rows", default="1,2,3,4", help="rows per slot (1 + draft tokens)")
    ap.add_argument("--ctx", type=int, default=100, help="tokens already in each slot's cache")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    set_threads(a.threads)
    model = load_checkpoint(a.model, role="target").model
    ws = [w for w in product_weights(model) if hasattr(w, "_q8")]  # the block-quantized matrices
    q8 = sum(w._q8() for w in ws)  # products multiplying int8 activations
    slots, rows = [int(x) for x in a.slots.split(",")], [int(x) for x in a.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    caches = [model.new_cache(a.ctx + 64) for _ in range(max(slots + [8]))]
    for c in caches:
        model.forward(_ids(g, a.ctx), c)
    for th in threading.enumerate():  # timings see the layouts a long-running server uses
        if th.name == "gemmaspec-regroup":
            th.join()
    cells = []
    for s in slots:
        for r in rows:
            ms = timed(model, caches, [r] * s, a.ctx, g, a.repeats)
            cells.append({"slots": s, "rows_per_slot": r, "rows": s * r, "ms": ms})
    for k in (1, 2, 4):  # one round of 8 slots where k of them verify one draft token
        ms = timed(model, caches, [2] * k + [1] * (8 - k), a.ctx, g, a.repeats)
        cells.append({"slots": 8, "rows_per_slot": None, "rows": 8 + k, "ms": ms})
    times = []
    for _ in range(3):
        c = model.new_cache(a.prefill + 8)
        t0 = time.perf_counter()
        model.forward(_ids(g, a.prefill), c)
        times.append(time.perf_counter() - t0)
    prefill_tps = a.prefill / median(times)
    base = {c["slots"]: c["ms"] for c in cells if c["rows_per_slot"] == 1}
    lines = [f"# Batched forward costs: {os.path.basename(a.model or 'default model')}", "",
             f"activations: process mode {act_quant()}, {q8} of {len(ws)} weight matrices' products in int8 (--act-quant "
             f"auto's choices), {a.threads} threads, context "
             f"{a.ctx} per slot, medians of {a.repeats}; prefill of {a.prefill} tokens: {prefill_tps:.0f} tokens/s", "",
             "| slots | rows per slot | rows | ms | ms per row over the decode round |", "|---:|---:|---:|---:|---:|"]
    for c in cells:
        extra = (c["ms"] - base[c["slots"]]) / (c["rows"] - c["slots"]) if c["rows"] > c["slots"] and c["slots"] in base else None
        lines.append(f"| {c['slots']} | {c['rows_per_slot'] or 'mixed'} | {c['rows']} | {c['ms']:.1f} | "
                     f"{'' if extra is None else f'{extra:.2f}'} |")
    write_results(a.out, {"machine": machine(), "model": a.model or "default", "threads": a.threads, "ctx": a.ctx,
                          "repeats": a.repeats, "act_quant": act_quant(), "int8_products": [q8, len(ws)], "cells": cells,
                          "prefill": {"tokens": a.prefill, "tokens_per_s": prefill_tps}}, "\n".join(lines))


if __name__ == "__main__":
    main()
