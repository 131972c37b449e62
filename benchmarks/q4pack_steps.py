"""The exact-Q4_0 packer on one synthetic QAT tensor: time, values bit-exact, error against Q8_0's.

A tensor of ROWS x COLS bf16 values bf16(s * level) per 32-value block, the step s per block either a
bf16 number (fp16 holds it: a bit-exact fit exists) or a float32 number (fp16 holds none: the packer
keeps the step reproducing the most values after bf16 rounding); levels uniform in [-8, 7] or
Gaussian (sd 2, trained weights). For each: the packer's CPU seconds (`pack_exact`, C backend, the
minimum of --repeats runs), the share of values bit-exact after bf16 rounding and in float32, the
worst error in bf16 ulps, the relative error and llama.cpp's Q8_0 relative error (gguf.quants, every
16th row) with their ratio. Everything is computed from the packer's d and levels, so the script
measures any version of gemmaspec on the path:

    python benchmarks/q4pack_steps.py [--rows 2048] [--cols 8192] [--threads 1] [--repeats 3]
    PYTHONPATH=/path/to/old/src python benchmarks/q4pack_steps.py     # an older packer, same numbers

Prints one JSON line per case and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

from gemmaspec.quant.q4_0_exact import pack_exact


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bf16 (nearest even), as float32."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)


def tensor(rows: int, cols: int, step: str, levels: str, seed: int = 0) -> np.ndarray:
    """float32 [rows, cols] holding bf16 QAT values (see the module docstring)."""
    rng = np.random.default_rng(seed)
    nb = cols // 32
    if levels == "uniform":
        lv = rng.integers(-8, 8, (rows, nb, 32)).astype(np.float32)
    else:
        lv = np.clip(np.rint(rng.normal(0, 2, (rows, nb, 32))), -8, 7).astype(np.float32)
    s = (2.0 ** rng.uniform(-9, -5, (rows, nb, 1))).astype(np.float32)
    if step == "bf16":
        s = bf16(s)
    return bf16(s * lv).reshape(rows, cols)


def measure(w: np.ndarray, threads: int, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        r = pack_exact(w, 7, backend="c", threads=threads)
        times.append(time.process_time() - t0)
    v = w.reshape(-1, 32)
    recon = r.d.astype(np.float32)[:, None] * r.levels.astype(np.float32)
    ulp = np.spacing(np.abs(v)).astype(np.float64) * 2.0**16
    rel = np.linalg.norm((recon - v).astype(np.float64)) / np.linalg.norm(v.astype(np.float64))
    rows = w[::16]
    q8 = quants.dequantize(quants.quantize(rows, T.Q8_0), T.Q8_0).astype(np.float64)
    rel_q8 = np.linalg.norm(q8 - rows) / np.linalg.norm(rows.astype(np.float64))
    sample = recon.reshape(w.shape)[::16].astype(np.float64)
    rel_rows = np.linalg.norm(sample - rows) / np.linalg.norm(rows.astype(np.float64))
    return {"cpu_s": min(times), "cpu_s_runs": times, "bit_exact_bf16": float((bf16(recon) == v).mean()),
            "bit_exact_f32": float((recon == v).mean()), "on_grid": float(r.on_grid.mean()),
            "max_err_ulp": float((np.abs(recon - v) / ulp).max()), "rel_err": float(rel),
            "rel_err_q8_0": float(rel_q8), "closer_than_q8_0": float(rel_q8 / rel_rows)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    lines = ["| step | levels | CPU s | bit-exact after bf16 rounding | in float32 | worst ulp | rel err | Q8_0 | vs Q8_0 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for step in ("float32", "bf16"):
        for levels in ("uniform", "gauss"):
            res = {"rows": a.rows, "cols": a.cols, "threads": a.threads, "step": step, "levels": levels,
                   **measure(tensor(a.rows, a.cols, step, levels), a.threads, a.repeats)}
            print(json.dumps(res), flush=True)
            lines.append(f"| {step} | {levels} | {res['cpu_s']:.2f} | {res['bit_exact_bf16']:.2%} | {res['bit_exact_f32']:.2%} | "
                         f"{res['max_err_ulp']:.2f} | {res['rel_err']:.3e} | {res['rel_err_q8_0']:.3e} | "
                         f"{res['closer_than_q8_0']:.2f}x |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
