"""Exact Q4_0 packing speed, memory and the evidence it reports, on synthetic QAT checkpoints.

Builds BF16 GGUF checkpoints of the given sizes whose weights lie on a 4-bit grid per 32-value block
(random levels × random bf16 steps, rounded to bf16, like Google's ``-qat-q4_0-unquantized``
exports; 4096-wide rows, 1 % of the tensors ordinary non-QAT weights that must fall back), then runs
``gemmaspec quantize --exact`` on each in a fresh process: throughput (MB of source per second),
peak RSS of that process, file sizes and error figures against Q8_0 and amax/8 Q4_0.

    python benchmarks/quantize.py [--sizes-gb 0.5 2] [--threads 2] [--keep]

Writes benchmarks/results/quantize.json and quantize.md. Files go to $GEMMASPEC_HOME/bench/quantize
and are removed afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from common import machine, write_results

from gemmaspec.loading.gguf_out import StreamingGGUF
from gemmaspec.paths import cache_home

ROW = 4096


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bf16 bits, round to nearest even (finite values)."""
    b = x.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def make_checkpoint(path: Path, size_bytes: int, seed: int = 0) -> int:
    """A BF16 GGUF of ~size_bytes of 4096-wide QAT weights (tensors of 4096 x 4096); returns its size."""
    rng = np.random.default_rng(seed)
    n_tensors = max(1, size_bytes // (ROW * ROW * 2))
    with StreamingGGUF(path, "llama", force=True) as s:
        for i in range(n_tensors):
            s.begin(f"blk.{i}.ffn_up.weight", (ROW, ROW), T.BF16)
            for r0 in range(0, ROW, 512):
                if i % 100 == 99:  # an ordinary weight: no grid, goes to the fallback
                    w = rng.standard_normal((512, ROW), dtype=np.float32) * 0.02
                else:
                    lv = rng.integers(-8, 8, (512, ROW // 32, 32), dtype=np.int8).astype(np.float32)
                    step = (2.0 ** rng.uniform(-9, -5, (512, ROW // 32, 1))).astype(np.float32)
                    step = (_bf16_bits(step).astype(np.uint32) << 16).view(np.float32)
                    w = (step * lv).reshape(512, ROW)
                s.write(_bf16_bits(w))
            s.end()
        return s.finish(lambda w: w.add_uint32("llama.block_count", n_tensors))


def run_quantize(src: Path, out: Path, threads: int) -> dict:
    """`gemmaspec quantize --exact` in a fresh process: seconds, peak RSS (MiB), the report."""
    report = out.with_suffix(".json")
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "gemmaspec", "quantize", "--exact", str(src), str(out), "--force",
                          "--report", str(report), "-t", str(threads)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(res.stderr)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:
        print("warning: peak RSS not attributable (an earlier child was larger)", file=sys.stderr)
    return {"wall_s": wall, "peak_rss_mib": peak / 1024, "report": json.loads(report.read_text())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-gb", type=float, nargs="+", default=[2.0, 0.5])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    work = cache_home() / "bench" / "quantize"
    work.mkdir(parents=True, exist_ok=True)
    rows, results = [], []
    for gb in a.sizes_gb:  # largest first, so each child's peak RSS is its own (ru_maxrss is a maximum)
        src, out = work / f"qat-{gb}gb.gguf", work / f"qat-{gb}gb-q4_0.gguf"
        size = make_checkpoint(src, int(gb * 1e9))
        r = run_quantize(src, out, a.threads)
        rep, tot = r["report"], r["report"]["total"]
        b = tot["bytes"]
        row = {
            "source_gb": size / 1e9, "seconds": rep["seconds"], "mb_per_s": size / 1e6 / rep["seconds"],
            "wall_s": r["wall_s"], "peak_rss_mib": r["peak_rss_mib"],
            "blocks_on_grid": tot["blocks_on_grid"], "blocks": tot["blocks"],
            "values_exact_fraction": tot["values_exact"] / tot["values"],
            "tensors_q4_0": tot["tensors_q4_0"], "tensors_fallback": tot["tensors_fallback"],
            "rel_err": {"exact_q4_0": tot["exact_q4_0"]["rel_err"], "q8_0": tot["q8_0"]["rel_err"],
                        "q4_0_amax": tot["q4_0_amax"]["rel_err"]},
            "max_err_ulp_exact": tot["exact_q4_0"]["max_err_ulp"],
            "bytes": b,
        }
        results.append(row)
        rows.append(f"| {row['source_gb']:.2f} | {row['mb_per_s']:.0f} | {row['peak_rss_mib']:.0f} | "
                    f"{row['blocks_on_grid']}/{row['blocks']} | {row['values_exact_fraction']:.1%} | "
                    f"{row['max_err_ulp_exact']:.2f} | {row['rel_err']['exact_q4_0']:.2e} | {row['rel_err']['q8_0']:.2e} | "
                    f"{row['rel_err']['q4_0_amax']:.2e} | {b['exact_q4_0'] / 1e6:.0f} / {b['q8_0'] / 1e6:.0f} / {b['source'] / 1e6:.0f} |")
        print(rows[-1], flush=True)
        if not a.keep:
            src.unlink()
            out.unlink()
    header = (f"Machine: {machine()['cpu']}, {machine()['cores']} cores; {a.threads} threads; `gemmaspec quantize --exact` in a fresh process per "
              "checkpoint (BF16 GGUF, 4096x4096 QAT tensors, 1 in 100 an ordinary weight that falls back to Q8_0). "
              "Errors relative to the source (Frobenius); Q8_0 and amax/8 Q4_0 via gguf.quants on every 16th row.\n\n"
              "| source GB | MB/s | peak RSS MiB | blocks on grid | values bit-exact | worst ulp | rel err exact Q4_0 | "
              "rel err Q8_0 | rel err amax/8 Q4_0 | MB exact Q4_0 / Q8_0 / source |\n|" + "---:|" * 10)
    write_results("quantize", {"machine": machine(), "threads": a.threads, "runs": results}, header + "\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
