"""The Gemma 4 assistant drafter at its released size: draft-step time (full vs clustered head) and
the memory it adds, by weight format.

Synthetic weights with the shapes of the E2B assistant (4 layers of width 256, vocabulary 262,144,
2,048 centroids, top 32 clusters; target width 1,536, head dims 256/512, one KV head) — no real
weights can be had here, and speed and memory depend only on the shapes. The target's KV cache is
synthetic too (random keys for L cached positions). Each measurement runs in a fresh process:

    resident memory added = RSS after building the drafter and drafting at L - RSS before
    step time = median ms of one draft step (all 4 layers + head), 2 threads

    python benchmarks/mtp_drafter.py [--contexts 512 4096]

Writes benchmarks/results/mtp_drafter.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import machine, write_results

V, H, HB, LAYERS, HEADS, FF = 262_144, 256, 1536, ["sliding", "sliding", "sliding", "full"], 4, 2048
N_CENTROIDS, TOP_K = 2048, 32


def child(fmt: str, clustered: bool, ctx: int) -> dict:
    import torch

    from gemmaspec.models.config import Gemma4AssistantConfig, Gemma4Config
    from gemmaspec.models.gemma4 import hf_to_gguf_name
    from gemmaspec.kernels import QuantizedWeight
    from gemmaspec.models.gemma4_assistant import Gemma4Assistant

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    torch.set_num_threads(2)
    torch.manual_seed(0)
    before = rss_mb()

    def mat(n, k):
        w = torch.randn(n, k) * (1 / k ** 0.5)
        if fmt == "f32":
            return w
        if fmt == "bf16":
            return w.bfloat16().float()  # held as float32 for the matmul; counted at 4 bytes/param
        g = w.view(n, k // 32, 32)
        scale = g.abs().amax(-1) / (127 if fmt == "q8_0" else 8)
        q = torch.round(g / scale[..., None]).clamp(-128 if fmt == "q8_0" else -8, 127 if fmt == "q8_0" else 7)
        return QuantizedWeight(q.to(torch.int8).view(n, k), scale.float(), None, 32)

    cfg = Gemma4Config(vocab_size=V, hidden_size=H, num_layers=4, intermediate_size=FF, num_heads=HEADS, num_kv_heads=1,
                       head_dim=256, global_head_dim=512, layer_types=tuple(LAYERS), num_kv_shared_layers=4)
    w = {"model.norm.weight": torch.ones(H), "pre_projection.weight": mat(H, 2 * HB),
         "post_projection.weight": mat(HB, H), "model.embed_tokens.weight": mat(V, H)}
    for i, kind in enumerate(LAYERS):
        d = 512 if kind == "full" else 256
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
                  p + "pre_feedforward_layernorm.weight": torch.ones(H), p + "post_feedforward_layernorm.weight": torch.ones(H),
                  p + "self_attn.q_proj.weight": mat(HEADS * d, H), p + "self_attn.q_norm.weight": torch.ones(d),
                  p + "self_attn.o_proj.weight": mat(H, HEADS * d), p + "mlp.gate_proj.weight": mat(FF, H),
                  p + "mlp.up_proj.weight": mat(FF, H), p + "mlp.down_proj.weight": mat(H, FF),
                  p + "layer_scalar": torch.ones(1)})
    if clustered:
        w["masked_embedding.centroids.weight"] = mat(N_CENTROIDS, H)
        w["masked_embedding.token_ordering"] = torch.randperm(V)
    w = {hf_to_gguf_name(k, len(LAYERS)): v for k, v in w.items()}  # transformers names -> the models' GGUF names
    acfg = Gemma4AssistantConfig(cfg, HB, N_CENTROIDS if clustered else 0, TOP_K if clustered else 0)
    asst = Gemma4Assistant(acfg, w)
    loaded = rss_mb()
    # the target's cache: built here only to time attention over it; it is the target's memory, not the drafter's
    kv = {"sliding": (torch.randn(min(ctx, 512), 1, 256), torch.randn(min(ctx, 512), 1, 256), None),
          "full": (torch.randn(ctx, 1, 512), torch.randn(ctx, 1, 512), None)}
    kv_mb = sum(t.numel() * 4 for k in kv.values() for t in k[:2]) / 2**20
    x, h = torch.randn(HB), torch.randn(HB)
    times = []
    with torch.inference_mode():
        for i in range(25):
            t = time.perf_counter()
            logits, h = asst.step(x, h, ctx, kv)
            int(logits.argmax())
            if i >= 5:
                times.append((time.perf_counter() - t) * 1e3)
    after = rss_mb()
    weight_mb = sum((v.nbytes if isinstance(v, QuantizedWeight) else v.numel() * v.element_size()) for v in w.values()) / 2**20
    return {"format": fmt, "clustered": clustered, "ctx": ctx, "step_ms": statistics.median(times),
            "weights_mb": weight_mb, "rss_added_by_weights_mb": loaded - before,
            "rss_added_while_drafting_mb": after - loaded - kv_mb}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    a = ap.parse_args()
    rows, runs = [], []
    for fmt in ("f32", "q8_0", "q4_0"):
        for clustered in (False, True):
            for ctx in a.contexts:
                res = subprocess.run([sys.executable, __file__, "--child", fmt, "1" if clustered else "0", str(ctx)],
                                     capture_output=True, text=True, check=True)
                r = json.loads(res.stdout.strip().splitlines()[-1])
                runs.append(r)
                rows.append(f"| {fmt} | {'clustered' if clustered else 'full'} | {ctx} | {r['step_ms']:.2f} | "
                            f"{r['weights_mb']:.0f} | {r['rss_added_by_weights_mb']:.0f} | {r['rss_added_while_drafting_mb']:.0f} |")
                print(rows[-1], file=sys.stderr)
    table = "\n".join([
        f"Machine: {machine()['cpu']}, 2 threads. E2B-shaped assistant, synthetic weights; L = cached target positions.",
        "q8_0 and q4_0 are multiplied as stored (1.06 and 0.56 bytes per weight, as on disk).", "",
        "| weights | head | L | draft step (ms) | weights (MiB) | RSS added by weights (MiB) | RSS added while drafting (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|"] + rows)
    write_results("mtp_drafter", {"machine": machine(), "runs": runs}, table)


if __name__ == "__main__":
    main()
