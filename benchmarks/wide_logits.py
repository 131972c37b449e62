"""What a wide round's logits cost with and without kept output buffers (``kernels/outbuf.py``): the
default model's output head (262,144 x 640) over R rows plus an argmax per row, the two ways
alternating in one process (the pool on: outputs of 32 MiB and more on kept buffers; off: every
output fresh, as glibc maps them), medians. Run in a thread, as the server's scheduler runs.

    python benchmarks/wide_logits.py [--rows 16,24,32,40,48] [--repeats 40] --out NAME

Writes benchmarks/results/<out>.json and .md (machine: CPU model and SIMD flags).
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from common import machine, median, write_results

import gemmaspec.kernels.outbuf as outbuf
from gemmaspec.loading.engine import load_engine
from gemmaspec.models.base import linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,24,32,40,48")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = load_engine(None, ctx_size=1024).model
    rows_list = [int(r) for r in a.rows.split(",")]
    got: dict[int, dict[str, float]] = {}
    kept = outbuf.MIN_BYTES

    def work() -> None:
        for rows in rows_list:
            x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
            times = {"fresh": [], "kept": []}
            for _ in range(a.repeats):
                for way in ("fresh", "kept"):
                    outbuf.MIN_BYTES = kept if way == "kept" else 1 << 62
                    t = time.perf_counter()
                    y = linear(model.head, x)
                    y.numpy().argmax(-1)
                    del y
                    times[way].append(time.perf_counter() - t)
            got[rows] = {w: median(v) * 1e3 for w, v in times.items()}
        outbuf.MIN_BYTES = kept

    th = threading.Thread(target=work)
    th.start()
    th.join()
    lines = [f"# Output head + argmax over R rows, outputs fresh or on kept buffers (ms, medians of {a.repeats}, "
             "alternating)", "", f"Machine: {machine()['cpu']}, {torch.get_num_threads()} threads.", "",
             "| rows | logits MiB | fresh | kept |", "|---:|---:|---:|---:|"]
    for rows, v in got.items():
        lines.append(f"| {rows} | {rows * model.head.shape[0] * 4 / 2**20:.0f} | {v['fresh']:.1f} | {v['kept']:.1f} |")
    write_results(a.out, {"machine": machine(), "repeats": a.repeats, "ms": got}, "\n".join(lines))


if __name__ == "__main__":
    main()
