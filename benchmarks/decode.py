"""Plain decoding speed: gemmaspec vs llama.cpp on the same GGUF, prompts and threads, quiet and under
load, against this machine's measured memory read bandwidth.

Each run is a cold process (load + prompt + N greedy tokens, EOS ignored so both make exactly that
many). Reports medians over --repeats runs per prompt: prefill and decode tokens/s, time to the first
token from process start, peak RSS, ours/llama.cpp; and for gemmaspec the bytes of weights read per
decode step (summed from the loaded model object: every weight matrix and vector a token passes
through, the tied embedding/head once as the head, embedding row lookups left out), the GB/s that
implies (bytes/step x decode tokens/s) and its fraction of the read bandwidth that a STREAM-like test
measures on this machine (``common.read_bandwidth``: a float32 matrix-vector product over an array far
larger than the caches, all threads; measured after the runs, with no busy process).
And per model its memory (:func:`model_memory`): what loading it and generating adds to the RSS of the
bare runtime, against its file size plus its KV cache at -c 4096.

``--load busy`` runs every decode with one competing busy process (``python -c 'while True: pass'``)
that the script starts before the runs and stops after; ``--load both`` does the quiet runs, then the
busy ones. llama.cpp runs through llama-cpp-python when its venv exists
(``$GEMMASPEC_HOME/bench/llama-venv``); otherwise the script says so and measures gemmaspec alone,
unless ``--build-llama`` is given (builds it from source once, about 16 minutes on 2 cores).
``--threads 1,2`` measures each thread count in turn; ``--all-q4_0`` adds an all-Q4_0 conversion of the
model (every matrix, token embedding and head included), made once by llama.cpp's own quantizer through
llama-cpp-python (``llama_quantize.py``) and cached in ``$GEMMASPEC_HOME/bench``.

    python benchmarks/decode.py [--model PATH] [--threads N[,N...]] [--all-q4_0] [--n 128] [--repeats 3]
                                [--load quiet|busy|both] [--prompts code,prose,qa] [--isa avx512,avx2]
                                [--act-quant none,q8_0] [--out decode] [--no-llama] [--build-llama]

``--isa avx512,avx2`` measures several kernel paths side by side (``GEMMASPEC_ISA`` per run): on an AVX-512
machine the AVX2 path is what an AVX2-only CPU of the same core would run (llama.cpp stays built for this
CPU). ``--act-quant none,q8_0`` measures the fp32-activation products and the int8-activation ones
(``gemmaspec --act-quant``) side by side. Writes benchmarks/results/<out>.json (machine: CPU model and SIMD flags) and <out>.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

from common import PROMPTS, busy_process, llama_python, machine, median, read_bandwidth, run_cold, user_env, write_results

import gemmaspec
from gemmaspec.loading.engine import physical_cores
from gemmaspec.manage.default_model import default_model_path


def bytes_per_step(model) -> dict:
    """Bytes of weights one decode step reads, from a built target model (``LoadedModel.model``): the
    ``nbytes`` of every entry of ``model.weights`` (a :class:`gemmaspec.kernels.BlockWeight`'s memory
    held, a dense tensor's numel x element size), except the token-embedding tables that a token only
    looks up a row of (``token_embd``, Gemma 4's ``per_layer_token_embd``); a tied head (``model.head``
    is ``token_embd``) is counted once, as the head. Every layer and expert is counted (dense models).
    Returns bytes: ``total``, ``head``, ``vectors`` (1-D tensors: norms and scales), and ``matrices``
    (how many 2-D weights)."""
    head = getattr(model, "head", None)
    total = vectors = matrices = 0
    for name, t in model.weights.items():
        if name.endswith("token_embd.weight") and t is not head:
            continue  # a row lookup per token: negligible
        total += int(t.nbytes)
        if len(t.shape) >= 2:
            matrices += 1
        else:
            vectors += int(t.nbytes)
    return {"total": total, "head": int(head.nbytes) if head is not None else 0, "vectors": vectors,
            "matrices": matrices}


def model_bytes(path) -> dict:
    """:func:`bytes_per_step` of the model at ``path``, loaded once on the CPU and released again."""
    from gemmaspec.loading import load_checkpoint

    loaded = load_checkpoint(path, "cpu", role="target")
    b = bytes_per_step(loaded.model)
    del loaded
    gc.collect()
    return b


_MEMORY_CHILD = r"""
import gc, json, os, sys, time
import torch
import gemmaspec
from gemmaspec.kernels import load_library

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

from common import resident_bytes  # the child runs in benchmarks/ (python -c puts it first on sys.path)

from gemmaspec.loading.engine import load_engine  # the bare runtime: every module imported, the kernel loaded,
from gemmaspec.sampling import SamplingParams  # small tensor ops run (their code pages), no model
load_library()
x = torch.randn(24, 64)  # the ops a generation runs, on small tensors: their code pages belong to the runtime
for y in (x @ x.T, torch.nn.functional.linear(x, x), torch.tanh(x), torch.nn.functional.gelu(x, approximate="tanh"),
          torch.softmax(x, -1), torch.nn.functional.rms_norm(x, (64,)), torch.cat([x, x]), x.index_select(0, torch.arange(3)),
          torch.topk(x, 4).values, x.argmax(-1).float(), torch.cumsum(x, -1), torch.sort(x).values, x.numpy().argmax()):
    pass
gc.collect()
bare = rss()
path, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = load_engine(path, ctx_size=4096, device="cpu", threads=threads)
after_load = rss()
ids = eng.tokenizer.encode("def fibonacci(n):\n    ")
list(eng.generate(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
time.sleep(1.0)  # a background regroup still finishing puts its copy in use at the next product
list(eng.generate(ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
time.sleep(1.5)  # ... and releases the stored pages within 0.5 s
kv = sum(t.nbytes for lk in eng.cache.layers if lk is not None for t in (lk.k, lk.v))
print(json.dumps({"bare": bare, "after_load": after_load, "steady": rss(), "file": os.path.getsize(path),
                  "file_resident": resident_bytes(os.path.realpath(path)), "kv": kv}))
"""


def model_memory(path, threads: int, n: int = 64) -> dict:
    """What the model adds to a process, in bytes (the issue's "model memory"): RSS after loading it and
    generating ``n`` + 4 greedy tokens at -c 4096 (so lazily mapped weights are resident and a background
    regroup has put its copies in use and released the stored pages), minus the RSS of the bare runtime
    (torch and gemmaspec's modules imported, the C kernel loaded, the tensor ops a generation runs
    run once on small tensors, so their code pages count as the runtime's; no model). Also the file size, the part
    of the file resident in the process, and the KV cache's size (its pages are touched only as
    positions fill, so the steady RSS holds only a little of it). Fresh process; Linux (/proc)."""
    r = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, os.path.abspath(str(path)), str(n), str(threads)],
                       capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.abspath(__file__)))
    if r.returncode != 0:
        raise RuntimeError(f"memory measurement failed: {r.stderr[-1000:]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    d["added"] = d["steady"] - d["bare"]
    d["ratio"] = d["added"] / (d["file"] + d["kv"])
    return d


def ours(model, prompt, n, threads, variant=(None, None)):
    """One cold ``gemmaspec generate`` run; ``variant`` = (isa, act): ``isa`` forces the kernel path
    (``GEMMASPEC_ISA``), ``act`` the activation mode (``GEMMASPEC_ACT_QUANT``); None = the default."""
    isa, act = variant
    env = {**os.environ, **({"GEMMASPEC_ISA": isa} if isa else {}), **({"GEMMASPEC_ACT_QUANT": act} if act else {})}
    r = run_cold([sys.executable, "-m", "gemmaspec", "generate", "-m", str(model), "-p", prompt, "-n", str(n),
                  "--temp", "0", "--ignore-eos", "-t", str(threads), "--spec-type", "none", "--json"], env=env)
    s = json.loads(r["stdout"].rstrip("\n").rsplit("\n", 1)[-1])  # --json: the stats are the last stdout line
    return {"prompt_tokens": s["prompt_tokens"], "prefill_tps": s["prefill_tps"], "generated": s["generated_tokens"],
            "decode_tps": s["decode_tps"], "ttft_ms": s["ttft_ms"], "cold_first_token_s": r["first_output_s"],
            "peak_rss_mb": r["peak_rss_mb"]}


def llama(py, model, prompt, n, threads):
    here = os.path.dirname(os.path.abspath(__file__))
    arg = json.dumps({"model": str(model), "prompt": prompt, "n": n, "threads": threads})
    # llama.cpp gets the user's environment, not the OpenMP wait policy gemmaspec set for itself at import
    env = user_env()
    r = run_cold([str(py), os.path.join(here, "llama_runner.py"), arg], env=env)
    d = json.loads(r["stderr"].strip().splitlines()[-1])
    d.update({"cold_first_token_s": r["first_output_s"], "peak_rss_mb": r["peak_rss_mb"]})
    return d


def engine_name(variant) -> str:
    return " ".join(["gemmaspec"] + [v for v in variant if v])


def measure(py, model, prompts, n, threads, repeats, isas=((None, None),)) -> dict:
    """{prompt kind: {engine: [run dicts]}}, engines (each (kernel path, activation mode) in ``isas``,
    then llama.cpp) taking turns within each repeat."""
    raw = {}
    for kind in prompts:
        runs = raw.setdefault(kind, {engine_name(i): [] for i in isas} | ({"llama.cpp": []} if py else {}))
        for _ in range(repeats):
            for isa in isas:
                runs[engine_name(isa)].append(ours(model, PROMPTS[kind], n, threads, isa))
            if py:
                runs["llama.cpp"].append(llama(py, model, PROMPTS[kind], n, threads))
    return raw


def all_q4_0(py, model) -> str:
    """Path of an all-Q4_0 copy of ``model`` (every matrix, token embedding and head included), made once
    by llama.cpp's quantizer (``llama_quantize.py`` in the llama-cpp-python venv) into the bench dir."""
    from common import bench_dir

    out = bench_dir() / (os.path.splitext(os.path.basename(str(model)))[0] + "-all-q4_0.gguf")
    if not out.exists():
        here = os.path.dirname(os.path.abspath(__file__))
        tmp = out.with_suffix(".partial")
        r = subprocess.run([str(py), os.path.join(here, "llama_quantize.py"), str(model), str(tmp)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"llama.cpp's quantizer failed: {r.stderr[-1000:]}")
        os.replace(tmp, out)
    return str(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    ap.add_argument("--threads", default=None,
                    help="threads for both engines, or a comma-separated list (e.g. 1,2) measured in turn "
                         "(default: physical cores)")
    ap.add_argument("--all-q4_0", action="store_true",
                    help="also measure an all-Q4_0 conversion of the model (token embedding and head included), made "
                         "once with llama.cpp's own quantizer in the llama-cpp-python venv")
    ap.add_argument("--n", type=int, default=128, help="tokens to generate per run")
    ap.add_argument("--repeats", type=int, default=3, help="cold runs per prompt and engine")
    ap.add_argument("--load", choices=("quiet", "busy", "both"), default="quiet",
                    help="decode on a quiet machine, with one busy process this script starts, or both")
    ap.add_argument("--prompts", default=",".join(PROMPTS), help=f"comma-separated subset of {', '.join(PROMPTS)}")
    ap.add_argument("--isa", default=None,
                    help="kernel paths to measure side by side, comma-separated (avx512, avx2, neon, portable: those "
                         "this CPU runs; sets GEMMASPEC_ISA per run); default: the best this CPU has")
    ap.add_argument("--act-quant", default=None,
                    help="comma-separated activation modes to measure side by side (none,q8_0; GEMMASPEC_ACT_QUANT "
                         "per run; default: none only)")
    ap.add_argument("--out", default="decode", help="results name under benchmarks/results (default decode)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    ap.add_argument("--build-llama", action="store_true",
                    help="build llama-cpp-python into its venv if missing (about 16 minutes on 2 cores)")
    a = ap.parse_args()
    prompts = [p.strip() for p in a.prompts.split(",")]
    if any(p not in PROMPTS for p in prompts):
        ap.error(f"--prompts: choose from {', '.join(PROMPTS)} (got {a.prompts})")
    thread_list = [int(t) for t in a.threads.split(",")] if a.threads else [physical_cores()]
    acts = tuple(None if i.strip() == "none" else i.strip() for i in a.act_quant.split(",")) if a.act_quant else (None,)
    isas = tuple((i, act) for i in (tuple(i.strip() for i in a.isa.split(",")) if a.isa else (None,)) for act in acts)
    threads = max(thread_list)
    model = a.model or default_model_path()
    py = None
    if not a.no_llama:
        py = llama_python(build=a.build_llama)
        if py is None:
            print("llama.cpp: llama-cpp-python is not installed (no venv under $GEMMASPEC_HOME/bench/llama-venv); "
                  "measuring gemmaspec only. --build-llama builds it (about 16 minutes on 2 cores).", file=sys.stderr)
    models = {os.path.basename(str(model)): model}
    if a.all_q4_0:
        if py is None:
            ap.error("--all-q4_0 needs llama-cpp-python (its quantizer makes the conversion): --build-llama")
        models["all-Q4_0"] = all_q4_0(py, model)
    # bytecode as an installed copy has it (an environment with PYTHONDONTWRITEBYTECODE, as some
    # containers set, would otherwise compile gemmaspec's modules in every cold run: ~0.1 s)
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.dirname(gemmaspec.__file__)],
                   stdout=subprocess.DEVNULL, check=False)
    for m_path in models.values():
        for isa in isas:
            ours(m_path, "warm-up", 2, threads, isa)  # builds the tokenizer cache and the kernels once
    # the cold-start goal is counted from `import torch`: time that alone in the same kind of process
    torch_s = median([run_cold([sys.executable, "-c", "import torch; print(1)"])["first_output_s"]
                      for _ in range(max(3, a.repeats))])
    loads = {"before": os.getloadavg()[0]}
    conditions = ["quiet", "one busy process"] if a.load == "both" else \
        ["one busy process" if a.load == "busy" else "quiet"]
    raw = {}
    for cond in conditions:
        for m_name, m_path in models.items():
            for t in thread_list:
                key = f"{cond} | {m_name} | {t}"
                if cond == "quiet":
                    raw[key] = measure(py, m_path, prompts, a.n, t, a.repeats, isas)
                else:
                    with busy_process():
                        raw[key] = measure(py, m_path, prompts, a.n, t, a.repeats, isas)
        loads[f"after {cond}"] = os.getloadavg()[0]
    # after the runs: a child's peak RSS (wait4) includes this process's peak at the time it was started,
    # so this process loads the model and the bandwidth array only once every run is done
    bw = read_bandwidth(threads)
    steps = {m_name: model_bytes(m_path) for m_name, m_path in models.items()}
    memory = {m_name: model_memory(m_path, threads) for m_name, m_path in models.items()}
    step = steps[os.path.basename(str(model))]

    m = machine()
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores; SIMD: {m['simd']}; kernel path "
             f"{m['kernel_isa'] if a.isa is None else a.isa}; "
             f"threads {','.join(map(str, thread_list))}; greedy; {a.n} new tokens; median of {a.repeats} cold runs per prompt; "
             f"model {os.path.basename(str(model))}" + ("" if py else "; llama.cpp not installed, not measured"),
             f"Weights read per decode step: {step['total'] / 2**20:.1f} MiB ({step['matrices']} matrices; "
             f"head {step['head'] / 2**20:.1f} MiB)"
             + "".join(f"; {n}: {b['total'] / 2**20:.1f} MiB" for n, b in steps.items() if b is not step) + ". Read bandwidth (float32 matrix-vector product over "
             f"{bw['array_mib']} MiB, "
             f"{threads} threads, {len(bw['passes_gbs'])} passes): best {bw['best_gbs']:.1f} GB/s, median "
             f"{bw['median_gbs']:.1f}. A process that only imports torch prints after {torch_s:.2f} s (median); "
             "subtract it from the cold start column for the time after `import torch`. 1-minute load average: "
             + ", ".join(f"{k} {v:.2f}" for k, v in loads.items()) + " (shared machine: figures are noisy).",
             "Model memory (RSS after loading and 68 greedy tokens at -c 4096, minus the bare runtime's "
             f"{memory[os.path.basename(str(model))]['bare'] / 2**20:.0f} MiB): "
             + "; ".join(f"{n} {d['added'] / 2**20:.0f} MiB = {d['ratio']:.2f}x (file {d['file'] / 2**20:.0f} MiB "
                         f"+ KV cache {d['kv'] / 2**20:.1f} MiB), of which {d['file_resident'] / 2**20:.0f} MiB "
                         "of the file mapped" for n, d in memory.items()) + ".", "",
             "| load | model | threads | prompt | engine | prompt tokens | prefill tok/s | decode tok/s "
             "| weights GB/s (of best read bw) | cold start → first token (s) | peak RSS (MB) | decode ours/llama.cpp |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for cond, per_prompt in raw.items():
        gb_step = steps[cond.split(" | ")[1]]["total"] / 1e9
        for kind, runs in per_prompt.items():
            med = {eng: {k: median([r.get(k) for r in rs]) for k in
                         ("prefill_tps", "decode_tps", "cold_first_token_s", "peak_rss_mb", "prompt_tokens")}
                   for eng, rs in runs.items()}
            for eng, md in med.items():
                ratio = md["decode_tps"] / med["llama.cpp"]["decode_tps"] \
                    if eng.startswith("gemmaspec") and "llama.cpp" in med else None
                gbs = gb_step * md["decode_tps"] if eng.startswith("gemmaspec") else None
                share = "" if gbs is None else f"{gbs:.1f} ({gbs / bw['best_gbs']:.0%})"
                lines.append(
                    f"| {cond} | {kind} | {eng} | {md['prompt_tokens']:.0f} | {md['prefill_tps']:.1f} | "
                    f"{md['decode_tps']:.1f} | {share} | "
                    f"{md['cold_first_token_s']:.2f} | {md['peak_rss_mb']:.0f} | "
                    f"{'' if ratio is None else f'{ratio:.2f}x'} |")
    write_results(a.out, {"machine": m, "settings": vars(a) | {"model": str(model), "threads": thread_list,
                                                              "models": {k: str(v) for k, v in models.items()}},
                             "llama_cpp_installed": py is not None, "bytes_per_step": steps,
                             "read_bandwidth": bw, "model_memory": memory, "loadavg": loads, "torch_import_s": torch_s, "runs": raw}, "\n".join(lines))


if __name__ == "__main__":
    main()
