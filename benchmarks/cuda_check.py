"""The CUDA path in one go, for a session that has a GPU (about 2-4 minutes; nothing here runs
without one):

1. ``tests/test_cuda_weights.py`` on the GPU (the CUDA tests and the Triton kernel's tests run there
   directly instead of skipping);
2. the default model loaded with ``--device cuda``: GPU memory after load (allocated by PyTorch, and
   used on the device as ``cudaMemGetInfo`` sees it, CUDA context included) beside the weights'
   device-layout bytes and what float32 weights would take;
3. decode tokens/s on the GPU, greedy, EOS ignored, plain decoding: the Triton kernel path and the
   tile path (``GEMMASPEC_CUDA_KERNEL=tiles``), median of ``--repeats`` runs each, taking turns;
4. greedy tokens on the GPU against the CPU's (float32 both; summation order differs, so a late
   divergence is possible and only recorded);
5. the memory arithmetic's figures for an all-Q4_0 Gemma 4 E2B target + exact-Q4_0 assistant at
   4,096 context (nothing loaded; for the record beside the measurement);
6. with ``--real-size e2b[,e4b,12b]``: each full-size synthetic Gemma 4 file (``gemma4_synth.py``,
   written first when missing; ~40 s and 2.6 GB for E2B) on the GPU: prefill of 512 and 2048 tokens,
   a forward of 1..8 rows at contexts 0, 512 and 2048 (decode and the verify cost curve t(k+1)/t(1)),
   and GPU memory (peak allocated, device used) against the seed's 4-8 GB cards.

    .venv/bin/python benchmarks/cuda_check.py [--tokens 128] [--repeats 3] [--real-size e2b]

Writes benchmarks/results/cuda_check.json and .md. Needs PyTorch's CUDA build (``make TORCH=cuda``),
which brings Triton.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from common import ROOT, write_results

PROMPT = '{"users": [\n  {"id": 1, "name": "Alice", "email": "alice@example.com", "role": "admin"},'


def environment() -> dict:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    p = torch.cuda.get_device_properties(0)
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version, "gpu": p.name,
            "capability": f"{p.major}.{p.minor}", "gpu_memory_gib": round(p.total_memory / 2**30, 2),
            "multiprocessors": p.multi_processor_count}


def run_tests(timeout: int) -> dict:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda_weights.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = res.stdout.strip().splitlines()
    return {"returncode": res.returncode, "summary": lines[-1] if lines else "", "seconds": round(time.perf_counter() - t0, 1),
            "tail": "\n".join(lines[-30:]) + res.stderr[-2000:]}


def greedy(engine, ids, tokens: int):
    from gemmaspec.engine import RequestStats
    from gemmaspec.sampling import SamplingParams

    stats = RequestStats()
    out = []
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, seed=0)
    for ev in engine.generate(ids, params, stats=stats):
        out += ev.tokens
    return out, stats


def real_size(shape: str, repeats: int) -> dict:
    """Step costs of a full-size synthetic Gemma 4 file on the GPU (item 6 of the module docstring):
    {"prefill": {P: tokens/s}, "contexts": {L: {"forward_ms": {rows: ms}, "verify_ratio": {k: t(k+1)/t(1)}}},
    "peak_allocated_bytes", "device_used_bytes"}. Times are medians of ``repeats`` after a warm-up, each
    forward followed by torch.cuda.synchronize()."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_costs import _ids

    from gemmaspec.loading.engine import load_engine
    from gemmaspec.models.base import PREFILL_CHUNK

    path = ROOT / "benchmarks" / "models" / f"gemma4-{shape}-synth-q4_0.gguf"
    if not path.exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gemma4_synth.py"), shape], check=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    engine = load_engine(str(path), ctx_size=2048 + 64, device="cuda")
    model, vocab = engine.model, engine.model.config.vocab_size

    def timed(fn) -> float:
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[1:])

    out: dict = {"file": path.name, "prefill": {}, "contexts": {}}
    with torch.inference_mode():
        for n in (512, 2048):
            ids = _ids(n, vocab, 1)  # token ids stay on the CPU, as the engine passes them

            def prefill():
                c = model.new_cache(n + 16)
                for s in range(0, n, PREFILL_CHUNK):  # chunked as the engine does
                    model.forward(ids[s:s + PREFILL_CHUNK], c)
            ms = timed(prefill)
            out["prefill"][n] = n / ms * 1e3
        cache = model.new_cache(2048 + 32)
        for ctx in (0, 512, 2048):
            if ctx > cache.length:
                model.forward(_ids(ctx - cache.length, vocab, 3), cache)
            base, t = cache.length, {}
            for rows in range(1, 9):
                ids = _ids(rows, vocab, 2)

                def step():
                    model.forward(ids, cache, all_logits=rows > 1)
                    cache.rollback(base)
                t[rows] = timed(step)
            out["contexts"][ctx] = {"forward_ms": t, "decode_tokens_per_s": 1e3 / t[1],
                                    "verify_ratio": {k: t[k + 1] / t[1] for k in range(1, 8)}}
    free, total = torch.cuda.mem_get_info()
    out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    out["device_used_bytes"] = total - free
    del engine, model, cache
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--test-timeout", type=int, default=150)
    ap.add_argument("--real-size", default="", help="comma list of synthetic Gemma 4 shapes to time (e2b, e4b, 12b)")
    a = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU visible to PyTorch (torch.cuda.is_available() is False): this script measures the "
                 "CUDA path and has nothing to do here. Install the CUDA build with `make TORCH=cuda`.")
    from gemmaspec.kernels import BlockWeight
    from gemmaspec.kernels.cuda import DeviceQuantWeight, use_kernel
    from gemmaspec.kernels.memory import fmt_bytes
    from gemmaspec.loading.engine import load_engine
    from gemmaspec.manage.default_model import default_model_path
    from gemmaspec.models.config import Gemma4AssistantConfig, Gemma4Config
    from gemmaspec.models.footprint import device_memory

    env = environment()
    result = {"environment": env, "kernel_available": use_kernel(torch.device("cuda"))}
    print(f"{env['gpu']} (sm {env['capability']}, {env['gpu_memory_gib']} GiB), torch {env['torch']}, "
          f"triton {env['triton']}", flush=True)

    result["tests"] = run_tests(a.test_timeout)
    print("tests:", result["tests"]["summary"], flush=True)

    # --- load on the GPU ---
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    base_alloc = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    engine = load_engine(None, ctx_size=4096, device="cuda")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    free1, _ = torch.cuda.mem_get_info()
    weights = engine.model.weights
    quant = [w for w in weights.values() if isinstance(w, BlockWeight)]
    layout = sum(w.nbytes for w in quant)
    dense_rest = sum(t.numel() * t.element_size() for t in weights.values() if isinstance(t, torch.Tensor))
    result["load"] = {
        "model": str(default_model_path()), "file_bytes": os.path.getsize(default_model_path()), "seconds": round(load_s, 2),
        "quantized_matrices": len(quant),
        "device_layout": sorted({type(w).__name__ for w in quant}) == ["DeviceQuantWeight"],
        "layout_bytes": layout, "dense_tensor_bytes": dense_rest,
        "float32_weights_would_be": sum(4 * w.shape[0] * w.shape[1] for w in quant) + dense_rest,
        "kv_cache_bytes": sum(2 * lay.k.numel() * lay.k.element_size() for lay in engine.cache.layers if lay is not None),
        "allocated_after_load": torch.cuda.memory_allocated() - base_alloc,
        "device_used_after_load": (total - free1), "device_used_before_load": (total - free0)}
    print("load:", {k: (fmt_bytes(v) if k.endswith(("bytes", "_load", "would_be")) else v)
                    for k, v in result["load"].items()}, flush=True)

    # --- decode speed, kernel vs tiles ---
    ids = engine.encode_prompt(PROMPT)
    greedy(engine, ids, 8)  # warm-up: Triton compiles its variants, cuBLAS loads
    runs: dict[str, list[float]] = {"kernel": [], "tiles": []}
    tokens_gpu = None
    torch.cuda.reset_peak_memory_stats()
    for _ in range(a.repeats):
        for path in runs:
            os.environ["GEMMASPEC_CUDA_KERNEL"] = path
            torch.cuda.synchronize()
            out, stats = greedy(engine, ids, a.tokens)
            runs[path].append(round(stats.decode_tps, 2))
            if path == "kernel" and tokens_gpu is None:
                tokens_gpu = out
    os.environ.pop("GEMMASPEC_CUDA_KERNEL", None)
    result["decode_tps"] = {p: {"median": statistics.median(xs), "runs": xs} for p, xs in runs.items()}
    result["peak_allocated_while_decoding"] = torch.cuda.max_memory_allocated() - base_alloc
    print("decode tok/s:", {p: v["median"] for p, v in result["decode_tps"].items()}, flush=True)

    # --- agreement with the CPU ---
    del engine
    torch.cuda.empty_cache()
    cpu = load_engine(None, ctx_size=4096, device="cpu")
    tokens_cpu, _ = greedy(cpu, ids, a.tokens)
    same = next((i for i, (x, y) in enumerate(zip(tokens_gpu, tokens_cpu)) if x != y), min(len(tokens_gpu), len(tokens_cpu)))
    result["greedy_agreement"] = {"tokens": a.tokens, "identical_prefix": same}
    print(f"greedy tokens identical to the CPU's for the first {same} of {a.tokens}", flush=True)

    # --- the arithmetic for E2B (nothing loaded) ---
    lt = tuple((["sliding"] * 4 + ["full"]) * 7)
    e2b = Gemma4Config(vocab_size=262144, hidden_size=1536, num_layers=35, intermediate_size=6144, num_heads=8,
                       num_kv_heads=1, head_dim=256, global_head_dim=512, sliding_window=512, layer_types=lt,
                       hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=20,
                       use_double_wide_mlp=True)
    asst = Gemma4AssistantConfig(text=Gemma4Config(vocab_size=262144, hidden_size=256, num_layers=4, intermediate_size=2048,
                                                   num_heads=4, num_kv_heads=1, head_dim=256, global_head_dim=512,
                                                   sliding_window=512, layer_types=("sliding",) * 3 + ("full",),
                                                   num_kv_shared_layers=4),
                                 backbone_hidden_size=1536, num_centroids=2048, centroid_top_k=32)
    both = device_memory(e2b, 4096, "Q4_0") + device_memory(asst, 4096, "Q4_0")
    result["e2b_q4_0_estimate"] = {"weights": both.weights, "kv_cache": both.kv_cache, "work": both.work,
                                   "runtime_allowance": both.runtime, "total": both.total}

    ld, dt = result["load"], result["decode_tps"]
    table = "\n".join([
        f"GPU: {env['gpu']} (sm {env['capability']}, {env['gpu_memory_gib']} GiB); torch {env['torch']} (CUDA "
        f"{env['cuda']}), triton {env['triton']}. Default model, -c 4096, greedy, {a.tokens} tokens, EOS ignored, "
        f"plain decoding; median of {a.repeats} runs per path, paths taking turns, one process.", "",
        f"- tests/test_cuda_weights.py on the GPU: {result['tests']['summary']}",
        f"- weights on the GPU: {fmt_bytes(ld['layout_bytes'] + ld['dense_tensor_bytes'])} (block-quantized layout "
        f"{fmt_bytes(ld['layout_bytes'])} + float32 tensors {fmt_bytes(ld['dense_tensor_bytes'])}); float32 weights "
        f"would be {fmt_bytes(ld['float32_weights_would_be'])}; file {fmt_bytes(ld['file_bytes'])}",
        f"- GPU memory after load: {fmt_bytes(ld['allocated_after_load'])} allocated by PyTorch (KV cache "
        f"{fmt_bytes(ld['kv_cache_bytes'])} included); {fmt_bytes(ld['device_used_after_load'])} used on the device "
        f"(CUDA context included; {fmt_bytes(ld['device_used_before_load'])} before loading); peak while decoding "
        f"{fmt_bytes(result['peak_allocated_while_decoding'])}",
        f"- decode: {dt['kernel']['median']:.1f} tokens/s with the Triton kernel, {dt['tiles']['median']:.1f} with "
        f"dequantized tiles (runs: {dt['kernel']['runs']} / {dt['tiles']['runs']})",
        f"- greedy tokens identical to the CPU's for the first {same} of {a.tokens}",
        f"- E2B all-Q4_0 + exact-Q4_0 assistant at 4,096 (arithmetic, not loaded): {fmt_bytes(both.total)}"])
    for shape in (x for x in a.real_size.split(",") if x):
        rs = result.setdefault("real_size", {})[shape] = real_size(shape, a.repeats)
        table += (f"\n- {rs['file']}: prefill " + ", ".join(f"{n}: {v:.0f} tokens/s" for n, v in rs["prefill"].items())
                  + "; decode " + ", ".join(f"ctx {c}: {v['decode_tokens_per_s']:.1f} tokens/s" for c, v in rs["contexts"].items())
                  + "; t(3)/t(1) " + ", ".join(f"ctx {c}: {v['verify_ratio'][2]:.2f}" for c, v in rs["contexts"].items())
                  + f"; GPU memory peak allocated {fmt_bytes(rs['peak_allocated_bytes'])}, device used "
                  f"{fmt_bytes(rs['device_used_bytes'])}")
        print(table.splitlines()[-1], flush=True)
    write_results("cuda_check", result, table)
    if result["tests"]["returncode"] != 0:
        print("\nCUDA tests failed:\n" + result["tests"]["tail"], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
