"""Does llama.cpp load the mmproj GGUFs `gemmaspec convert --mmproj` writes, and compute the same thing?

Builds tiny random multimodal checkpoints with transformers in the real layout (Gemma 3: SigLIP +
projector, the `gemma3` projector type; Gemma 4: the 2-D-RoPE encoder, pooler and embedder, `gemma4v`),
with Gemma's real vocabulary (the default model's, plus the image tokens it lacks), writes the target
as GGUF (Gemma 4: `gemmaspec convert`; Gemma 3, which `convert` does not write: the HF tensors under
llama.cpp's names, as its converter stores them) and the projector with `gemmaspec convert --mmproj`,
both f32, then runs llama.cpp's `llama-mtmd-cli` (built from the llama.cpp vendored in
llama-cpp-python 0.3.36, `common.llama_mtmd_cli`) and `gemmaspec generate --image` on the same files,
image and prompt, greedy. It records whether llama.cpp loaded the projector, how many tokens each side
gave the image and whether the greedy tokens agree; images of several shapes show where the two
preprocessings part (see docs/usage.md, "llama.cpp and our mmproj files").

    python benchmarks/mmproj_check.py [--n 8] [--build]

Without --build it needs llama-mtmd-cli built already (`common.llama_mtmd_cli()`; a few minutes
after llama-bench / llama-server, ~10 minutes from nothing). Writes benchmarks/results/mmproj_check.json
and .md.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from common import llama_mtmd_cli, machine, tests_helper, user_env, write_results

import gguf

from gemmaspec.loading.convert import convert
from gemmaspec.loading.gguf import load_gguf
from gemmaspec.manage.default_model import default_model_path

MARK = "<__media__>"  # llama-mtmd-cli's image marker
# llama-mtmd-cli always renders a chat template; this one writes the message as it is, so both programs
# read the same text (the Gemma turn markup is spelled in the prompt itself)
IDENTITY_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
TURN = "<start_of_turn>user\n{image}Describe this picture in detail.<end_of_turn>\n<start_of_turn>model\n"
# Gemma 4 as llama.cpp's converter lays out a KV-shared model: the last layer before the shared ones full,
# the one before it sliding (benchmarks/llamacpp_compat.py)
G4_LAYERS = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
             "full_attention"]


def real_tokenizer():
    """Gemma's vocabulary (the default model's tokenizer, 262144 tokens) as a ``tokenizers.Tokenizer``."""
    return load_gguf(default_model_path()).tokenizer.backend


def with_tokens(tok, names: list[str]):
    """``tok`` with control tokens ``names`` appended; their ids."""
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    return [tok.token_to_id(n) for n in names]


# --- Gemma 3 -------------------------------------------------------------------------------------------

def gemma3_files(root: Path) -> tuple[Path, Path]:
    """A tiny Gemma 3 multimodal checkpoint with Gemma's vocabulary (+ ``<image_soft_token>`` at 262144,
    as in the released 4B), its text model as a ``gemma3`` GGUF and its projector as an mmproj GGUF."""
    from gemmaspec.loading.vision import write_mmproj

    base = gguf.GGUFReader(str(default_model_path()))
    tokens = [bytes(base.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8", "surrogateescape")
              for i in base.fields["tokenizer.ggml.tokens"].data]
    boi, eoi, img = tokens.index("<start_of_image>"), tokens.index("<end_of_image>"), len(tokens)
    tv = tests_helper("tiny_gemma3_vision")
    hf = root / "g3-hf"
    tv.tiny_multimodal(hf, vocab=len(tokens) + 1, image_ids=(boi, eoi, img))
    target = gemma3_gguf(hf, root / "g3-f32.gguf", base, extra_token="<image_soft_token>")
    mmproj = write_mmproj(hf, root / "mmproj-g3-f32.gguf", force=True, outtype="f32")
    return target, Path(mmproj)


def gemma3_gguf(hf: Path, out: Path, base: gguf.GGUFReader, extra_token: str) -> Path:
    """The text model of a Gemma 3 checkpoint as llama.cpp's converter writes it (arch ``gemma3``, f32):
    its tensors under llama.cpp's names, norms stored as ``1 + weight``, the tied head left out, and
    ``base``'s tokenizer with ``extra_token`` appended as a control token."""
    from gemmaspec.loading.safetensors import hf_checkpoint

    arch, c, _, tensors = hf_checkpoint(hf)
    w = gguf.GGUFWriter(str(out), "gemma3")
    w.add_name("tiny-gemma3-mm")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, v in (("context_length", c.context_length), ("embedding_length", c.hidden_size),
                   ("block_count", c.num_layers), ("feed_forward_length", c.intermediate_size),
                   ("attention.head_count", c.num_heads), ("attention.head_count_kv", c.num_kv_heads),
                   ("attention.key_length", c.head_dim), ("attention.value_length", c.head_dim),
                   ("attention.sliding_window", c.sliding_window)):
        w.add_uint32(f"gemma3.{key}", int(v))
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", float(c.rms_norm_eps))
    w.add_float32("gemma3.rope.freq_base", float(c.rope_theta_global))
    w.add_float32("gemma3.rope.freq_base_swa", float(c.rope_theta_local))
    for name, field in base.fields.items():
        if not name.startswith("tokenizer.") or name == "tokenizer.chat_template":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            if field.types[-1] == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            extra = {"tokenizer.ggml.tokens": extra_token, "tokenizer.ggml.scores": 0.0,
                     "tokenizer.ggml.token_type": int(gguf.TokenType.CONTROL)}
            if name in extra:
                val.append(extra[name])
            w.add_array(name, val)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            w.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
    for name, t in sorted(tensors.items()):
        if name == "output.weight":
            continue  # tied to token_embd, as llama.cpp reads it
        v = arch.hf_value(name, t.load().float()) if arch.hf_value else t.load().float()
        w.add_tensor(name, v.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# --- Gemma 4 -------------------------------------------------------------------------------------------

def gemma4_files(root: Path) -> tuple[Path, Path]:
    """A tiny Gemma 4 multimodal checkpoint (``use_bidirectional_attention="vision"``, per-layer
    embeddings, KV sharing) with Gemma's vocabulary plus ``<|image>``, ``<image|>``, ``<|image|>``,
    converted with ``gemmaspec convert`` (f32) and ``gemmaspec convert --mmproj`` (f32)."""
    from gemmaspec.loading.vision import write_mmproj

    tok = real_tokenizer()
    ids = with_tokens(tok, ["<|image>", "<image|>", "<|image|>"])
    v = tok.get_vocab_size()
    sys.modules.setdefault("tiny_gemma4", tests_helper("tiny_gemma4"))  # what tiny_gemma4_vision imports
    tv = tests_helper("tiny_gemma4_vision")
    hf = root / "g4-hf"
    tv.tiny_multimodal(hf, text=dict(vocab_size=v, vocab_size_per_layer_input=v, layer_types=G4_LAYERS,
                                     max_position_embeddings=2048),
                       image_ids=tuple(ids), tok=tok, max_soft_tokens=280)
    target = root / "g4-f32.gguf"
    convert(hf, target, "f32", force=True)
    mmproj = write_mmproj(hf, root / "mmproj-g4-f32.gguf", force=True, outtype="f32")
    return target, Path(mmproj)


# --- the two programs ----------------------------------------------------------------------------------

def image_file(path: Path, width: int, height: int, seed: int) -> Path:
    """A PNG of smooth colour gradients plus noise (so both the layout and the resampling matter)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([255 * x / max(1, width - 1), 255 * y / max(1, height - 1),
                     127 + 100 * np.sin((x + y) / 5.0)], axis=-1)
    arr = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    Image.fromarray(arr, "RGB").save(path)
    return path


def run_llama(cli: Path, model: Path, mmproj: Path, image: Path, prompt: str, n: int, extra: list[str]) -> dict:
    """llama-mtmd-cli, greedy, CPU, verbose (its log says the projector, the image's token count and
    whether the image was decoded non-causally): ``{ok, loaded, projector, image_tokens, non_causal,
    text, errors, hparams, log_tail}``."""
    cmd = [str(cli), "-m", str(model), "--mmproj", str(mmproj), "--image", str(image), "-p", prompt,
           "-n", str(n), "--temp", "0", "--seed", "42", "-ngl", "0", "-t", "2", "-c", "512",
           "--jinja", "--chat-template", IDENTITY_TEMPLATE, "-v", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, env=user_env(), timeout=600)
    log = res.stderr
    proj = re.search(r"load_hparams: projector:\s*(\S+)", log)
    toks = [int(x) for x in re.findall(r"n_tokens_batch = (\d+)", log)]
    hparams = [ln.split("load_hparams:", 1)[1].strip() for ln in log.splitlines() if "load_hparams:" in ln]
    errors = [ln.strip() for ln in log.splitlines()
              if re.search(r"\b(error|failed|unknown projector|not supported)\b", ln, re.I) and " D " not in ln]
    info = [ln.strip() for ln in log.splitlines() if re.match(r"^[\d.]+ [IWE] ", ln)]
    return {"ok": res.returncode == 0, "rc": res.returncode, "loaded": proj is not None and "clip_init: failed" not in log,
            "projector": proj.group(1) if proj else None, "image_tokens": sum(toks) if toks else None,
            "non_causal": "set_causal_attn: value = 0" in log, "text": res.stdout, "errors": errors[:8],
            "hparams": hparams, "cmd": cmd, "log_tail": info[-12:]}


def run_ours(model: Path, mmproj: Path, image: Path, prompt: str, n: int) -> dict:
    """gemmaspec: the ids and greedy tokens in-process (what ``generate --image`` runs), then the
    ``gemmaspec generate --image`` command itself for its text."""
    import gemmaspec.cli.images as cli_images
    from gemmaspec.loading.engine import load_engine
    from gemmaspec.multimodal import image_prompt
    from gemmaspec.sampling import SamplingParams

    e = load_engine(model, ctx_size=512, device="cpu")
    vision = cli_images.load_projector(str(mmproj), e)
    im = cli_images.read_image(str(image), vision)
    ids, spans = image_prompt(e.tokenizer, vision.model, prompt, [im])
    gen = [t for ev in e.generate(ids, SamplingParams(temperature=0, max_tokens=n), images=spans) for t in ev.tokens]
    # each step's top 5 (teacher-forced over the greedy tokens): where llama.cpp parts, is it a near tie?
    logits = e.model.forward(torch.tensor(ids + gen), e.model.new_cache(512), all_logits=True,
                             images=[(sp.start, sp.embeddings) for sp in spans]).logits[len(ids) - 1:]
    top = [[(int(i), e.tokenizer.decode([int(i)]), float(v)) for v, i in zip(*torch.topk(row, 5))] for row in logits]
    cmd = [sys.executable, "-m", "gemmaspec", "generate", "-m", str(model), "--mmproj", str(mmproj), "--image",
           str(image), "-p", prompt, "-n", str(n), "--temp", "0", "-s", "42", "-c", "512", "--spec-type", "none"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return {"ok": res.returncode == 0, "image_tokens": spans[0].end - spans[0].start, "prompt_tokens": len(ids),
            "ids": gen, "pieces": [e.tokenizer.decode([t]) for t in gen], "top5": top, "text": res.stdout,
            "error": res.stderr.strip().splitlines()[-1] if res.returncode else None, "cmd": cmd}


def same_text(a: str, b: str) -> bool:
    return a.strip() == b.strip()


def parting(llama_text: str, ours: dict) -> dict | None:
    """Where llama.cpp's greedy text leaves gemmaspec's tokens: the step, and which of gemmaspec's top 5
    at that step llama.cpp's text continues with (``rank`` 2 and a small ``margin``, the logit gap to
    gemmaspec's choice: a near tie that float rounding decides, not a different computation)."""
    text, at = llama_text.lstrip("\n"), 0  # llama-mtmd-cli starts its answer on a new line
    for k, piece in enumerate(ours["pieces"]):
        if text.startswith(piece, at):
            at += len(piece)
            continue
        rest = text[at:]
        for rank, (tid, cand, logit) in enumerate(ours["top5"][k], 1):
            if cand and rest.startswith(cand):
                return {"step": k, "llama_token_rank_in_gemmaspec": rank, "llama_token": cand,
                        "margin": ours["top5"][k][0][2] - logit}
        return {"step": k, "llama_token_rank_in_gemmaspec": None, "llama_text_from_here": rest[:40]}
    return None


CASES = {
    # name: (architecture, width, height, llama-mtmd-cli extra flags, what the case looks at)
    "gemma3 56x56": ("gemma3", 56, 56, [], "the tower's own size: no resize on either side"),
    "gemma3 112x112": ("gemma3", 112, 112, [], "square, downscaled (bilinear: Pillow vs llama.cpp's Pillow-like resampler)"),
    "gemma3 80x60": ("gemma3", 80, 60, [], "not square: transformers stretches it to the square, llama.cpp letterboxes it"),
    "gemma4 240x168": ("gemma4", 240, 168, [], "exactly 280 soft tokens at its size: no resize on either side"),
    "gemma4 400x300 max 280": ("gemma4", 400, 300, ["--image-max-tokens", "280"],
                               "downscaled to the same 228x168 grid (llama.cpp capped at 280 tokens); llama.cpp keeps "
                               "the aspect and pads, transformers stretches"),
    "gemma4 50x40": ("gemma4", 50, 40, [], "small: transformers fills the 280-token budget, llama.cpp scales up only to "
                                         "its 70-token minimum"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8, help="greedy tokens to generate (default 8)")
    ap.add_argument("--build", action="store_true", help="build llama-mtmd-cli if it is not built yet")
    ap.add_argument("--only", default=None, help="run only the cases whose name contains this")
    ap.add_argument("--keep", default=None, help="write the checkpoints and GGUFs here and keep them (reused "
                                                "when there already)")
    a = ap.parse_args()
    cli = llama_mtmd_cli(build=a.build)
    if cli is None:
        sys.exit("llama-mtmd-cli is not built: run with --build (or common.llama_mtmd_cli())")
    torch.set_num_threads(2)
    runs, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.keep) if a.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        files = {}
        for name, (arch, w, h, extra, why) in CASES.items():
            if a.only and a.only not in name:
                continue
            if arch not in files:
                done = (root / f"{arch[:1]}{arch[-1]}-f32.gguf", root / f"mmproj-{arch[:1]}{arch[-1]}-f32.gguf")
                files[arch] = done if a.keep and all(f.exists() for f in done) else \
                    (gemma3_files if arch == "gemma3" else gemma4_files)(root)
            target, mmproj = files[arch]
            image = image_file(root / f"{name.replace(' ', '-')}.png", w, h, seed=w * 1000 + h)
            marker = "<start_of_image>" if arch == "gemma3" else "<|image|>"
            # transformers' Gemma 3 processor writes "\n\n" around an image (gemmaspec too); llama.cpp
            # does not, so its prompt spells them
            lmark = f"\n\n{MARK}\n\n" if arch == "gemma3" else MARK
            ll = run_llama(cli, target, mmproj, image, TURN.format(image=lmark), a.n, extra)
            ours = run_ours(target, mmproj, image, TURN.format(image=marker), a.n)
            agree = ll["ok"] and ours["ok"] and same_text(ll["text"], ours["text"])
            part = None if agree or not ll["ok"] else parting(ll["text"], ours)
            run = {"case": name, "arch": arch, "image": [w, h], "why": why, "llama_extra_flags": extra,
                   "llama.cpp": ll, "gemmaspec": ours, "same_text": agree, "parting": part}
            runs.append(run)
            loaded = "yes" if ll["loaded"] else f"no: {'; '.join(ll['errors'][:2]) or ll['log_tail'][-1:]}"
            flags = f" `{' '.join(extra)}`" if extra else ""
            same = "yes" if agree else "no"
            if part and part["step"] > 0:
                same += f": the first {part['step']} agree"
                if part.get("llama_token_rank_in_gemmaspec"):
                    same += (f", then llama.cpp takes gemmaspec's #{part['llama_token_rank_in_gemmaspec']} "
                             f"(logit {part['margin']:.3f} below its #1)")
            rows.append(f"| {name}{flags} | {ll['projector'] or '?'} | {loaded} | {ll['image_tokens']} | "
                        f"{ours['image_tokens']} | {same} | {ll['text'].strip()!r} | "
                        f"{ours['text'].strip()!r} | {why} |")
            print(rows[-1], file=sys.stderr)
    table = "\n".join([
        f"Machine: {machine()['cpu']}; llama.cpp: llama-mtmd-cli built from llama-cpp-python 0.3.36's vendored "
        f"sources; tiny random checkpoints (Gemma's vocabulary), target and mmproj GGUF f32; greedy, {a.n} tokens, "
        "-ngl 0, same prompt text on both sides", "",
        "| case | projector | llama.cpp loads the mmproj | image tokens (llama.cpp) | image tokens (gemmaspec) | "
        "same greedy text | llama.cpp | gemmaspec | what it looks at |",
        "|---|---|---|---:|---:|---|---|---|---|"] + rows)
    write_results("mmproj_check", {"machine": machine(), "n": a.n, "runs": runs}, table)


if __name__ == "__main__":
    main()
