"""Gemma 4 text model (transformers ``Gemma4ForCausalLM`` / the text part of
``Gemma4ForConditionalGeneration``; GGUF arch ``gemma4``).

Reference: transformers ``models/gemma4/modeling_gemma4.py`` (5.x). Differences from Gemma 3:

- RMSNorm multiplies by its weight as stored (no +1); V gets a weightless RMSNorm; attention scale 1.
- Sliding layers: head dim ``head_dim``, RoPE base 10,000. Full layers: ``global_head_dim`` and
  proportional RoPE (only the first ``partial_rotary_factor`` of the frequencies rotate, base 1e6).
- ``attention_k_eq_v``: full layers have no V projection; V is the K projection's output (before
  k_norm and RoPE), then the V norm. Never run such a layer with V missing.
- KV sharing: the last ``num_kv_shared_layers`` layers have no K/V projections and attend over the
  K/V of the last unshared layer of their type (same forward, same cache).
- Per-layer embeddings (E2B/E4B): a second table gives each layer a small vector,
  (norm(proj(embeds) / sqrt(hidden)) + table[token] * sqrt(ple_dim)) / sqrt(2), fed after the FFN
  through gate → gelu → × vector → projection → norm, as a residual.
- Mixture of experts (26B-A4B): beside the dense MLP, a router (weightless norm, scale, softmax,
  top-k, renormalise, per-expert scale) picks experts whose outputs are summed.
- Each layer's output is multiplied by ``layer_scalar``; final logits are soft-capped (30).

Weights are addressed by the transformers names of the text model without the ``model.`` prefix
(``layers.3.self_attn.q_proj.weight``), as float32 tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import Gemma4Config
from ..kernels import QuantizedWeight
from ..kv_cache import KVCache
from .base import ForwardOutput, apply_rope, attention, linear, rms_norm, rope_cos_sin


def _lookup(table, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows ``ids`` int64 [T] of a dense float32 table or a block-quantized one (rows
    dequantized on the fly, exactly), float32 [T, dim]. Quantized tables stay quantized in memory: the
    E2B/E4B per-layer table alone is 262,144 x 35 x 256 values (9.4 GB as float32)."""
    return table.rows(ids) if isinstance(table, QuantizedWeight) else table[ids]


