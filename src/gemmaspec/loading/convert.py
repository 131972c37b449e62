"""Writing Gemma 4 targets and assistants as GGUF (``gemmaspec convert``), in llama.cpp's naming and
metadata; reading them back is the generic :mod:`gemmaspec.loading.gguf`.

Writing follows llama.cpp's converter (``conversion/gemma.py``: ``Gemma4Model``,
``Gemma4AssistantModel``) so the files load in llama.cpp too: arch ``gemma4`` / ``gemma4-assistant``,
per-type head dims (``key_length`` = full, ``key_length_swa`` = sliding), the sliding-window pattern
as a bool array, ``shared_kv_layers``, per-layer FFN and KV-head arrays, a ``rope_freqs`` tensor
that leaves the unrotated frequencies of proportional RoPE still (factor 1e30), router scale as
``ffn_gate_inp.scale`` and per-expert scale as ``ffn_down_exps.scale``. Unlike llama.cpp's converter
we keep the assistant's clustered-head tensors (``masked_embd_centroids``, ``masked_embd_ordering``).
Tensor names come from the registry's ``hf_name`` map (:func:`gemmaspec.models.gemma4.hf_to_gguf_name`:
``gguf.TensorNameMap`` plus the names llama.cpp adds by hand), the same map the loader uses.
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

from ..models.config import BIDIRECTIONAL_VISION_KEY, Gemma4Config, llama_cpp_bidirectional_vision
from ..errors import InputError, ModelFileError, UnsupportedArchitectureError

ARCH_TARGET, ARCH_ASSISTANT = "gemma4", "gemma4-assistant"
OUTTYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}
FILE_TYPES = {T.F32: gguf.LlamaFileType.ALL_F32, T.F16: gguf.LlamaFileType.MOSTLY_F16,
              T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, T.BF16: gguf.LlamaFileType.MOSTLY_BF16}

def keep_f32(name: str, shape) -> bool:
    """Tensors llama.cpp keeps in float32 whatever the file type: 1-D ones, norms, scales."""
    return len(shape) < 2 or name.endswith((".scale", "_norm.weight", "norm.weight")) or "layer_output_scale" in name


def _out_type(name: str, t, outtype: T) -> T:
    """Storage type of one tensor in a ``convert`` of file type ``outtype``."""
    if not t.is_float:
        return T.I32
    if keep_f32(name, t.shape) or outtype == T.F32:
        return T.F32
    if outtype == T.Q8_0 and t.row_len % gguf.GGML_QUANT_SIZES[T.Q8_0][0]:
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
    # llama.cpp's converter (conversion/gemma.py, Gemma4Model.set_vocab) writes true for a gemma4
    # vocabulary whatever tokenizer_config.json says, and its loader adds BOS there anyway
    # (gemmaspec.tokenizer.llama_cpp_add_bos); a SentencePiece one follows the checkpoint.
    w.add_add_bos_token(True if merges else bool(tc.get("add_bos_token", True)))
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
    from .safetensors import hf_checkpoint

    hf_dir = Path(hf_dir)
    arch_entry, config, cfg, stored = hf_checkpoint(hf_dir)
    arch = arch_entry.name
    if arch not in (ARCH_TARGET, ARCH_ASSISTANT):
        raise UnsupportedArchitectureError(f"{hf_dir}: converting {arch} checkpoints is not supported; "
                                           f"supported: {ARCH_TARGET}, {ARCH_ASSISTANT}")
    c = config.text if arch == ARCH_ASSISTANT else config
    text_cfg = (cfg.get("text_config") or {}) if arch == ARCH_ASSISTANT else cfg.get("text_config", cfg)
    n_ff = []
    for i in range(c.num_layers):
        g = stored.get(f"blk.{i}.ffn_gate.weight")
        n_ff.append(int(g.shape[0]) if g is not None else c.intermediate_size)
    tied = cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", True)) is not False
    tensors: list = [("rope_freqs.weight", _rope_freqs(c))]
    for name, t in sorted(stored.items()):
        if name == "output.weight" and tied and "token_embd.weight" in stored:
            continue  # tied head: llama.cpp reads token_embd
        tensors.append((name, t))

    def add_metadata(w: gguf.GGUFWriter, file_type: int) -> None:
        w.add_name(cfg.get("_name_or_path") or hf_dir.name)
        w.add_file_type(file_type)
        _add_text_params(w, c, n_ff)
        if arch == ARCH_TARGET and c.bidirectional_vision != llama_cpp_bidirectional_vision(c.hidden_size):
            w.add_bool(f"{arch}.{BIDIRECTIONAL_VISION_KEY}", c.bidirectional_vision)
        if arch == ARCH_ASSISTANT:
            w.add_embedding_length_out(config.backbone_hidden_size)
            w.add_nextn_predict_layers(c.num_layers)
            if config.clustered:
                w.add_uint32(f"{arch}.num_centroids", config.num_centroids)
                w.add_uint32(f"{arch}.centroid_top_k", config.centroid_top_k)
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
        size = s.finish(lambda w: add_metadata(w, FILE_TYPES[qtype]))
    return {"arch": arch, "tensors": sum(types.values()), "types": types, "bytes": size}
