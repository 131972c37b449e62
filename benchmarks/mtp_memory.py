"""What the MTP assistant adds to memory, end to end: target alone vs target + assistant, by the
assistant's file format (BF16, Q8_0, exact Q4_0) and context length.

Synthetic checkpoints with released shapes, built once with transformers' own classes and the real
Gemma tokenizer (262,144 tokens, from the default model): an E2B-width target (width 1,536, 4 layers,
stored Q8_0 by ``gemmaspec convert``) and an E2B-shaped assistant (4 layers of width 256, clustered
head with 2,048 centroids) whose weights sit on a bf16 4-bit grid like Google's QAT exports. The
assistant is written three ways: ``convert --outtype bf16``, ``convert --outtype q8_0`` and
``quantize --exact``. Each measurement is a fresh process that loads the target (and assistant),
generates 32 greedy tokens after an L-token prompt (``--spec-type draft-mtp --spec-draft-n-max 2``
or plain) and reports its resident memory (RSS, /proc/self/statm) and peak (VmHWM).

    python benchmarks/mtp_memory.py [--contexts 512 4096]     (--render: rewrite the table from the JSON)

Writes benchmarks/results/mtp_memory.json and .md. Checkpoints are cached in
$GEMMASPEC_HOME/bench/mtp_memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import machine, resident_bytes, write_results

from gemmaspec.paths import cache_home

WORK = cache_home() / "bench" / "mtp_memory"
V = 262_144
TARGET = dict(vocab_size=V, hidden_size=1536, intermediate_size=6144, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
              layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=32768,
              hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=30.0)
ASSISTANT = dict(vocab_size=V, hidden_size=256, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
                 layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=32768,
                 hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
FORMATS = {"bf16": "convert --outtype bf16", "q8_0": "convert --outtype q8_0", "q4_0": "quantize --exact"}


def _snap_to_grid(model, seed: int) -> None:
    """QAT-like weights: every 32-value block along the input dimension on a bf16 4-bit grid."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 or p.shape[-1] % 32 or "norm" in name:
                continue
            b = p.detach().float().reshape(-1, 32)
            peak = torch.randint(5, 9, (b.shape[0], 1), generator=g).float()
            step = (b.abs().amax(1, keepdim=True) / peak).clamp_min(1e-4).bfloat16().float()
            p.copy_((step * (b / step).round().clamp(-8, 7)).bfloat16().float().reshape(p.shape))


def build() -> dict:
    """The target GGUF and the three assistant GGUFs (built once)."""
    files = {"target": WORK / "target-q8_0.gguf", **{f: WORK / f"assistant-{f}.gguf" for f in FORMATS}}
    if all(p.exists() for p in files.values()):
        return files
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

    from gemmaspec.manage.default_model import default_model_path
    from gemmaspec.loading.convert import convert
    from gemmaspec.quant.quantize import quantize_exact
    from gemmaspec.tokenizer import GemmaTokenizer

    WORK.mkdir(parents=True, exist_ok=True)
    tok = GemmaTokenizer.from_gguf(default_model_path())
    torch.manual_seed(0)
    t = Gemma4ForCausalLM(Gemma4TextConfig(**TARGET)).eval().to(torch.bfloat16)
    t.save_pretrained(WORK / "target-hf")
    tok.backend.save(str(WORK / "target-hf" / "tokenizer.json"))
    del t
    convert(WORK / "target-hf", files["target"], "q8_0", force=True)
    a = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(**ASSISTANT), backbone_hidden_size=1536, use_ordered_embeddings=True,
        num_centroids=2048, centroid_intermediate_top_k=32)).eval()
    _snap_to_grid(a, 1)
    a.to(torch.bfloat16).save_pretrained(WORK / "assistant-hf")
    tok.backend.save(str(WORK / "assistant-hf" / "tokenizer.json"))
    del a
    convert(WORK / "assistant-hf", files["bf16"], "bf16", force=True)
    convert(WORK / "assistant-hf", files["q8_0"], "q8_0", force=True)
    quantize_exact(WORK / "assistant-hf", files["q4_0"], force=True)
    return files


