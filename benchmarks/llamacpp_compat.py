"""Do files written by `gemmaspec convert` run in llama.cpp, and compute the same thing?

Builds tiny random Gemma 4 checkpoints with transformers (an E2B-like one with per-layer embeddings,
KV sharing and a double-wide MLP; a k_eq_v one; a mixture-of-experts one), all carrying the real
Gemma tokenizer, converts them with `gemmaspec convert` (f32 and q8_0), and compares llama.cpp's logits
(llama-cpp-python 0.3.36, whose vendored llama.cpp knows `gemma4`) with gemmaspec's on the same file
and the same tokens (prompt + gemmaspec's greedy continuation, teacher-forced). With --llama-cli PATH (a `llama-cli` built from that same llama.cpp), it also
runs the target with the converted assistant under `--spec-type draft-mtp` and compares the text.

    python benchmarks/llamacpp_compat.py [--llama-cli /path/to/llama-cli] [--n 16]

Writes benchmarks/results/llamacpp_compat.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from common import llama_python, machine, tests_helper, write_results

from gemmaspec.loading.engine import load_engine
from gemmaspec.manage.default_model import default_model_path
from gemmaspec.loading.convert import convert
from gemmaspec.loading.gguf import load_gguf
from gemmaspec.sampling import SamplingParams

# as in the released models, the last layer before the KV-shared ones is full attention and the one
# before it sliding: llama.cpp's KV reuse assumes exactly that (src/llama-model.cpp, n_layer_kv_from_start)
LAYERS = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
          "full_attention"]
CONFIGS = {
    "e2b_like (PLE, KV sharing, double-wide MLP)": dict(hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                                                         use_double_wide_mlp=True),
    "k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    "moe": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
}
PROMPT = "The quick brown fox jumps over the lazy dog. Then"


def build(root: Path, tok, extra: dict, seed: int) -> Path:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    v = tok.vocab_size
    base = dict(vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, global_head_dim=64, sliding_window=32, layer_types=LAYERS,
                max_position_embeddings=2048, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=v)
    cfg = Gemma4TextConfig(**(base | extra))
    m = Gemma4ForCausalLM(cfg).eval()
    tests_helper("tiny_gemma4").randomize(m, seed)
    m.save_pretrained(root)
    tok.backend.save(str(root / "tokenizer.json"))
    return root


def ours(path: Path, n: int):
    """Prompt ids, greedy continuation, and teacher-forced logits [len, vocab] over prompt + continuation."""
    e = load_engine(path, ctx_size=512, device="cpu")
    ids = e.tokenizer.encode(PROMPT, add_bos=True)
    gen = [t for ev in e.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for t in ev.tokens]
    cache = e.model.new_cache(512)
    logits = e.model.forward(torch.tensor(ids + gen), cache, all_logits=True).logits
    return ids, gen, logits


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--llama-server", default=None, help="llama-server binary for the draft-mtp check")
    a = ap.parse_args()
    py = llama_python()
    tok = load_gguf(default_model_path()).tokenizer
    here = Path(__file__).resolve().parent
    rows, data = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed, (name, extra) in enumerate(CONFIGS.items()):
            hf = build(Path(tmp) / f"m{seed}", tok, extra, seed)
            for outtype in ("f32", "q8_0"):
                g = Path(tmp) / f"m{seed}-{outtype}.gguf"
                convert(hf, g, outtype)
                ids, mine, logits = ours(g, a.n)
                npy = Path(tmp) / "ll.npy"
                arg = json.dumps({"model": str(g), "prompt": PROMPT, "tokens": ids + mine, "out": str(npy)})
                res = subprocess.run([str(py), str(here / "llama_greedy.py"), arg], capture_output=True, text=True)
                if res.returncode != 0:
                    err = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"
                    rows.append(f"| {name} | {outtype} | no: {err} | | | |")
                    data.append({"config": name, "outtype": outtype, "error": err})
                    continue
                ll = json.loads(res.stdout.strip().splitlines()[-1])
                theirs = torch.from_numpy(np.load(npy))
                rel = float((theirs - logits).norm() / logits.norm())
                agree = float((theirs.argmax(-1) == logits.argmax(-1)).float().mean())
                rows.append(f"| {name} | {outtype} | yes | {'yes' if ll['prompt_ids'] == ids else 'no'} | "
                            f"{rel:.1e} | {agree:.0%} |")
                data.append({"config": name, "outtype": outtype, "prompt_ids_equal": ll["prompt_ids"] == ids,
                             "logits_rel_l2": rel, "argmax_agreement": agree})
                print(rows[-1], file=sys.stderr)
        table = "\n".join([f"Machine: {machine()['cpu']}; llama.cpp = llama-cpp-python 0.3.36 (vendored llama.cpp); "
                           f"greedy, {a.n} tokens", "",
                           "| tiny Gemma 4 config | GGUF type | loads in llama.cpp | same prompt ids | logits rel. L2 "
                           "(llama.cpp vs gemmaspec, teacher-forced) | same argmax |",
                           "|---|---|---|---|---:|---:|"] + rows + ["",
                           "q8_0: llama.cpp multiplies Q8_0 weights with activations it quantizes to 8 bits, gemmaspec with "
                           "float32 activations, hence the larger difference there."])
        if a.llama_server:
            mtp = draft_mtp_check(Path(tmp), tok, a.llama_server, a.n)
            data.append(mtp)
            table += ("\n\ndraft-mtp (llama-server, `--spec-type draft-mtp --spec-draft-n-max 2`, f32 GGUFs of a tiny "
                      f"E2B-like target and assistant): greedy tokens {'the same as' if mtp['same_tokens'] else 'DIFFERENT from'}"
                      f" gemmaspec's; llama.cpp drafted {mtp['llama.cpp']['draft_n']} and accepted "
                      f"{mtp['llama.cpp']['draft_n_accepted']}, gemmaspec drafted {mtp['gemmaspec']['draft_n']} and "
                      f"accepted {mtp['gemmaspec']['draft_n_accepted']}.")
    write_results("llamacpp_compat", {"machine": machine(), "runs": data}, table)


def draft_mtp_check(tmp: Path, tok, server: str, n: int) -> dict:
    """Serve a converted target + assistant with llama-server (draft-mtp) and compare with gemmaspec."""
    import socket
    import time
    import urllib.request

    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    from gemmaspec.engine import RequestStats
    from gemmaspec.speculative.config import SpecConfig
    from gemmaspec.speculative.plan import load_drafter

    hf = build(tmp / "mtp-target", tok, dict(hidden_size_per_layer_input=8, num_kv_shared_layers=2), 7)
    v = tok.vocab_size
    tc = Gemma4TextConfig(vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=32, global_head_dim=64, sliding_window=32,
                          layer_types=LAYERS[:3] + ["full_attention"], hidden_size_per_layer_input=0,
                          vocab_size_per_layer_input=0, max_position_embeddings=2048)
    asst = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=tc, backbone_hidden_size=64))
    tests_helper("tiny_gemma4").randomize(asst, 8)
    asst.save_pretrained(tmp / "mtp-assistant")
    tok.backend.save(str(tmp / "mtp-assistant" / "tokenizer.json"))
    t_gguf, a_gguf = tmp / "t.gguf", tmp / "a.gguf"
    convert(hf, t_gguf, "f32")
    convert(tmp / "mtp-assistant", a_gguf, "f32")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "-m", str(t_gguf), "-md", str(a_gguf), "--spec-type", "draft-mtp",
                             "--spec-draft-n-max", "2", "--host", "127.0.0.1", "--port", str(port), "-c", "512",
                             "-t", "2", "-ctk", "f32", "-ctv", "f32"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"prompt": PROMPT, "n_predict": n, "temperature": 0, "ignore_eos": True,
                           "return_tokens": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            got = json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    e = load_engine(t_gguf, ctx_size=512, device="cpu")
    ids = e.tokenizer.encode(PROMPT, add_bos=True)
    st = RequestStats()
    mine = [t for ev in e.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                   load_drafter(SpecConfig("draft-mtp", str(a_gguf)), e), n_max=2, stats=st)
            for t in ev.tokens]
    return {"check": "draft-mtp", "same_tokens": got.get("tokens") == mine,
            "llama.cpp": {"tokens": got.get("tokens"), "draft_n": got["timings"].get("draft_n"),
                          "draft_n_accepted": got["timings"].get("draft_n_accepted")},
            "gemmaspec": {"tokens": mine, "draft_n": st.spec.drafted, "draft_n_accepted": st.spec.accepted}}


if __name__ == "__main__":
    main()
