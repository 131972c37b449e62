"""What a Gemma 4 target or assistant needs in device memory, from its configuration alone: every
tensor's shape under its GGUF name, the layers that keep a KV cache, and the bytes of both in the
device layout of :mod:`gemmaspec.kernels.cuda` (weights block-quantized as stored; float32 KV cache),
by the per-tensor arithmetic of :mod:`gemmaspec.kernels.memory`.

Shapes follow transformers' ``modeling_gemma4.py`` (``Gemma4TextDecoderLayer``: double-wide MLP on
KV-shared layers, no K/V projections there, per-layer-input tensors when
``hidden_size_per_layer_input`` is set) and ``modeling_gemma4_assistant.py``; the tests compare them
with transformers' own modules built on the ``meta`` device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from ..kernels.memory import CUDA_CONTEXT_BYTES, DeviceMemory, kv_cache_bytes, layout_bytes, work_bytes
from .base import MAX_ROLLBACK, PREFILL_CHUNK
from .config import Gemma3Config, Gemma4AssistantConfig, Gemma4Config


def layer_ffn(c: Gemma4Config, i: int) -> int:
    """The dense MLP width of layer i (twice ``intermediate_size`` on KV-shared layers of a
    ``use_double_wide_mlp`` model)."""
    shared = i >= c.num_layers - c.num_kv_shared_layers
    return c.intermediate_size * (2 if c.use_double_wide_mlp and shared else 1)


def tensor_shapes(config: Gemma4Config | Gemma4AssistantConfig, tied: bool = True) -> dict[str, tuple[int, ...]]:
    """GGUF name → shape (torch order: [out, in] for matrices) of every tensor the model reads.

    Args:
        config: a Gemma 4 target or assistant configuration.
        tied: the output head is the token embedding (no ``output.weight``), as in every released
            Gemma 4.
    """
    assistant = isinstance(config, Gemma4AssistantConfig)
    c = config.text if assistant else config
    h, v = c.hidden_size, c.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not tied:
        shapes["output.weight"] = (v, h)
    if assistant:
        hb = config.backbone_hidden_size
        shapes["nextn.pre_projection.weight"] = (h, 2 * hb)
        shapes["nextn.post_projection.weight"] = (hb, h)
        if config.clustered:
            shapes["masked_embd_centroids.weight"] = (config.num_centroids, h)
            shapes["masked_embd_ordering"] = (v,)
    p_dim = c.hidden_size_per_layer_input
    if p_dim and not assistant:
        shapes["per_layer_token_embd.weight"] = (c.vocab_size_per_layer_input, c.num_layers * p_dim)
        shapes["per_layer_model_proj.weight"] = (c.num_layers * p_dim, h)
        shapes["per_layer_proj_norm.weight"] = (p_dim,)
    src = list(range(c.num_layers)) if assistant else c.kv_source()
    for i in range(c.num_layers):
        p, d, f = f"blk.{i}.", c.layer_head_dim(i), layer_ffn(c, i)
        q = c.num_heads * d
        shapes.update({p + "attn_norm.weight": (h,), p + "post_attention_norm.weight": (h,),
                       p + "ffn_norm.weight": (h,), p + "post_ffw_norm.weight": (h,),
                       p + "attn_q.weight": (q, h), p + "attn_q_norm.weight": (d,), p + "attn_output.weight": (h, q),
                       p + "ffn_gate.weight": (f, h), p + "ffn_up.weight": (f, h), p + "ffn_down.weight": (h, f),
                       p + "layer_output_scale.weight": (1,)})
        if not assistant and src[i] == i:
            kv = c.layer_kv_heads(i) * d
            shapes[p + "attn_k.weight"] = (kv, h)
            shapes[p + "attn_k_norm.weight"] = (d,)
            if not (c.attention_k_eq_v and c.layer_types[i] == "full"):
                shapes[p + "attn_v.weight"] = (kv, h)
        if p_dim and not assistant:
            shapes.update({p + "inp_gate.weight": (p_dim, h), p + "proj.weight": (h, p_dim),
                           p + "post_norm.weight": (h,)})
        if c.enable_moe_block:
            e, mf = c.num_experts, c.moe_intermediate_size
            shapes.update({p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_inp.scale": (h,),
                           p + "ffn_down_exps.scale": (e,), p + "ffn_gate_up_exps.weight": (e, 2 * mf, h),
                           p + "ffn_down_exps.weight": (e, h, mf), p + "post_ffw_norm_1.weight": (h,),
                           p + "post_ffw_norm_2.weight": (h,), p + "pre_ffw_norm_2.weight": (h,)})
    return shapes


def kv_layers(config: Gemma3Config | Gemma4Config | Gemma4AssistantConfig) -> list[tuple[int, int, int | None]]:
    """``(kv_heads, head_dim, window or None)`` of each layer that keeps its own K/V (KV-shared layers
    keep none; an assistant keeps none: it reads its target's cache; every Gemma 3 layer keeps its own)."""
    if isinstance(config, Gemma4AssistantConfig):
        return []
    if isinstance(config, Gemma3Config):
        return [(config.num_kv_heads, config.head_dim, config.sliding_window if t == "sliding" else None)
                for t in config.layer_types]
    c, src = config, config.kv_source()
    return [(c.layer_kv_heads(i), c.layer_head_dim(i), c.sliding_window if c.layer_types[i] == "sliding" else None)
            for i in range(c.num_layers) if src[i] == i]


def default_types(matrix_type: str) -> Callable[[str, tuple[int, ...]], str]:
    """Storage types of a file whose matrices are ``matrix_type``: 1-D tensors, norms and scales F32
    (as llama.cpp and ``gemmaspec convert`` keep them), the assistant's token ordering I32."""
    def types(name: str, shape: tuple[int, ...]) -> str:
        if name == "masked_embd_ordering":
            return "I32"
        if len(shape) < 2 or name.endswith(("norm.weight", ".scale")) or "layer_output_scale" in name:
            return "F32"
        return matrix_type
    return types


def step_work_bytes(config: Gemma3Config | Gemma4Config | Gemma4AssistantConfig, rows: int, context: int) -> int:
    """Transient bytes of a forward step of ``rows`` tokens against ``context`` keys:
    :func:`~gemmaspec.kernels.memory.work_bytes` with the model's widths (its widest MLP, largest head
    dimension, per-layer-input width; an assistant's inner text model)."""
    c = config.text if isinstance(config, Gemma4AssistantConfig) else config
    if isinstance(c, Gemma4Config):
        ffn = max(layer_ffn(c, i) for i in range(c.num_layers))
        head_dim, extra = max(c.head_dim, c.global_head_dim), c.num_layers * c.hidden_size_per_layer_input
    else:
        ffn, head_dim, extra = c.intermediate_size, c.head_dim, 0
    return work_bytes(rows, context, c.hidden_size, ffn, c.num_heads, head_dim, c.vocab_size, extra)


def device_memory(config: Gemma4Config | Gemma4AssistantConfig, context: int,
                  types: str | Mapping[str, str] | Callable[[str, tuple[int, ...]], str] = "Q4_0",
                  tied: bool = True, max_rollback: int = MAX_ROLLBACK, chunk: int = PREFILL_CHUNK, dense: bool = False) -> DeviceMemory:
    """Device bytes of a Gemma 4 target or assistant at ``context`` positions.

    Args:
        config: the model's configuration.
        context: KV-cache capacity in tokens (the assistant keeps none).
        types: the matrices' GGML type (``"Q4_0"``: every matrix, the rest F32), or a map / function
            name → type.
        tied: see :func:`tensor_shapes`.
        max_rollback: the cache's rollback rows (the engine's default).
        chunk: prefill tokens per forward (``models.base.PREFILL_CHUNK``).
        dense: count every matrix as float32 instead (the layout before the device weights).

    Raises:
        ValueError: a type with no device layout, or a shape it does not fit.
    """
    pick = default_types(types) if isinstance(types, str) else types
    if isinstance(pick, Mapping):
        table = pick
        pick = lambda name, shape: table[name]  # noqa: E731
    total = 0
    for name, shape in tensor_shapes(config, tied).items():
        n, k = math.prod(shape[:-1]), shape[-1]
        qtype = pick(name, shape)
        total += 4 * n * k if dense else layout_bytes(qtype, n, k)
    kv = kv_cache_bytes(kv_layers(config), context, max_rollback)
    work = step_work_bytes(config, 1 if isinstance(config, Gemma4AssistantConfig) else chunk, context)
    return DeviceMemory(total, kv, work, CUDA_CONTEXT_BYTES)
