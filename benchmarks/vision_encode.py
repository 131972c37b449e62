"""Encode time and memory of one image through the vision towers at the released shapes (issue 35).

No real mmproj file can be downloaded here, and an encode's time depends on the shapes and storage
types, not on the values. So each tower is written as a synthetic mmproj GGUF in llama.cpp's layout
(``clip`` metadata through :func:`gemmaspec.loading.vision.add_mmproj_metadata`; matrices F16 as its
converter writes them, or F32; norms, biases and embeddings F32), random values ~ N(0, 1/in_features)
for matrices, one tensor at a time through :class:`~gemmaspec.loading.gguf_out.StreamingGGUF` (nothing
of the file's size held in memory), kept under ``$GEMMASPEC_HOME/bench/vision-synth`` for reuse.

Shapes (``TOWERS``):

- ``gemma3``: SigLIP-So400m as Gemma 3 4B/12B/27B ship it: 896 px, patch 14 (4,096 patches), 27
  layers of width 1152, MLP 4304, 16 heads; pooled to 256 soft tokens; projector to the text width
  (``--g3-text``: 2560 for 4B, 3840 for 12B, 5376 for 27B).
- ``gemma4``: transformers 5.25's ``Gemma4VisionConfig`` defaults (the E2B/E4B encoder): patch 16,
  16 layers of width 768, MLP 3072 (gated), 12 heads of 64 (no GQA), pooling 3, position table
  10,240, no clipped linears, no standardisation; the image processor's default budget of 280 soft
  tokens (2,520 patches); projector to the text width (``--g4-text``: 1536 for E2B, 2560 for E4B).

Each (tower, file type) is measured in a fresh process (so its peak RSS is its own): load the file
(:func:`~gemmaspec.loading.vision.load_vision`), then per image the whole path a request takes: PNG
bytes (a random 1024x768 RGB image) → :func:`gemmaspec.images.prepare` (decode, resize, normalise or
cut into patches) → ``model.embed`` (tower + projector), one warm-up, then the median of
``--repeats``, at PyTorch's default thread count. Reported: load time, first (cold) encode, median
encode (preprocess + tower) and its preprocess part, peak RSS, RSS after load, the tower's weights in
memory and on disk, FLOPs of one encode and the rate achieved, and how many cores other processes
kept busy meanwhile (``/proc/stat``: this machine is shared). ``--profile`` adds PyTorch's profiler
table of one encode (self time per op) and a split by kind (matmul, attention, ...).

The embeddings of each run are kept (``last-<tower>-<type>.pt``); ``--keep-reference`` stores them as
the reference that later runs (after a code change) are compared with (``rel_diff``).

    python benchmarks/vision_encode.py [--towers gemma3,gemma4] [--types f16,f32] [--repeats 3]
        [--profile] [--name vision_encode] [--keep-reference]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from common import bench_dir, cpu_busy_s, machine, median, write_results
from gemmaspec.loading.gguf_out import StreamingGGUF
from gemmaspec.loading.vision import add_mmproj_metadata
from gemmaspec.models.gemma3_vision import Gemma3VisionConfig
from gemmaspec.models.gemma4_vision import Gemma4VisionConfig

IMAGE = (1024, 768)  # width, height of the test image (4:3; Gemma 4 keeps the aspect: 57 x 42 patches)


def towers(g3_text: int, g4_text: int, layers: int | None = None) -> dict:
    """``{name: (projector type, config)}`` at the released shapes (see the module docstring); ``layers``
    (a quick check of this script) keeps only that many encoder layers."""
    out = {
        "gemma3": ("gemma3", Gemma3VisionConfig(image_size=896, patch_size=14, hidden_size=1152,
                                                intermediate_size=4304, num_layers=27, num_heads=16,
                                                text_hidden_size=g3_text)),
        "gemma4": ("gemma4v", Gemma4VisionConfig(patch_size=16, hidden_size=768, intermediate_size=3072,
                                                 num_layers=16, num_heads=12, text_hidden_size=g4_text,
                                                 head_dim=64, num_kv_heads=12, pooling_kernel=3,
                                                 position_embedding_size=10240, max_soft_tokens=280)),
    }
    return {k: (p, dataclasses.replace(c, num_layers=layers or c.num_layers)) for k, (p, c) in out.items()}


def tensor_shapes(projector: str, c) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name → shape in torch (numpy) order, as llama.cpp's converter writes the tower."""
    d, i = c.hidden_size, c.intermediate_size
    if projector == "gemma3":
        out = {"v.patch_embd.weight": (d, 3, c.patch_size, c.patch_size), "v.patch_embd.bias": (d,),
               "v.position_embd.weight": (c.patches_per_side ** 2, d), "v.post_ln.weight": (d,),
               "v.post_ln.bias": (d,), "mm.input_projection.weight": (d, c.text_hidden_size),
               "mm.soft_emb_norm.weight": (d,)}
        block = {"attn_q": (d, d), "attn_k": (d, d), "attn_v": (d, d), "attn_out": (d, d), "ln1": (d,),
                 "ln2": (d,), "ffn_up": (i, d), "ffn_down": (d, i)}
        for b in range(c.num_layers):
            for n, s in block.items():
                out[f"v.blk.{b}.{n}.weight"] = s
                out[f"v.blk.{b}.{n}.bias"] = (s[0],)
        return out
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"v.patch_embd.weight": (d, 3, c.patch_size, c.patch_size),
           "v.position_embd.weight": (2, c.position_embedding_size, d),
           "mm.input_projection.weight": (c.text_hidden_size, d)}
    block = {"attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_out": (d, q), "ffn_gate": (i, d),
             "ffn_up": (i, d), "ffn_down": (d, i), "ln1": (d,), "attn_post_norm": (d,), "ln2": (d,),
             "ffn_post_norm": (d,), "attn_q_norm": (c.head_dim,), "attn_k_norm": (c.head_dim,)}
    for b in range(c.num_layers):
        out.update({f"v.blk.{b}.{n}.weight": s for n, s in block.items()})
    return out


