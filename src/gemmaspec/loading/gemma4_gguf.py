"""Gemma 4 targets and assistants in GGUF, in llama.cpp's naming and metadata.

Writing follows llama.cpp's converter (``conversion/gemma.py``: ``Gemma4Model``,
``Gemma4AssistantModel``) so the files load in llama.cpp too: arch ``gemma4`` / ``gemma4-assistant``,
per-type head dims (``key_length`` = full, ``key_length_swa`` = sliding), the sliding-window pattern
as a bool array, ``shared_kv_layers``, per-layer FFN and KV-head arrays, a ``rope_freqs`` tensor
that leaves the unrotated frequencies of proportional RoPE still (factor 1e30), router scale as
``ffn_gate_inp.scale`` and per-expert scale as ``ffn_down_exps.scale``. Unlike llama.cpp's converter
we keep the assistant's clustered-head tensors (``masked_embd_centroids``, ``masked_embd_ordering``).
Tensor names come from ``gguf.TensorNameMap``; the assistant's extra names from llama.cpp's
``gguf-py`` (the ``gguf`` release on PyPI does not know ``gemma4-assistant`` yet).

Reading maps the names back to transformers' and builds the same models as the safetensors path.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from ..config import Gemma4Config
from ..errors import InputError, ModelFileError

ARCH_TARGET, ARCH_ASSISTANT = "gemma4", "gemma4-assistant"
OUTTYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}

_SPECIAL = {  # transformers suffix (inside a layer) -> GGUF name inside blk.N
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "layer_scalar": "layer_output_scale.weight",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}
_GLOBAL = {  # transformers name (text model, no prefix) -> GGUF name
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
    "pre_projection.weight": "nextn.pre_projection.weight",
    "post_projection.weight": "nextn.post_projection.weight",
    "masked_embedding.centroids.weight": "masked_embd_centroids.weight",
    "masked_embedding.token_ordering": "masked_embd_ordering",
}


def gguf_name(name: str, n_layers: int) -> str:
    """transformers text-model name (``layers.3.self_attn.q_proj.weight``) → llama.cpp GGUF name.

    Raises:
        ValueError: a name llama.cpp's Gemma 4 layout has no place for.
    """
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = re.match(r"layers\.(\d+)\.(.+)$", name)
    if m:
        bid, rest = m.group(1), m.group(2)
        if rest in _SPECIAL:
            return f"blk.{bid}.{_SPECIAL[rest]}"
        base, _, suffix = rest.rpartition(".")
        mapped = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n_layers).get_name(f"model.layers.{bid}.{base}")
        if mapped:
            return f"{mapped}.{suffix}"
    raise ValueError(f"no GGUF name for tensor {name}")


def keep_f32(name: str, shape) -> bool:
    """Tensors llama.cpp keeps in float32 whatever the file type: 1-D ones, norms, scales."""
    return len(shape) < 2 or name.endswith((".scale", "_norm.weight", "norm.weight")) or "layer_output_scale" in name


def _out_type(name: str, t, outtype: T) -> T:
    """Storage type of one tensor in a ``convert`` of file type ``outtype``."""
    if not t.is_float:
        return T.I32
    if keep_f32(name, t.shape) or outtype == T.F32:
        return T.F32
    if outtype == T.Q8_0 and t.row_len % 32:
        return T.F16
    return outtype


def stream_tensor(s, name: str, t, qtype: T, rows_per_chunk: int | None = None) -> int:
    """Write StoredTensor ``t`` as ``qtype`` into the :class:`~gemmaspec.loading.gguf_out.StreamingGGUF` ``s``,
    a block of rows at a time (about 4M values); integer tensors are written as int32."""
    from .gguf_out import encode_rows

    s.begin(name, t.shape, qtype)
    if not t.is_float:
        s.write(t.load().to(torch.int32).numpy())
        return s.end()
    step = rows_per_chunk or max(1, (4 << 20) // max(1, t.row_len))
    for r0 in range(0, t.rows, step):
        s.write(encode_rows(t.read_rows(r0, min(t.rows, r0 + step)), qtype))
    return s.end()


def _add_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, cfg: dict) -> None:
    """Tokenizer metadata from ``tokenizer.json`` (BPE vocabulary + merges), llama.cpp keys."""
    tj = hf_dir / "tokenizer.json"
    if not tj.exists():
        raise ModelFileError(f"{hf_dir} has no tokenizer.json; a GGUF needs the tokenizer")
    data = json.loads(tj.read_text())
    model = data.get("model", {})
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise ModelFileError(f"{tj}: only BPE tokenizers (Gemma's) are supported")
    added = {a["content"]: a["id"] for a in data.get("added_tokens", [])}
    size = max(list(vocab.values()) + list(added.values())) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = gguf.TokenType.BYTE if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok) else gguf.TokenType.NORMAL
    specials = {a["content"] for a in data.get("added_tokens", []) if a.get("special")}
    for tok, i in added.items():
        tokens[i] = tok
        types[i] = gguf.TokenType.CONTROL if tok in specials else gguf.TokenType.USER_DEFINED
    merges = model.get("merges") or []
    merges = [" ".join(m) if isinstance(m, list) else m for m in merges]
    w.add_tokenizer_model("llama" if not merges else "gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([float(-i) for i in range(size)])
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merges)
    text = cfg.get("text_config", cfg)
    for key, fn in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                    ("pad_token_id", w.add_pad_token_id)):
        v = text.get(key, cfg.get(key))
        if isinstance(v, list):
            v = v[0]
        if v is not None:
            fn(int(v))
    unk = added.get("<unk>", vocab.get("<unk>"))
    if unk is not None:
        w.add_unk_token_id(int(unk))
    tc = {}
    if (hf_dir / "tokenizer_config.json").exists():
        tc = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w.add_add_bos_token(bool(tc.get("add_bos_token", True)))
    w.add_add_space_prefix(False)
    template = tc.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").exists():
        template = (hf_dir / "chat_template.jinja").read_text()
    if isinstance(template, str):
        w.add_chat_template(template)


def _add_text_params(w: gguf.GGUFWriter, c: Gemma4Config, n_ff: list[int]) -> None:
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(n_ff if len(set(n_ff)) > 1 else n_ff[0])
    w.add_head_count(c.num_heads)
    kv = [c.layer_kv_heads(i) for i in range(c.num_layers)]
    w.add_head_count_kv(kv if len(set(kv)) > 1 else kv[0])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.global_head_dim)
    w.add_value_length(c.global_head_dim)
    w.add_key_length_swa(c.head_dim)
    w.add_value_length_swa(c.head_dim)
    w.add_rope_freq_base(c.rope_theta_global)
    w.add_rope_freq_base_swa(c.rope_theta_local)
    w.add_rope_dimension_count(c.global_head_dim)
    w.add_rope_dimension_count_swa(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern([t == "sliding" for t in c.layer_types])
    w.add_shared_kv_layers(c.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input)
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if c.enable_moe_block:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k_experts)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)


def _rope_freqs(c: Gemma4Config) -> np.ndarray:
    n_rot = int(c.global_head_dim * c.partial_rotary_factor / 2)
    return np.array([1.0] * n_rot + [1e30] * (c.global_head_dim // 2 - n_rot), dtype=np.float32)


def hf_source(hf_dir: str | os.PathLike):
    """What a Gemma 4 checkpoint directory becomes in GGUF, nothing read yet.

    Returns:
        ``(arch, tensors, add_metadata)``: arch ``gemma4`` or ``gemma4-assistant``; tensors a list of
        (GGUF name, :class:`~gemmaspec.loading.stored.StoredTensor` or float32 ndarray) in write
        order (the tied head and tensors nothing reads, such as K/V of KV-shared layers, left out);
        ``add_metadata(writer, file_type)`` adds every key llama.cpp reads, tokenizer included.

    Raises:
        ModelFileError / UnsupportedArchitectureError: unreadable or unsupported checkpoint.
    """
    from ..errors import UnsupportedArchitectureError
    from .safetensors import lazy_tensors, read_config

    hf_dir = Path(hf_dir)
    cfg = read_config(hf_dir)
    mtype = cfg.get("model_type")
    if mtype in ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"):
        arch, text_cfg = ARCH_TARGET, cfg
        stored = lazy_tensors(hf_dir)
    elif mtype in ("gemma4_assistant", "gemma4_unified_assistant"):
        arch, text_cfg = ARCH_ASSISTANT, cfg.get("text_config") or {}
        stored = {k[len("model."):] if k.startswith("model.") else k: v
                  for k, v in lazy_tensors(hf_dir, strip_prefix=False).items()}
    else:
        raise UnsupportedArchitectureError(
            f"{hf_dir}: model_type '{mtype}' cannot be converted; supported: gemma4(_unified), gemma4(_unified)_text, gemma4(_unified)_assistant")
    try:
        c = Gemma4Config.from_hf(text_cfg)
    except ValueError as exc:
        raise ModelFileError(f"{hf_dir}/config.json: {exc}") from None
    n_ff = []
    for i in range(c.num_layers):
        g = stored.get(f"layers.{i}.mlp.gate_proj.weight")
        n_ff.append(int(g.shape[0]) if g is not None else c.intermediate_size)
    tied = cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", True)) is not False
    tensors: list = [("rope_freqs.weight", _rope_freqs(c))]
    for name in sorted(stored):
        if name == "lm_head.weight" and tied and "embed_tokens.weight" in stored:
            continue  # tied head: llama.cpp reads token_embd
        try:
            tensors.append((gguf_name(name, c.num_layers), stored[name]))
        except ValueError:
            continue  # e.g. K/V of KV-shared layers: nothing reads them

    def add_metadata(w: gguf.GGUFWriter, file_type: int) -> None:
        w.add_name(cfg.get("_name_or_path") or hf_dir.name)
        w.add_file_type(file_type)
        _add_text_params(w, c, n_ff)
        if arch == ARCH_ASSISTANT:
            w.add_embedding_length_out(int(cfg["backbone_hidden_size"]))
            w.add_nextn_predict_layers(c.num_layers)
            if cfg.get("use_ordered_embeddings"):
                w.add_uint32(f"{arch}.num_centroids", int(cfg.get("num_centroids", 2048)))
                w.add_uint32(f"{arch}.centroid_top_k", int(cfg.get("centroid_intermediate_top_k", 32)))
        _add_tokenizer(w, hf_dir, cfg)

    return arch, tensors, add_metadata


def convert(hf_dir: str | os.PathLike, out: str | os.PathLike, outtype: str = "bf16", force: bool = False) -> dict:
    """Write a Gemma 4 target or assistant checkpoint directory as GGUF, tensor by tensor (bounded
    memory: a few million values at a time).

    Returns:
        A summary: arch, tensor count, types used, bytes written.

    Raises:
        InputError: unknown outtype, or OUT exists without ``force``.
        ModelFileError / UnsupportedArchitectureError: unreadable or unsupported checkpoint.
    The output is written to a temporary file beside OUT and renamed at the end, so a failure
    leaves no partial OUT.
    """
    from .gguf_out import StreamingGGUF
    from .stored import StoredTensor

    if outtype not in OUTTYPES:
        raise InputError(f"--outtype must be one of {', '.join(OUTTYPES)} (got {outtype})")
    qtype = OUTTYPES[outtype]
    arch, tensors, add_metadata = hf_source(hf_dir)
    types: dict[str, int] = {}
    with StreamingGGUF(out, arch, force) as s:
        for name, t in tensors:
            if isinstance(t, StoredTensor):
                kind = _out_type(name, t, qtype)
                stream_tensor(s, name, t, kind)
            else:
                kind = T.F32
                s.begin(name, t.shape, kind)
                s.write(t.astype(np.float32))
                s.end()
            types[kind.name] = types.get(kind.name, 0) + 1
        size = s.finish(lambda w: add_metadata(w, {T.F32: 0, T.F16: 1, T.Q8_0: 7, T.BF16: 32}[qtype]))
    return {"arch": arch, "tensors": sum(types.values()), "types": types, "bytes": size}


# ---- reading -----------------------------------------------------------------------------------

def _val(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader, path: Path) -> Gemma4Config:
    """:class:`Gemma4Config` from a ``gemma4`` / ``gemma4-assistant`` GGUF's metadata."""
    arch = _val(reader, "general.architecture")

    def req(key):
        v = _val(reader, f"{arch}.{key}")
        if v is None:
            raise ModelFileError(f"{path}: required metadata key {arch}.{key} is missing")
        return v

    n = int(req("block_count"))
    pattern = _val(reader, f"{arch}.attention.sliding_window_pattern")
    types = tuple("sliding" if s else "full" for s in pattern) if isinstance(pattern, list) else ()
    kv = req("attention.head_count_kv")
    kv_list = kv if isinstance(kv, list) else [kv] * n
    ff = req("feed_forward_length")
    ff0 = ff[0] if isinstance(ff, list) else ff
    full_kv = [k for k, t in zip(kv_list, types) if t == "full"]
    slide_kv = [k for k, t in zip(kv_list, types) if t == "sliding"]
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    partial = 0.25
    global_hd = int(req("attention.key_length"))
    if rope_freqs is not None:
        partial = 2 * int((np.asarray(rope_freqs.data) < 1e29).sum()) / global_hd
    names = {t.name for t in reader.tensors}
    k_eq_v = any(f"blk.{i}.attn_k.weight" in names and f"blk.{i}.attn_v.weight" not in names
                 for i, t in enumerate(types) if t == "full")
    ple = next((t for t in reader.tensors if t.name == "per_layer_token_embd.weight"), None)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = len(tokens.data) if tokens is not None else (int(emb.shape[1]) if emb is not None else 0)
    return Gemma4Config(
        vocab_size=vocab, hidden_size=int(req("embedding_length")), num_layers=n, intermediate_size=int(ff0),
        num_heads=int(req("attention.head_count")), num_kv_heads=int(slide_kv[0] if slide_kv else kv_list[0]),
        head_dim=int(req("attention.key_length_swa")), global_head_dim=global_hd,
        num_global_kv_heads=int(full_kv[0]) if full_kv else None,
        rms_norm_eps=float(_val(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        context_length=int(_val(reader, f"{arch}.context_length", 131072)),
        sliding_window=int(req("attention.sliding_window")),
        rope_theta_local=float(_val(reader, f"{arch}.rope.freq_base_swa", 10_000.0)),
        rope_theta_global=float(_val(reader, f"{arch}.rope.freq_base", 1_000_000.0)),
        partial_rotary_factor=partial, final_logit_softcapping=_val(reader, f"{arch}.final_logit_softcapping"),
        layer_types=types, hidden_size_per_layer_input=int(_val(reader, f"{arch}.embedding_length_per_layer_input", 0)),
        vocab_size_per_layer_input=int(ple.shape[1]) if ple is not None else 0,
        attention_k_eq_v=k_eq_v, num_kv_shared_layers=int(_val(reader, f"{arch}.attention.shared_kv_layers", 0)),
        use_double_wide_mlp=isinstance(ff, list) and len(set(ff)) > 1,
        enable_moe_block=bool(_val(reader, f"{arch}.expert_count", 0)),
        num_experts=int(_val(reader, f"{arch}.expert_count", 0)),
        top_k_experts=int(_val(reader, f"{arch}.expert_used_count", 0)),
        moe_intermediate_size=int(_val(reader, f"{arch}.expert_feed_forward_length", 0)),
        bos_token_id=int(_val(reader, "tokenizer.ggml.bos_token_id", 2)),
        eos_token_id=int(_val(reader, "tokenizer.ggml.eos_token_id", 1)),
        architecture=arch,
    )


def _dense(t) -> torch.Tensor:
    """A ReaderTensor as float32 (dequantized when quantized) in torch's dim order; I32 stays int."""
    qtype = T(t.tensor_type)
    shape = [int(x) for x in reversed(t.shape.tolist())]
    data = np.asarray(t.data)
    if qtype == T.I32:
        return torch.from_numpy(np.array(data, dtype=np.int64)).reshape(shape)
    if qtype in (T.F32, T.F16):
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32)).reshape(shape)


