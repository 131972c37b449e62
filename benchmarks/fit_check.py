"""Does ``gemmaspec fit`` agree with real memory? For each setup, a fresh process estimates the memory
from metadata (:mod:`gemmaspec.manage.fit`), loads the model (and drafter), fills the context
(a prompt of ctx - 48 tokens, then greedy tokens up to the context; EOS ignored) and reports its peak
resident memory (VmHWM) and its resident memory at the end (RSS after malloc_trim).

    python benchmarks/fit_check.py            (default model at -c 512 and 4096; the synthetic E2B-width
                                               target of mtp_memory.py, alone and with its exact-Q4_0
                                               assistant, when its checkpoints are built)

Writes benchmarks/results/fit_check.json and .md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common import machine, write_results

from gemmaspec.paths import cache_home

MTP = cache_home() / "bench" / "mtp_memory"


def child(target: str, draft: str | None, ctx: int) -> dict:
    import ctypes

    from gemmaspec.engine import RequestStats
    from gemmaspec.loading.engine import load_engine
    from gemmaspec.speculative.config import SpecConfig
    from gemmaspec.speculative.plan import load_drafter
    from gemmaspec.manage.fit import estimate, read_model
    from gemmaspec.sampling import SamplingParams

    t = None if target == "-" else target
    est = estimate(read_model(t), read_model(draft) if draft else None, ctx, 1, "cpu")
    engine = load_engine(t, ctx_size=ctx, device="cpu", threads=2)
    drafter = load_drafter(SpecConfig("draft-mtp" if draft else "none", draft), engine)
    n_prompt = ctx - 48
    ids = [engine.tokenizer.bos_id] + [(i * 7919) % 200_000 + 1000 for i in range(n_prompt - 1)]
    params = SamplingParams(temperature=0, max_tokens=ctx - n_prompt - 4, ignore_eos=True)
    st = RequestStats()
    n = sum(len(ev.tokens) for ev in engine.generate(ids, params, drafter=drafter, n_max=2 if draft else 0, stats=st))
    ctypes.CDLL(None).malloc_trim(0)
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
    return {"target": target, "draft": draft, "ctx": ctx, "tokens": n, "estimate": est.total,
            "parts": {"target": est.target, "draft": est.draft, "kv": est.kv, "buffers": est.buffers,
                      "runtime": est.runtime}, "peak": peak, "rss_end": rss}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        d = sys.argv[3] if sys.argv[3] != "-" else None
        print(json.dumps(child(sys.argv[2], d, int(sys.argv[4]))))
        return
    cases = [("-", "-", 512), ("-", "-", 4096)]
    if (MTP / "target-q8_0.gguf").exists():
        cases += [(str(MTP / "target-q8_0.gguf"), "-", 576),
                  (str(MTP / "target-q8_0.gguf"), str(MTP / "assistant-q4_0.gguf"), 576)]
    runs = []
    for target, draft, ctx in cases:
        res = subprocess.run([sys.executable, __file__, "--child", target, draft, str(ctx)], capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise SystemExit(res.stderr[-3000:])
        r = json.loads(res.stdout.strip().splitlines()[-1])
        runs.append(r)
        print(r, file=sys.stderr, flush=True)
    write_results("fit_check", {"machine": machine(), "runs": runs}, render(runs))


def render(runs) -> str:
    mib = lambda n: f"{n / 2**20:.0f}"  # noqa: E731
    rows = []
    for r in runs:
        name = "default model" if r["target"] == "-" else os.path.basename(r["target"])
        if r["draft"]:
            name += " + " + os.path.basename(r["draft"])
        rows.append(f"| {name} | {r['ctx']} | {mib(r['estimate'])} | {mib(r['peak'])} | {mib(r['rss_end'])} | "
                    f"{(r['estimate'] / r['peak'] - 1) * 100:+.1f}% |")
    return "\n".join([
        f"Machine: {machine()['cpu']}, {machine()['cores']} cores; 2 threads. Fresh process per row: `fit`'s estimate "
        "from metadata, then load, a prompt of ctx-48 tokens and greedy decoding to the end of the context. MiB.", "",
        "| setup | -c | estimate | measured peak (VmHWM) | RSS at the end | estimate vs peak |",
        "|---|---:|---:|---:|---:|---:|", *rows])


if __name__ == "__main__":
    main()
