"""Gemma 3 text model (GGUF arch ``gemma3``).

Reference: transformers ``models/gemma3/modeling_gemma3.py`` (``Gemma3TextModel``) and llama.cpp
``src/models/gemma3.cpp``. Per layer: input RMSNorm → attention (per-head RMSNorm on q and k,
rotate-half RoPE with base 10,000 on sliding layers and 1,000,000 on global ones, scale
1/sqrt(query_pre_attn_scalar)) → post-attention RMSNorm → residual; pre-FFN RMSNorm →
down(gelu_tanh(gate(x)) * up(x)) → post-FFN RMSNorm → residual. Embeddings are scaled by
sqrt(hidden_size); the output head is tied to the embedding. Norm weights are used as stored: the
llama.cpp converter has already added Gemma's +1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import Gemma3Config
from ..kernels import QuantizedWeight
from ..kv_cache import KVCache
from .base import ForwardOutput, apply_rope, attention, linear, rms_norm, rope_cos_sin


def _fuse(parts):
    """Stack compatible quantized weights along N so one kernel call computes them all."""
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        return None
    g, has_off = parts[0].group, parts[0].offset is not None
    if any(p.group != g or (p.offset is not None) != has_off or p.q.device != parts[0].q.device for p in parts):
        return None
    off = torch.cat([p.offset for p in parts]) if has_off else None
    return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), off, g)


class _Layer:
    def __init__(self, w: dict, i: int, cfg: Gemma3Config):
        p = f"blk.{i}."
        self.attn_norm = w[p + "attn_norm.weight"]
        self.q_norm = w[p + "attn_q_norm.weight"]
        self.k_norm = w[p + "attn_k_norm.weight"]
        self.post_attn_norm = w[p + "post_attention_norm.weight"]
        self.ffn_norm = w[p + "ffn_norm.weight"]
        self.post_ffn_norm = w[p + "post_ffw_norm.weight"]
        self.o = w[p + "attn_output.weight"]
        self.down = w[p + "ffn_down.weight"]
        q, k, v = w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]
        self.qkv = _fuse([q, k, v])
        self.q, self.k, self.v = (None, None, None) if self.qkv is not None else (q, k, v)
        gate, up = w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]
        self.gate_up = _fuse([gate, up])
        self.gate, self.up = (None, None) if self.gate_up is not None else (gate, up)
        self.sliding = cfg.layer_types[i] == "sliding"


class Gemma3Model:
    """Gemma 3 decoder over one sequence.

    Args:
        config: the model's :class:`Gemma3Config`.
        weights: GGUF tensor name → float32 tensor (norms, dense matrices) or
            :class:`QuantizedWeight` (block-quantized matrices), already on ``device``.
        device: torch device the weights live on.

    Raises:
        KeyError: a tensor the architecture needs is missing (the loader turns this into a
            :class:`~gemmaspec.errors.ModelFileError`).
    """

    def __init__(self, config: Gemma3Config, weights: dict, device: torch.device | str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        self.embed = weights["token_embd.weight"]
        self.head = weights.get("output.weight", self.embed)
        self.final_norm = weights["output_norm.weight"]
        self.layers = [_Layer(weights, i, config) for i in range(config.num_layers)]
        self.embed_scale = torch.tensor(math.sqrt(config.hidden_size), dtype=torch.float32)
        self.attn_scale = config.query_pre_attn_scalar ** -0.5

    def new_cache(self, capacity: int, max_rollback: int = 16) -> KVCache:
        """An empty KV cache for up to ``capacity`` positions (see :class:`KVCache`)."""
        c = self.config
        windows = [c.sliding_window if t == "sliding" else None for t in c.layer_types]
        return KVCache(windows, capacity, c.num_kv_heads, c.head_dim, max_rollback, device=self.device)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64 [T] → float32 [T, hidden] (scaled by sqrt(hidden))."""
        e = self.embed.rows(tokens) if isinstance(self.embed, QuantizedWeight) else self.embed[tokens]
        return e * self.embed_scale

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, all_logits: bool = False) -> ForwardOutput:
        """Run ``tokens`` int64 [T] at positions cache.length.., append them to ``cache``.

        Returns:
            :class:`ForwardOutput`: logits float32 [1 or T, vocab]; hidden float32 [T, hidden]
            (after the final norm).

        Raises:
            ValueError: the tokens would run past the cache's capacity.
        """
        c = self.config
        t = tokens.shape[0]
        start = cache.length
        if start + t > cache.capacity:
            raise ValueError(f"{start + t} positions exceed the context size {cache.capacity}")
        pos = torch.arange(start, start + t, device=self.device)
        rope = {
            True: rope_cos_sin(pos, c.head_dim, c.rope_theta_local),
            False: rope_cos_sin(pos, c.head_dim, c.rope_theta_global, c.rope_scaling_factor),
        }
        h_q, h_kv, d = c.num_heads, c.num_kv_heads, c.head_dim
        eps = c.rms_norm_eps
        x = self.embed_tokens(tokens)
        plans = {True: cache.plan(start, t, c.sliding_window), False: cache.plan(start, t, None)}
        for layer, kv in zip(self.layers, cache.layers):
            h = rms_norm(x, layer.attn_norm, eps)
            if layer.qkv is not None:
                qkv = layer.qkv(h)
                q, k, v = qkv.split([h_q * d, h_kv * d, h_kv * d], dim=-1)
            else:
                q, k, v = linear(layer.q, h), linear(layer.k, h), linear(layer.v, h)
            q = rms_norm(q.reshape(t, h_q, d), layer.q_norm, eps)
            k = rms_norm(k.reshape(t, h_kv, d), layer.k_norm, eps)
            v = v.reshape(t, h_kv, d)
            cos, sin = rope[layer.sliding]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            plan = plans[layer.sliding]
            keys, values = kv.read(plan, start, k, v)
            a = attention(q, keys, values, plan.mask, self.attn_scale)
            a = linear(layer.o, a.reshape(t, h_q * d))
            x = x + rms_norm(a, layer.post_attn_norm, eps)
            h = rms_norm(x, layer.ffn_norm, eps)
            if layer.gate_up is not None:
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
            else:
                gate, up = linear(layer.gate, h), linear(layer.up, h)
            f = linear(layer.down, F.gelu(gate, approximate="tanh") * up)
            x = x + rms_norm(f, layer.post_ffn_norm, eps)
        cache.advance(start, t)
        hidden = rms_norm(x, self.final_norm, eps)
        logits = linear(self.head, hidden if all_logits else hidden[-1:])
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return ForwardOutput(logits=logits, hidden=hidden)