def synth_mmproj(path: Path, projector: str, c, ftype: str, seed: int = 0) -> Path:
    """Write (once; reused when present) a random mmproj GGUF of tower ``c`` at ``path``: matrices
    (2-D, not the position table) as ``ftype`` (``f16``/``f32``), the rest F32, as llama.cpp's converter
    keeps them. Values: matrices ~ N(0, 1/in_features), norm weights ~ 1 +- 0.1, biases and
    embeddings ~ N(0, 0.02). One tensor in memory at a time."""
    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    with StreamingGGUF(path, "clip", force=True) as s:
        for name, shape in tensor_shapes(projector, c).items():
            matrix = len(shape) == 2 and not name.startswith("v.position_embd")
            if matrix:
                fan_in = shape[1] if projector == "gemma4v" or name != "mm.input_projection.weight" else shape[0]
                v = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))
            elif name.endswith(".weight") and len(shape) == 1:
                v = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
            else:
                v = 0.02 * rng.standard_normal(shape, dtype=np.float32)
            half = matrix and ftype == "f16"
            s.begin(name, shape, T.F16 if half else T.F32)
            s.write(v.astype(np.float16 if half else np.float32))
            s.end()
        s.finish(lambda w: add_mmproj_metadata(w, projector, c))
    return path


def _png(seed: int = 1) -> bytes:
    from PIL import Image

    w, h = IMAGE
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def encode_flops(projector: str, c, patches: int, tokens: int) -> float:
    """Multiply-adds x 2 of one encode: the layers' products (q, k, v, out, MLP) and attention's two
    [P, P] products per head, plus the projector; norms, GELU and pooling left out."""
    d, i, p = c.hidden_size, c.intermediate_size, patches
    if projector == "gemma3":
        per_layer = 2 * p * (4 * d * d + 2 * d * i) + 4 * p * p * d
    else:
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        per_layer = 2 * p * (2 * d * q + 2 * d * kv + 3 * d * i) + 4 * p * p * q
    return float(c.num_layers * per_layer + 2 * tokens * d * c.text_hidden_size + 2 * p * d * 3 * c.patch_size ** 2)


