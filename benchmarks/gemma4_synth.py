"""Full-size synthetic Gemma 4 GGUFs for speed measurements: the shapes of the released models, random
weights that lie on the Q4_0 grid, in llama.cpp's layout, so both engines load the same file.

No Gemma 4 weights can be downloaded here, and decode speed depends on shapes and storage types, not on
the values. So each matrix is written as Q4_0 blocks with random levels (16 random nibbles and an fp16
scale per 32 values; values ~ N(0, 0.7/sqrt(in_features)) in spread), the token embedding as Q4_0 or Q8_0,
norms as float32 around 1, the per-layer output scale as float32 0.5-1. The text such a model writes is
noise; its logits still depend on every weight, so both engines' logits can be compared.

Shapes (``SHAPES``): E2B and E4B from the released configs as ``../shared/DESIGN.md`` records them (35
layers of width 1536, 20 KV-shared; 42 of width 2560, 18 shared; per-layer embeddings of 256; double-wide
MLPs on the KV-shared layers; sliding window 512; one full layer in 5 resp. 6); ``12b``: 48 layers of
width 3840, window 1024, K-as-V on full layers, no per-layer embeddings; its head counts and MLP width
are assumptions (16 query heads, 8 KV heads, 4 on full layers, MLP 15,360), marked as such in the
metadata's ``general.description``. The matching assistant (``--assistant``): 4 layers of width 256
over the target's KV cache, a clustered head of 2,048 centroids (top 32), as Google's drafters.

The tokenizer (262,144 entries) is copied from the embedded default model (Gemma 3 270M, the same
vocabulary size), so ``gemmaspec`` and llama.cpp tokenize prompts as for a real model.

Writes through :class:`gemmaspec.loading.gguf_out.StreamingGGUF` a few million values at a time
(an E2B file is 2.6 GB; nothing of that size is held in memory), metadata through the converter's own
``_add_text_params`` (the keys llama.cpp reads).

    python benchmarks/gemma4_synth.py e2b [--out DIR] [--embd q4_0|q8_0] [--assistant] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from gemmaspec.loading.convert import _add_text_params, _rope_freqs
from gemmaspec.loading.gguf_out import StreamingGGUF
from gemmaspec.manage.default_model import default_model_path
from gemmaspec.models.config import Gemma4Config

VOCAB = 262_144


def _types(n: int, every: int) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(n))


SHAPES = {
    "e2b": Gemma4Config(vocab_size=VOCAB, hidden_size=1536, num_layers=35, intermediate_size=6144, num_heads=8,
                        num_kv_heads=1, layer_types=_types(35, 5), hidden_size_per_layer_input=256,
                        vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=20, use_double_wide_mlp=True),
    "e4b": Gemma4Config(vocab_size=VOCAB, hidden_size=2560, num_layers=42, intermediate_size=10240, num_heads=8,
                        num_kv_heads=2, layer_types=_types(42, 6), hidden_size_per_layer_input=256,
                        vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=18, use_double_wide_mlp=True),
    "12b": Gemma4Config(vocab_size=VOCAB, hidden_size=3840, num_layers=48, intermediate_size=15360, num_heads=16,
                        num_kv_heads=8, num_global_kv_heads=4, attention_k_eq_v=True, sliding_window=1024,
                        layer_types=_types(48, 6)),
}
NOTES = {"e2b": "E2B-shaped (released config)", "e4b": "E4B-shaped (released config)",
         "12b": "12B-shaped: 48 layers, width 3840, window 1024 as released; head counts and MLP width assumed"}

_Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])


def random_blocks(rng: np.random.Generator, n_values: int, fan_in: int, qtype: T) -> np.ndarray:
    """``n_values`` values (a multiple of 32) as random on-grid blocks of ``qtype`` (Q4_0 or Q8_0): levels
    uniform over the grid, scales drawn so the values spread as 0.7/sqrt(fan_in)."""
    nb = n_values // 32
    sigma = 0.7 / fan_in ** 0.5
    if qtype == T.Q4_0:
        out = np.empty(nb, _Q4_0)
        out["qs"] = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
        level_sd = 4.61  # sd of uniform integers -8..7
    else:
        out = np.empty(nb, _Q8_0)
        out["qs"] = rng.integers(-127, 128, size=(nb, 32), dtype=np.int8)
        level_sd = 73.6
    out["d"] = (sigma / level_sd * rng.uniform(0.5, 1.5, size=nb)).astype(np.float16)
    return out


def _matrix(s, rng, name: str, rows: int, cols: int, qtype: T = T.Q4_0) -> None:
    """Tensor ``name`` of numpy shape [rows, cols] (rows = output features), streamed in chunks."""
    s.begin(name, (rows, cols), qtype)
    step = max(1, (8 << 20) // cols)
    for r0 in range(0, rows, step):
        s.write(random_blocks(rng, min(step, rows - r0) * cols, cols, qtype))
    s.end()


def _vector(s, name: str, values: np.ndarray) -> None:
    s.begin(name, values.shape, T.F32)
    s.write(values.astype(np.float32))
    s.end()


def _norm(s, rng, name: str, n: int) -> None:
    _vector(s, name, 1.0 + 0.1 * rng.standard_normal(n))


def _copy_tokenizer(w: gguf.GGUFWriter, reader: gguf.GGUFReader) -> None:
    """Every ``tokenizer.*`` key of ``reader`` into ``w`` (same types)."""
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            w.add_array(name, val)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            w.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)


def _layer_attention(s, rng, c: Gemma4Config, i: int, width: int, own_kv: bool) -> None:
    p, d = f"blk.{i}.", c.layer_head_dim(i)
    _norm(s, rng, p + "attn_norm.weight", width)
    _matrix(s, rng, p + "attn_q.weight", c.num_heads * d, width)
    _norm(s, rng, p + "attn_q_norm.weight", d)
    if own_kv:
        kv = c.layer_kv_heads(i)
        _matrix(s, rng, p + "attn_k.weight", kv * d, width)
        _norm(s, rng, p + "attn_k_norm.weight", d)
        if not (c.attention_k_eq_v and c.layer_types[i] == "full"):
            _matrix(s, rng, p + "attn_v.weight", kv * d, width)
    _matrix(s, rng, p + "attn_output.weight", width, c.num_heads * d)
    _norm(s, rng, p + "post_attention_norm.weight", width)


def _layer_mlp(s, rng, i: int, width: int, ff: int) -> None:
    p = f"blk.{i}."
    _norm(s, rng, p + "ffn_norm.weight", width)
    _matrix(s, rng, p + "ffn_gate.weight", ff, width)
    _matrix(s, rng, p + "ffn_up.weight", ff, width)
    _matrix(s, rng, p + "ffn_down.weight", width, ff)
    _norm(s, rng, p + "post_ffw_norm.weight", width)
    _vector(s, p + "layer_output_scale.weight", rng.uniform(0.5, 1.0, size=1))


def ffn_widths(c: Gemma4Config) -> list[int]:
    """MLP width per layer: double on the KV-shared layers when ``use_double_wide_mlp``."""
    first_shared = c.num_layers - c.num_kv_shared_layers
    return [c.intermediate_size * (2 if c.use_double_wide_mlp and i >= first_shared else 1)
            for i in range(c.num_layers)]


def write_target(shape: str, out: Path, embd: T, seed: int, tokenizer: gguf.GGUFReader) -> Path:
    c = SHAPES[shape]
    rng = np.random.default_rng(seed)
    n_ff, src = ffn_widths(c), c.kv_source()
    with StreamingGGUF(out, "gemma4", force=True) as s:
        _vector(s, "rope_freqs.weight", _rope_freqs(c))
        _matrix(s, rng, "token_embd.weight", c.vocab_size, c.hidden_size, embd)
        if c.hidden_size_per_layer_input:
            ple = c.num_layers * c.hidden_size_per_layer_input
            _matrix(s, rng, "per_layer_token_embd.weight", c.vocab_size, ple)
            _matrix(s, rng, "per_layer_model_proj.weight", ple, c.hidden_size)
            _norm(s, rng, "per_layer_proj_norm.weight", c.hidden_size_per_layer_input)
        for i in range(c.num_layers):
            _layer_attention(s, rng, c, i, c.hidden_size, own_kv=src[i] == i)
            _layer_mlp(s, rng, i, c.hidden_size, n_ff[i])
            if c.hidden_size_per_layer_input:
                p = f"blk.{i}."
                _matrix(s, rng, p + "inp_gate.weight", c.hidden_size_per_layer_input, c.hidden_size)
                _matrix(s, rng, p + "proj.weight", c.hidden_size, c.hidden_size_per_layer_input)
                _norm(s, rng, p + "post_norm.weight", c.hidden_size)
        _norm(s, rng, "output_norm.weight", c.hidden_size)

        def meta(w: gguf.GGUFWriter) -> None:
            w.add_name(f"gemmaspec synthetic gemma4 {shape}")
            w.add_description(f"random on-grid Q4_0 weights, {NOTES[shape]}; for speed measurements only")
            w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
            _add_text_params(w, c, n_ff)
            _copy_tokenizer(w, tokenizer)

        s.finish(meta)
    return out


def assistant_config(c: Gemma4Config) -> Gemma4Config:
    """The drafter's own layers for target ``c``: width 256, 4 layers (sliding x3, full), the target's
    head dims and KV heads (it reads the target's cache), no per-layer inputs."""
    return dataclasses.replace(c, hidden_size=256, num_layers=4, intermediate_size=2048,
                               layer_types=("sliding", "sliding", "sliding", "full"), hidden_size_per_layer_input=0,
                               vocab_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False)


def write_assistant(shape: str, out: Path, seed: int, tokenizer: gguf.GGUFReader,
                    centroids: int = 2048, top_k: int = 32) -> Path:
    target = SHAPES[shape]
    c = assistant_config(target)
    rng = np.random.default_rng(seed + 1)
    with StreamingGGUF(out, "gemma4-assistant", force=True) as s:
        _vector(s, "rope_freqs.weight", _rope_freqs(c))
        _matrix(s, rng, "token_embd.weight", c.vocab_size, c.hidden_size)
        _matrix(s, rng, "nextn.pre_projection.weight", c.hidden_size, 2 * target.hidden_size)
        for i in range(c.num_layers):
            _layer_attention(s, rng, c, i, c.hidden_size, own_kv=False)
            _layer_mlp(s, rng, i, c.hidden_size, c.intermediate_size)
        _norm(s, rng, "output_norm.weight", c.hidden_size)
        _matrix(s, rng, "nextn.post_projection.weight", target.hidden_size, c.hidden_size)
        _matrix(s, rng, "masked_embd_centroids.weight", centroids, c.hidden_size)
        s.begin("masked_embd_ordering", (c.vocab_size,), T.I32)
        s.write(rng.permutation(c.vocab_size).astype(np.int32))
        s.end()

        def meta(w: gguf.GGUFWriter) -> None:
            w.add_name(f"gemmaspec synthetic gemma4 {shape} assistant")
            w.add_description(f"random on-grid Q4_0 weights, the assistant of the {NOTES[shape]} target")
            w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
            _add_text_params(w, c, [c.intermediate_size] * c.num_layers)
            w.add_embedding_length_out(target.hidden_size)
            w.add_nextn_predict_layers(c.num_layers)
            w.add_uint32("gemma4-assistant.num_centroids", centroids)
            w.add_uint32("gemma4-assistant.centroid_top_k", top_k)
            _copy_tokenizer(w, tokenizer)

        s.finish(meta)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", default="benchmarks/models", help="folder for the files (default benchmarks/models)")
    ap.add_argument("--embd", choices=("q4_0", "q8_0"), default="q4_0", help="token embedding type")
    ap.add_argument("--assistant", action="store_true", help="also write the matching assistant")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tokenizer = gguf.GGUFReader(str(default_model_path()))
    embd = T.Q4_0 if a.embd == "q4_0" else T.Q8_0
    paths = [write_target(a.shape, out / f"gemma4-{a.shape}-synth-q4_0.gguf", embd, a.seed, tokenizer)]
    if a.assistant:
        paths.append(write_assistant(a.shape, out / f"gemma4-{a.shape}-synth-assistant-q4_0.gguf", a.seed, tokenizer))
    for p in paths:
        print(f"{p}: {p.stat().st_size / 1e9:.2f} GB", file=sys.stderr)
    print(f"written in {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