def child(target: str, assistant: str | None, ctx: int) -> dict:
    import ctypes

    from gemmaspec.engine import RequestStats
    from gemmaspec.loading.engine import load_engine
    from gemmaspec.speculative.config import SpecConfig
    from gemmaspec.speculative.plan import load_drafter
    from gemmaspec.sampling import SamplingParams

    libc = ctypes.CDLL("libc.so.6")

    def rss():
        """Resident MiB of live memory: freed heap pages are handed back first (malloc_trim), so
        what loading the target freed is not counted again when the assistant reuses it."""
        libc.malloc_trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def hwm():
        return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))

    def settle(drafter=None):
        """A few more tokens, twice, with pauses: a background regroup of the weights (the target's and the
        assistant's) puts its copies in use at the next product and then releases the stored pages, so
        the runs compare steady states rather than the moment each copy is done."""
        for _ in range(2):
            time.sleep(1.0)
            list(engine.generate([engine.tokenizer.bos_id, 1000, 1001], params4, drafter=drafter,
                                 n_max=2 if drafter else 0))

    params4 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = load_engine(target, ctx_size=ctx + 64, device="cpu", threads=2)
    settle()
    target_mib = rss()
    drafter = load_drafter(SpecConfig("draft-mtp", assistant), engine) if assistant else None
    loaded = rss()
    held = sum(int(w.nbytes) for w in drafter.assistant.weights.values()) / 2**20 if drafter else 0.0
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS: the peak below is the generation's
    ids = [engine.tokenizer.bos_id] + [(i * 7919) % 200_000 + 1000 for i in range(ctx - 1)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    st = RequestStats()
    n = sum(len(ev.tokens) for ev in engine.generate(ids, params, drafter=drafter, n_max=2 if drafter else 0, stats=st))
    peak = hwm()
    settle(drafter)
    return {"assistant": assistant, "ctx": ctx, "tokens": n, "drafted": st.spec.drafted, "accepted": st.spec.accepted,
            "rss_target_mib": target_mib, "rss_loaded_mib": loaded, "peak_generating_mib": peak, "rss_end_mib": rss(),
            "file_mib": Path(assistant).stat().st_size / 2**20 if assistant else 0.0,
            "weights_held_mib": held,
            "file_resident_mib": resident_bytes(os.path.realpath(assistant)) / 2**20 if assistant else 0.0}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--render":
        rerender()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3] if sys.argv[3] != "-" else None, int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    a = ap.parse_args()
    files = build()
    runs = {}
    for ctx in a.contexts:
        for fmt in ["none", *FORMATS]:
            asst = "-" if fmt == "none" else str(files[fmt])
            res = subprocess.run([sys.executable, __file__, "--child", str(files["target"]), asst, str(ctx)],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(res.stderr[-3000:])
            runs[(fmt, ctx)] = json.loads(res.stdout.strip().splitlines()[-1])
            print(fmt, ctx, runs[(fmt, ctx)], file=sys.stderr, flush=True)
    write_results("mtp_memory", {"machine": machine(), "contexts": a.contexts,
                                 "runs": [dict(r, format=f) for (f, _), r in runs.items()]}, render(runs, a.contexts))


def render(runs: dict, contexts: list) -> str:
    """The markdown table from runs[(format, L)]."""
    rows = []
    for fmt in FORMATS:
        cells = []
        for ctx in contexts:
            base, r = runs[("none", ctx)], runs[(fmt, ctx)]
            cells.append(f"{r['rss_loaded_mib'] - base['rss_loaded_mib']:.0f} / {r['rss_end_mib'] - base['rss_end_mib']:.0f}"
                         f" / {r['peak_generating_mib'] - base['peak_generating_mib']:.0f}")
        r0 = runs[(fmt, contexts[0])]
        held = f"{r0['weights_held_mib']:.0f}" if "weights_held_mib" in r0 else ""
        rows.append(f"| {fmt} ({FORMATS[fmt]}) | {r0['file_mib']:.0f} | {held} | " + " | ".join(cells) + " |")
    base = " | ".join(f"{runs[('none', c)]['rss_loaded_mib']:.0f} / {runs[('none', c)]['rss_end_mib']:.0f} / "
                      f"{runs[('none', c)]['peak_generating_mib']:.0f}" for c in contexts)
    return "\n".join([
        f"Machine: {machine()['cpu']}, {machine()['cores']} cores, 2 threads. Target: E2B-width synthetic Gemma 4 "
        "(Q8_0 GGUF); assistant: E2B-shaped, clustered head, QAT-like weights. Fresh process per cell; 32 greedy "
        "tokens after an L-token prompt, draft-mtp with n-max 2. Cells: MiB the assistant adds to the target's "
        "resident memory once loaded / after generating / to the peak while generating (live memory: freed heap "
        "returned with malloc_trim; the peak is reset after loading and includes transient buffers, so it varies "
        "from run to run). Each process first generates a few tokens and waits, twice, so that background "
        "regroups are done and the stored pages released before it measures. Weights held: the bytes the "
        "assistant's weights take as loaded (block-quantized matrices as stored, read from the mapped file as "
        "rows are needed: the clustered head's rows of the clusters a draft step scores).", "",
        "| assistant format | file MiB | weights held MiB | " + " | ".join(f"added at L={c}" for c in contexts) + " |",
        "|---|---:|---:|" + "---:|" * len(contexts),
        *rows,
        f"| (target alone, MiB) | | | {base} |"])


def rerender() -> None:
    """Rewrite the .md from the committed .json (no measuring)."""
    path = Path(__file__).parent / "results" / "mtp_memory.json"
    data = json.loads(path.read_text())
    runs = {(r["format"], r["ctx"]): r for r in data["runs"]}
    write_results("mtp_memory", data, render(runs, data["contexts"]))


if __name__ == "__main__":
    main()