KINDS = (("matmul", ("addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul", "aten::addmm")),
         ("attention", ("attention", "sdpa", "softmax")), ("gelu", ("gelu",)),
         ("norms", ("norm", "rsqrt")), ("conv / pooling", ("conv", "pool")),
         ("copies / conversions", ("copy_", "aten::to", "contiguous", "aten::cat", "clone", "_to_copy",
                                   "repeat", "index")))


def _profile(fn) -> dict:
    """PyTorch's profiler over ``fn()``: the 15 ops of most self CPU time and the split by kind."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    kinds: dict[str, float] = {}
    for e in rows:
        kind = next((k for k, keys in KINDS if any(s in e.key.lower() for s in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + e.self_cpu_time_total / 1e6
    top = [{"op": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6,
            "share": e.self_cpu_time_total / total} for e in rows[:15]]
    return {"top_ops": top, "by_kind_s": dict(sorted(kinds.items(), key=lambda kv: -kv[1])), "total_s": total / 1e6}


def child(tower: str, ftype: str, args) -> dict:
    """One measurement in this (fresh) process; returns its record."""
    import torch

    from gemmaspec.images import prepare
    from gemmaspec.kernels import BlockWeight
    from gemmaspec.loading.vision import load_vision

    projector, c = towers(args.g3_text, args.g4_text, args.layers)[tower]
    folder = bench_dir() / "vision-synth"
    folder.mkdir(parents=True, exist_ok=True)
    path = synth_mmproj(folder / f"{tower}-L{c.num_layers}-w{c.text_hidden_size}-{ftype}.gguf", projector, c, ftype)
    rss = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # noqa: E731
    rss0 = rss()
    t0 = time.perf_counter()
    v = load_vision(path)
    load_s = time.perf_counter() - t0
    rss_loaded = rss()
    ws = v.model.weights
    weight_bytes = sum(w.nbytes if isinstance(w, BlockWeight) else w.numel() * w.element_size() for w in ws.values())
    data = _png()

    def once():
        t = time.perf_counter()
        im = prepare(data, v.config)
        t_pre = time.perf_counter() - t
        out = v.model.embed([im])[0]
        return time.perf_counter() - t, t_pre, out, im

    busy0, self0, wall0 = cpu_busy_s(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    first_s, _, out, im = once()
    runs = [once()[:2] for _ in range(args.repeats)]
    wall = time.perf_counter() - wall0
    busy1, self1 = cpu_busy_s(), resource.getrusage(resource.RUSAGE_SELF)
    own = (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime)
    others = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0 - own) / wall)
    patches = im.pixels.shape[0] if im.positions is not None else c.patches_per_side ** 2
    flops = encode_flops(projector, c, patches, out.shape[0])
    enc, pre = median([r[0] for r in runs]), median([r[1] for r in runs])
    rec = {"tower": tower, "file_type": ftype, "threads": torch.get_num_threads(), "file_bytes": path.stat().st_size,
           "weight_bytes_in_memory": weight_bytes, "weight_dtypes": sorted({str(getattr(w, "dtype", type(w).__name__))
                                                                            for w in ws.values()}),
           "load_s": load_s, "rss_before_load_mb": rss0 / 2**20, "rss_after_load_mb": rss_loaded / 2**20,
           "first_encode_s": first_s, "encode_s": enc, "encode_runs_s": [r[0] for r in runs],
           "preprocess_s": pre, "patches": patches, "soft_tokens": out.shape[0], "text_width": out.shape[1],
           "gflop": flops / 1e9, "gflops_per_s": flops / 1e9 / (enc - pre),
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "other_busy_cores": others, "finite": bool(torch.isfinite(out).all())}
    torch.save(out, folder / f"last-{tower}-L{c.num_layers}-{ftype}.pt")
    ref = folder / f"ref-{tower}-L{c.num_layers}-{ftype}.pt"
    if args.keep_reference:
        torch.save(out, ref)
    elif ref.exists():
        want = torch.load(ref)
        rec["rel_diff_vs_reference"] = ((out - want).norm() / want.norm()).item()
    if args.profile:
        rec["profile"] = _profile(lambda: v.model.embed([im]))
    return rec


def _fmt(x, d=1):
    return "–" if x is None else f"{x:.{d}f}"


def table(recs: list[dict], m: dict) -> str:
    lines = [f"Image encode at the real towers' shapes (synthetic weights), {m['cpu']}, {m['cores']} cores, "
             f"{recs[0]['threads'] if recs else '?'} threads; one {IMAGE[0]}x{IMAGE[1]} PNG, median of the runs after "
             "a warm-up", "",
             "| tower | file | soft tokens | encode s (median) | of which preprocess s | first encode s | GFLOP/s "
             "| load s | weights in memory MB | file MB | peak RSS MB | other busy cores |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in recs:
        lines.append(f"| {r['tower']} | {r['file_type']} | {r['soft_tokens']} | {_fmt(r['encode_s'], 2)} | "
                     f"{_fmt(r['preprocess_s'], 3)} | {_fmt(r['first_encode_s'], 2)} | "
                     f"{_fmt(r['gflops_per_s'], 0)} | "
                     f"{_fmt(r['load_s'], 2)} | {_fmt(r['weight_bytes_in_memory'] / 2**20, 0)} | "
                     f"{_fmt(r['file_bytes'] / 2**20, 0)} | {_fmt(r['peak_rss_mb'], 0)} | "
                     f"{_fmt(r['other_busy_cores'], 2)} |")
    for r in recs:
        if "profile" in r:
            p = r["profile"]
            split = ", ".join(f"{k} {v:.2f} s" for k, v in p["by_kind_s"].items())
            lines += ["", f"Profile of one {r['tower']} {r['file_type']} encode ({p['total_s']:.2f} s self time): "
                          f"{split}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--towers", default="gemma3,gemma4")
    ap.add_argument("--types", default="f16,f32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--g3-text", type=int, default=2560, help="Gemma 3 text width (2560 4B, 3840 12B, 5376 27B)")
    ap.add_argument("--g4-text", type=int, default=1536, help="Gemma 4 text width (1536 E2B, 2560 E4B)")
    ap.add_argument("--layers", type=int, help="only this many encoder layers (a quick check of the script)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--keep-reference", action="store_true")
    ap.add_argument("--name", default="vision_encode")
    ap.add_argument("--note", default="", help="free text stored with the results (e.g. what else ran)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        tower, ftype = args.child.split(":")
        print(json.dumps(child(tower, ftype, args)))
        return
    recs = []
    for tower in args.towers.split(","):
        for ftype in args.types.split(","):
            cmd = [sys.executable, __file__, "--child", f"{tower}:{ftype}"] + sys.argv[1:]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"{tower} {ftype} failed:\n{res.stderr[-3000:]}")
            recs.append(json.loads(res.stdout.strip().splitlines()[-1]))
            r = recs[-1]
            print(f"{tower} {ftype}: encode {r['encode_s']:.2f} s (first {r['first_encode_s']:.2f}), peak RSS "
                  f"{r['peak_rss_mb']:.0f} MB, other busy cores {_fmt(r['other_busy_cores'], 2)}", file=sys.stderr)
    m = machine()
    import torch

    write_results(args.name, {"machine": m, "torch": torch.__version__, "note": args.note, "image": IMAGE,
                              "results": recs}, table(recs, m))


if __name__ == "__main__":
    main()