def load_gemma4_gguf(path: Path, reader):
    """A ``gemma4`` or ``gemma4-assistant`` GGUF as ``(config, model)``: a
    :class:`~gemmaspec.models.gemma4.Gemma4Model` or a
    :class:`~gemmaspec.models.gemma4_assistant.Gemma4Assistant`.

    Quantized 2-D weights, embeddings included, stay block-quantized
    (:class:`~gemmaspec.kernels.QuantizedWeight`, exact); expert tensors are dequantized to float32.

    Raises:
        ModelFileError: a tensor the architecture needs is missing, or an unusable tensor type.
    """
    from ..models.gemma4 import Gemma4Model
    from ..models.gemma4_assistant import Gemma4Assistant
    from .gguf import convert_tensor

    c = config_from_gguf(reader, path)
    arch = c.architecture
    reverse = {}
    names = set()
    for i in range(c.num_layers):
        for rest in _SPECIAL:
            names.add(f"layers.{i}.{rest}")
        for base in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "per_layer_input_gate", "per_layer_projection",
                     "post_per_layer_input_norm", "router.proj", "post_feedforward_layernorm_1",
                     "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
            names.add(f"layers.{i}.{base}.weight")
    names |= set(_GLOBAL)
    for n in names:
        try:
            reverse[gguf_name(n, c.num_layers)] = n
        except ValueError:
            pass
    # embeddings stay block-quantized too (rows are dequantized as they are looked up; the tied head is
    # the C kernel's matmul); only F32/F16/BF16 tensors, 1-D ones and the experts are float32
    weights = {}
    for t in reader.tensors:
        name = reverse.get(t.name)
        if name is None:
            continue
        qtype = T(t.tensor_type)
        if len(t.shape) == 2 and qtype not in (T.F32, T.F16, T.BF16, T.I32):
            weights[name] = convert_tensor(t)
        else:
            weights[name] = _dense(t)
        if name == "layers.0.layer_scalar" or name.endswith("layer_scalar"):
            weights[name] = weights[name].reshape(1)
    try:
        if arch == ARCH_ASSISTANT:
            prefixed = {("model." + k if k.startswith(("layers.", "embed_tokens", "norm.")) else k): v
                        for k, v in weights.items()}
            clustered = None
            if "masked_embedding.token_ordering" in weights:
                clustered = (int(_val(reader, f"{arch}.num_centroids", 2048)), int(_val(reader, f"{arch}.centroid_top_k", 32)))
            backbone = int(_val(reader, f"{arch}.embedding_length_out", 0))
            return c, Gemma4Assistant(c, backbone, prefixed, clustered)
        return c, Gemma4Model(c, weights)
    except KeyError as exc:
        raise ModelFileError(f"{path}: tensor {exc.args[0]} is missing; the file is incomplete") from None