def rope_tables(c: Gemma4Config, pos: torch.Tensor) -> dict:
    """cos/sin per layer type for positions int64 [T]: sliding layers rotate the whole head (base
    ``rope_theta_local``); full layers use proportional RoPE over ``global_head_dim``."""
    return {
        "sliding": rope_cos_sin(pos, c.head_dim, c.rope_theta_local),
        "full": rope_cos_sin(pos, c.global_head_dim, c.rope_theta_global,
                             rotary_dim=2 * int(c.partial_rotary_factor * c.global_head_dim // 2)),
    }


def gated_mlp(w: dict, prefix: str, h: torch.Tensor) -> torch.Tensor:
    """down(gelu_tanh(gate(h)) * up(h)) with the weights under ``prefix`` (``...mlp.gate_proj.weight``)."""
    gate = F.gelu(linear(w[prefix + "mlp.gate_proj.weight"], h), approximate="tanh")
    return linear(w[prefix + "mlp.down_proj.weight"], gate * linear(w[prefix + "mlp.up_proj.weight"], h))


class Gemma4Model:
    """Gemma 4 decoder over one sequence (the :class:`~gemmaspec.models.base.CausalLM` contract).

    Args:
        config: :class:`Gemma4Config`.
        weights: name → float32 tensor (see the module docstring for names).
        device: where the weights live.

    Raises:
        KeyError: with the name of a tensor the architecture needs and the checkpoint lacks.
    """

    def __init__(self, config: Gemma4Config, weights: dict, device="cpu"):
        self.config = c = config
        self.device = torch.device(device)
        self.w = weights
        self.kv_source = c.kv_source()
        missing = [n for n in self.required_tensors() if n not in weights]
        if missing:
            raise KeyError(missing[0])
        self.embed = weights["embed_tokens.weight"]
        self.head = weights.get("lm_head.weight", self.embed)
        self.embed_scale = torch.tensor(c.hidden_size ** 0.5, dtype=torch.float32)

    def to(self, device) -> "Gemma4Model":
        """The same model with every weight on ``device``."""
        return Gemma4Model(self.config, {k: v.to(device) for k, v in self.w.items()}, device)

    def embed_row(self, token: int) -> torch.Tensor:
        """The scaled input embedding of one token, float32 [hidden] (what the MTP assistant reads)."""
        return _lookup(self.embed, torch.tensor([token], device=self.device))[0] * self.embed_scale

    def required_tensors(self) -> list[str]:
        """Names this configuration needs (absent K/V of KV-shared layers are not among them)."""
        c = self.config
        names = ["embed_tokens.weight", "norm.weight"]
        if c.hidden_size_per_layer_input:
            names += ["embed_tokens_per_layer.weight", "per_layer_model_projection.weight",
                      "per_layer_projection_norm.weight"]
        for i in range(c.num_layers):
            p = f"layers.{i}."
            names += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                      "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
                                      "self_attn.q_proj.weight", "self_attn.q_norm.weight", "self_attn.o_proj.weight",
                                      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
            if self.kv_source[i] == i:
                names += [p + "self_attn.k_proj.weight", p + "self_attn.k_norm.weight"]
                if not (c.attention_k_eq_v and c.layer_types[i] == "full"):
                    names.append(p + "self_attn.v_proj.weight")
            if c.hidden_size_per_layer_input:
                names += [p + "per_layer_input_gate.weight", p + "per_layer_projection.weight",
                          p + "post_per_layer_input_norm.weight"]
            if c.enable_moe_block:
                names += [p + n for n in ("router.proj.weight", "router.scale", "router.per_expert_scale",
                                          "experts.gate_up_proj", "experts.down_proj",
                                          "post_feedforward_layernorm_1.weight", "post_feedforward_layernorm_2.weight",
                                          "pre_feedforward_layernorm_2.weight")]
        return names

    def new_cache(self, capacity: int, max_rollback: int = 16) -> KVCache:
        c = self.config
        windows = [c.sliding_window if t == "sliding" else None for t in c.layer_types]
        shapes = [(c.layer_kv_heads(i), c.layer_head_dim(i)) if self.kv_source[i] == i else None
                  for i in range(c.num_layers)]
        return KVCache(windows, capacity, c.num_kv_heads, c.head_dim, max_rollback, device=self.device, shapes=shapes)

    def _per_layer_inputs(self, tokens: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """float32 [T, num_layers, ple_dim]."""
        c, w = self.config, self.w
        t, p = tokens.shape[0], c.hidden_size_per_layer_input
        table = _lookup(w["embed_tokens_per_layer.weight"], tokens) * torch.tensor(p ** 0.5, dtype=torch.float32)
        proj = linear(w["per_layer_model_projection.weight"], embeds) * (c.hidden_size ** -0.5)
        proj = rms_norm(proj.view(t, c.num_layers, p), w["per_layer_projection_norm.weight"], c.rms_norm_eps)
        return (proj + table.view(t, c.num_layers, p)) * (2.0 ** -0.5)

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The experts' contribution for input x float32 [T, hidden] (before its post-norm)."""
        c, w, p = self.config, self.w, f"layers.{i}."
        h = rms_norm(x, None, c.rms_norm_eps) * w[p + "router.scale"] * (c.hidden_size ** -0.5)
        probs = torch.softmax(linear(w[p + "router.proj.weight"], h), dim=-1)
        top_w, top_i = torch.topk(probs, c.top_k_experts, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True) * w[p + "router.per_expert_scale"][top_i]
        xin = rms_norm(x, w[p + "pre_feedforward_layernorm_2.weight"], c.rms_norm_eps)
        out = torch.zeros_like(x)
        gate_up, down = w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"]
        for e in torch.unique(top_i).tolist():
            rows, slot = torch.where(top_i == e)
            g, u = F.linear(xin[rows], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.gelu(g, approximate="tanh") * u, down[e]) * top_w[rows, slot, None]
            out.index_add_(0, rows, y)
        return out

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, all_logits: bool = False) -> ForwardOutput:
        """Run ``tokens`` int64 [T] at positions cache.length.. (see :class:`CausalLM`).

        Returns:
            logits float32 [1 or T, vocab] (soft-capped), hidden float32 [T, hidden] after the final norm.
        """
        c, w, eps = self.config, self.w, self.config.rms_norm_eps
        t = tokens.shape[0]
        start = cache.length
        if start + t > cache.capacity:
            raise ValueError(f"{start + t} positions exceed the context size {cache.capacity}")
        pos = torch.arange(start, start + t, device=self.device)
        rope = rope_tables(c, pos)
        plans = {"sliding": cache.plan(start, t, c.sliding_window), "full": cache.plan(start, t, None)}
        x = _lookup(w["embed_tokens.weight"], tokens) * self.embed_scale
        ple = self._per_layer_inputs(tokens, x) if c.hidden_size_per_layer_input else None
        shared = {}
        for i in range(c.num_layers):
            p, kind = f"layers.{i}.", c.layer_types[i]
            d, h_kv = c.layer_head_dim(i), c.layer_kv_heads(i)
            cos, sin = rope[kind]
            h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
            q = linear(w[p + "self_attn.q_proj.weight"], h).view(t, c.num_heads, d)
            q = apply_rope(rms_norm(q, w[p + "self_attn.q_norm.weight"], eps), cos, sin)
            if self.kv_source[i] == i:
                k_raw = linear(w[p + "self_attn.k_proj.weight"], h).view(t, h_kv, d)
                v_w = w.get(p + "self_attn.v_proj.weight")
                if c.attention_k_eq_v and kind == "full":
                    v_raw = k_raw  # K doubles as V on full layers
                elif v_w is None:
                    raise KeyError(p + "self_attn.v_proj.weight")
                else:
                    v_raw = linear(v_w, h).view(t, h_kv, d)
                k = apply_rope(rms_norm(k_raw, w[p + "self_attn.k_norm.weight"], eps), cos, sin)
                v = rms_norm(v_raw, None, eps)
                keys, values = cache.layers[i].read(plans[kind], start, k, v)
                shared[i] = (keys, values)
            else:
                keys, values = shared[self.kv_source[i]]
            a = attention(q, keys, values, plans[kind].mask, 1.0)
            a = linear(w[p + "self_attn.o_proj.weight"], a.reshape(t, c.num_heads * d))
            x = x + rms_norm(a, w[p + "post_attention_layernorm.weight"], eps)
            residual = x
            h = rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], eps)
            f = gated_mlp(w, p, h)
            if c.enable_moe_block:
                f = (rms_norm(f, w[p + "post_feedforward_layernorm_1.weight"], eps)
                     + rms_norm(self._moe(i, residual), w[p + "post_feedforward_layernorm_2.weight"], eps))
            x = residual + rms_norm(f, w[p + "post_feedforward_layernorm.weight"], eps)
            if ple is not None:
                g = F.gelu(linear(w[p + "per_layer_input_gate.weight"], x), approximate="tanh") * ple[:, i]
                g = linear(w[p + "per_layer_projection.weight"], g)
                x = x + rms_norm(g, w[p + "post_per_layer_input_norm.weight"], eps)
            scalar = w.get(p + "layer_scalar")
            if scalar is not None:
                x = x * scalar
        cache.advance(start, t)
        hidden = rms_norm(x, w["norm.weight"], eps)
        logits = linear(self.head, hidden if all_logits else hidden[-1:])
        if c.final_logit_softcapping:
            cap = c.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return ForwardOutput(logits=logits, hidden=hidden)
