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

Weights are addressed by llama.cpp's GGUF names (``blk.3.attn_q.weight``), the one naming convention
of every model here; :func:`hf_to_gguf_name` maps a transformers checkpoint's names onto them (the
converter writes GGUF files with the same map).
"""

from __future__ import annotations

import re

import gguf
import torch
import torch.nn.functional as F

from .config import Gemma4Config
from ..kernels import BlockWeight, CPUBlockWeight, StackedWeight
from ..kv_cache import KVCache
from .base import (ForwardOutput, add_rms_norm, attention, gelu_mul, gelu_mul_by, linear, norm_rope, open_images,
                   rms_norm, rope_cos_sin, rope_span, step_threads)
from .decode_step4 import run_layers4


def _lookup(table, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows ``ids`` int64 [T] of a dense float32 table or a block-quantized one (rows
    dequantized on the fly, exactly), float32 [T, dim]. Quantized tables stay quantized in memory: the
    E2B/E4B per-layer table alone is 262,144 x 35 x 256 values (9.4 GB as float32)."""
    return table.rows(ids) if isinstance(table, BlockWeight) else table[ids]


def _rotary_dim(c: Gemma4Config) -> int:
    """Dimensions of a full layer's head that rotate (proportional RoPE): 2 * floor(factor * global_head_dim / 2)."""
    return 2 * int(c.partial_rotary_factor * c.global_head_dim // 2)


def rope_tables(c: Gemma4Config, pos: torch.Tensor) -> dict:
    """cos/sin per layer type for positions int64 [T]: sliding layers rotate the whole head (base
    ``rope_theta_local``); full layers use proportional RoPE over ``global_head_dim``."""
    return {
        "sliding": rope_cos_sin(pos, c.head_dim, c.rope_theta_local),
        "full": rope_cos_sin(pos, c.global_head_dim, c.rope_theta_global, rotary_dim=_rotary_dim(c)),
    }


def rope_rows(c: Gemma4Config, start: int, t: int) -> dict:
    """:func:`rope_tables` of positions ``start .. start + t - 1`` as rows of the CPU table (views, the
    same values; see :func:`~gemmaspec.models.base.rope_span`)."""
    return {
        "sliding": rope_span(start, t, c.head_dim, c.rope_theta_local),
        "full": rope_span(start, t, c.global_head_dim, c.rope_theta_global, rotary_dim=_rotary_dim(c)),
    }


def _fuse(parts):
    """The CPU block-quantized weights ``parts`` (same K) side by side along N, one kernel call for all
    (:class:`~gemmaspec.kernels.StackedWeight`: no copy); None when they are not all such weights."""
    if len(parts) < 2 or not all(isinstance(p, CPUBlockWeight) and p._device.type == "cpu" for p in parts):
        return None
    try:
        return StackedWeight(parts)
    except ValueError:
        return None


class _Layer:
    """One decoder layer's weights as a forward uses them.

    ``qkv``: the products of the layer's attention input side by side, [q | k | v] (own K/V), [q | k]
    (``attention_k_eq_v`` full layer: V is K's output) or [q] (KV-shared layer), as one
    :class:`~gemmaspec.kernels.StackedWeight` when they are block-quantized on the CPU, else None and
    ``qkv_parts`` holds them. ``gate_up`` likewise ([gate | up]), else ``gate``/``up``. ``ple_*``: the
    per-layer-input gate, projection and norm (None without per-layer embeddings); ``scale``: the
    layer's output scalar float32 [1] or None.
    """

    def __init__(self, w: dict, i: int, c: Gemma4Config, src: list[int]):
        p = f"blk.{i}."
        self.kind, self.d, self.hkv = c.layer_types[i], c.layer_head_dim(i), c.layer_kv_heads(i)
        self.src = src[i]
        self.k_eq_v = bool(c.attention_k_eq_v and self.kind == "full")
        self.kv = 0 if src[i] != i else 1 if self.k_eq_v else 2  # K/V products: none, k (V = K), k and v
        self.attn_norm, self.q_norm = w[p + "attn_norm.weight"], w[p + "attn_q_norm.weight"]
        self.k_norm = w[p + "attn_k_norm.weight"] if self.kv else self.q_norm
        self.post_attn_norm, self.ffn_norm = w[p + "post_attention_norm.weight"], w[p + "ffn_norm.weight"]
        self.post_ffn_norm = w[p + "post_ffw_norm.weight"]
        names = ("attn_q", "attn_k", "attn_v")[:1 + self.kv]
        self.qkv_parts = [w[p + n + ".weight"] for n in names]
        self.qkv = _fuse(self.qkv_parts)
        self.o, self.down = w[p + "attn_output.weight"], w[p + "ffn_down.weight"]
        self.gate, self.up = w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]
        self.gate_up = _fuse([self.gate, self.up])
        self.ple_gate, self.ple_proj, self.ple_norm = (w.get(p + n) for n in ("inp_gate.weight", "proj.weight",
                                                                           "post_norm.weight"))
        self.scale = w.get(p + "layer_output_scale.weight")

    def products(self) -> list:
        """The layer's weights the kernel multiplies by (for the background regroup's sync)."""
        mats = [self.qkv] if self.qkv is not None else list(self.qkv_parts)
        mats += [self.o, self.gate_up] if self.gate_up is not None else [self.o, self.gate, self.up]
        return mats + [self.down] + [m for m in (self.ple_gate, self.ple_proj) if m is not None]


_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_HF_SKIP = ("vision_tower", "audio_tower", "embed_vision", "embed_audio", "multi_modal_projector")
_HF_SPECIAL = {  # transformers suffix inside a layer -> GGUF name inside blk.N (names llama.cpp adds by hand)
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "layer_scalar": "layer_output_scale.weight",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}
_HF_GLOBAL = {  # transformers name (no text prefix) -> GGUF name
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


def hf_to_gguf_name(name: str, n_layers: int) -> str | None:
    """A Gemma 4 target's or assistant's transformers tensor name → llama.cpp's GGUF name, or None
    for tensors the text model does not use (vision/audio towers) or llama.cpp's layout has no place
    for (K/V projections of KV-shared layers). Source: llama.cpp ``convert_hf_to_gguf.py``
    (``Gemma4Model``, ``Gemma4AssistantModel``) and ``gguf.TensorNameMap``."""
    if any(s in name for s in _HF_SKIP):
        return None
    if name != "lm_head.weight":
        for prefix in _HF_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    m = re.match(r"layers\.(\d+)\.(.+)$", name)
    if m:
        bid, rest = m.group(1), m.group(2)
        if rest in _HF_SPECIAL:
            return f"blk.{bid}.{_HF_SPECIAL[rest]}"
        base, _, suffix = rest.rpartition(".")
        mapped = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n_layers).get_name(f"model.layers.{bid}.{base}")
        if mapped:
            return f"{mapped}.{suffix}"
    return None


def kv_layout(c: Gemma4Config) -> dict:
    """Per layer type, the cache layer an MTP assistant reads: ``{"sliding"|"full": (layer index,
    KV heads, head dim)}``, the last layer of that type that computes its own K/V."""
    src = c.kv_source()
    out = {}
    for i in range(c.num_layers):
        if src[i] == i:
            out[c.layer_types[i]] = (i, c.layer_kv_heads(i), c.layer_head_dim(i))
    return out


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
        self.weights = weights
        self.kv_source = c.kv_source()
        missing = [n for n in self.required_tensors() if n not in weights]
        if missing:
            raise KeyError(missing[0])
        for i in range(c.num_layers):  # a per-layer scalar is used as a 1-element tensor
            name = f"blk.{i}.layer_output_scale.weight"
            if name in weights:
                weights[name] = weights[name].reshape(1)
        self.embed = weights["token_embd.weight"]
        self.head = weights.get("output.weight", self.embed)
        self.embed_scale = torch.tensor(c.hidden_size ** 0.5, dtype=torch.float32)
        self.layers = [_Layer(weights, i, c, self.kv_source) for i in range(c.num_layers)]

    def to(self, device) -> "Gemma4Model":
        """The same model with every weight on ``device``."""
        return Gemma4Model(self.config, {k: v.to(device) for k, v in self.weights.items()}, device)

    def embed_row(self, token: int) -> torch.Tensor:
        """The scaled input embedding of one token, float32 [hidden] (what the MTP assistant reads)."""
        return self.embed_rows([token])[0]

    def embed_rows(self, tokens: list[int]) -> torch.Tensor:
        """:meth:`embed_row` of each token, float32 [len(tokens), hidden], in one lookup (each row
        unpacked and scaled on its own: the same values)."""
        return _lookup(self.embed, torch.tensor(tokens, dtype=torch.int64, device=self.device)) * self.embed_scale

    def kv_layout(self) -> dict:
        """See :func:`kv_layout` (what an MTP assistant reads of this model's cache)."""
        return kv_layout(self.config)

    def required_tensors(self) -> list[str]:
        """Names this configuration needs (absent K/V of KV-shared layers are not among them)."""
        c = self.config
        names = ["token_embd.weight", "output_norm.weight"]
        if c.hidden_size_per_layer_input:
            names += ["per_layer_token_embd.weight", "per_layer_model_proj.weight",
                      "per_layer_proj_norm.weight"]
        for i in range(c.num_layers):
            p = f"blk.{i}."
            names += [p + n for n in ("attn_norm.weight", "post_attention_norm.weight",
                                      "ffn_norm.weight", "post_ffw_norm.weight",
                                      "attn_q.weight", "attn_q_norm.weight", "attn_output.weight",
                                      "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")]
            if self.kv_source[i] == i:
                names += [p + "attn_k.weight", p + "attn_k_norm.weight"]
                if not (c.attention_k_eq_v and c.layer_types[i] == "full"):
                    names.append(p + "attn_v.weight")
            if c.hidden_size_per_layer_input:
                names += [p + "inp_gate.weight", p + "proj.weight",
                          p + "post_norm.weight"]
            if c.enable_moe_block:
                names += [p + n for n in ("ffn_gate_inp.weight", "ffn_gate_inp.scale", "ffn_down_exps.scale",
                                          "ffn_gate_up_exps.weight", "ffn_down_exps.weight",
                                          "post_ffw_norm_1.weight", "post_ffw_norm_2.weight",
                                          "pre_ffw_norm_2.weight")]
        return names

    def new_cache(self, capacity: int, max_rollback: int = 16, ring: bool = True) -> KVCache:
        """An empty KV cache (``ring=False``: sliding layers keep every position, row = position)."""
        c = self.config
        windows = [c.sliding_window if t == "sliding" and ring else None for t in c.layer_types]
        shapes = [(c.layer_kv_heads(i), c.layer_head_dim(i)) if self.kv_source[i] == i else None
                  for i in range(c.num_layers)]
        return KVCache(windows, capacity, c.num_kv_heads, c.head_dim, max_rollback, device=self.device, shapes=shapes)

    def _per_layer_inputs(self, tokens: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """float32 [T, num_layers, ple_dim]."""
        c, w = self.config, self.weights
        t, p = tokens.shape[0], c.hidden_size_per_layer_input
        table = _lookup(w["per_layer_token_embd.weight"], tokens) * torch.tensor(p ** 0.5, dtype=torch.float32)
        proj = linear(w["per_layer_model_proj.weight"], embeds) * (c.hidden_size ** -0.5)
        proj = rms_norm(proj.view(t, c.num_layers, p), w["per_layer_proj_norm.weight"], c.rms_norm_eps)
        return (proj + table.view(t, c.num_layers, p)) * (2.0 ** -0.5)

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The experts' contribution for input x float32 [T, hidden] (before its post-norm)."""
        c, w, p = self.config, self.weights, f"blk.{i}."
        h = rms_norm(x, None, c.rms_norm_eps) * w[p + "ffn_gate_inp.scale"] * (c.hidden_size ** -0.5)
        probs = torch.softmax(linear(w[p + "ffn_gate_inp.weight"], h), dim=-1)
        top_w, top_i = torch.topk(probs, c.top_k_experts, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True) * w[p + "ffn_down_exps.scale"][top_i]
        xin = rms_norm(x, w[p + "pre_ffw_norm_2.weight"], c.rms_norm_eps)
        out = torch.zeros_like(x)
        gate_up, down = w[p + "ffn_gate_up_exps.weight"], w[p + "ffn_down_exps.weight"]
        for e in torch.unique(top_i).tolist():
            rows, slot = torch.where(top_i == e)
            g, u = F.linear(xin[rows], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.gelu(g, approximate="tanh") * u, down[e]) * top_w[rows, slot, None]
            out.index_add_(0, rows, y)
        return out

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, all_logits: bool = False,
                images: list | None = None) -> ForwardOutput:
        """Run ``tokens`` int64 [T] at positions cache.length.. (see :class:`CausalLM`).

        ``images``: ``[(row, embeddings float32 [n, hidden])]``: rows ``row .. row + n - 1`` take those
        embeddings instead of their tokens' (unscaled; their per-layer embeddings are the pad token's,
        projected from the image rows, as transformers' ``Gemma4Model.forward``). With
        ``bidirectional_vision`` an image's rows see each other on sliding layers (within the window);
        full layers stay causal (``create_masks_for_vision_model``). Each image lies wholly in one forward.

        Returns:
            logits float32 [1 or T, vocab] (soft-capped), hidden float32 [T, hidden] after the final norm.
        """
        with step_threads(tokens.shape[0]):
            return self._forward(tokens, cache, all_logits, images or None)

    def _forward(self, tokens: torch.Tensor, cache: KVCache, all_logits: bool, images=None) -> ForwardOutput:
        c, w, eps = self.config, self.weights, self.config.rms_norm_eps
        t = tokens.shape[0]
        start = cache.length
        if start + t > cache.capacity:
            raise ValueError(f"{start + t} positions exceed the context size {cache.capacity}")
        if self.device.type == "cpu":
            rope = rope_rows(c, start, t)
        else:
            rope = rope_tables(c, torch.arange(start, start + t, device=self.device))
        plans = {"sliding": cache.plan(start, t, c.sliding_window), "full": cache.plan(start, t, None)}
        x = _lookup(w["token_embd.weight"], tokens) * self.embed_scale
        if images:
            x, tokens = x.clone(), tokens.clone()
            for row, emb in images:
                x[row:row + emb.shape[0]] = emb.to(x.dtype)
                tokens[row:row + emb.shape[0]] = c.pad_token_id
            if c.bidirectional_vision:
                plans["sliding"] = open_images(plans["sliding"], start, t, images, c.sliding_window, cache)
        ple = self._per_layer_inputs(tokens, x) if c.hidden_size_per_layer_input else None
        fast = None if c.enable_moe_block or images else run_layers4(self, x, ple, cache, start, plans, rope)
        if fast is not None:
            x = fast
        else:
            shared = {}
            for i, ly in enumerate(self.layers):
                x = self._layer(i, ly, x, ple, cache, start, plans[ly.kind], rope[ly.kind], shared)
        cache.advance(start, t)
        hidden = rms_norm(x, w["output_norm.weight"], eps)
        logits = linear(self.head, hidden if all_logits else hidden[-1:])
        if c.final_logit_softcapping:
            cap = c.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return ForwardOutput(logits=logits, hidden=hidden)

    def _layer(self, i: int, ly: _Layer, x: torch.Tensor, ple, cache: KVCache, start: int, plan, rope,
               shared: dict) -> torch.Tensor:
        """Decoder layer i on x float32 [T, hidden] (the per-op path): each step one call of the C helper
        that ``gs_gemma4_layers`` (``kernels/layers4.h``) calls at the same point, where the C kernel
        applies (else the same formula in PyTorch). ``shared``: layer → its (keys, values) this forward,
        what KV-shared layers read."""
        c, eps = self.config, self.config.rms_norm_eps
        t, hq, d, hkv = x.shape[0], c.num_heads, ly.d, ly.hkv
        cos, sin = rope
        h = rms_norm(x, ly.attn_norm, eps)
        if ly.qkv is not None:
            qkv = linear(ly.qkv, h)
        else:
            qkv = torch.cat([linear(m, h) for m in ly.qkv_parts], dim=-1) if ly.kv else linear(ly.qkv_parts[0], h)
        if ly.kv:
            qk = norm_rope(qkv, hq, hkv, d, ly.q_norm, ly.k_norm, cos, sin, eps)
            v0 = hq * d if ly.k_eq_v else (hq + hkv) * d  # K doubles as V on k_eq_v layers (before k_norm, RoPE)
            v = rms_norm(qkv[:, v0:v0 + hkv * d].reshape(t, hkv, d), None, eps)
            q = qk[:, :hq]
            keys, values = cache.layers[i].update(plan, start, qk[:, hq:], v)
            shared[i] = (keys, values)
        else:
            q = norm_rope(qkv, hq, 0, d, ly.q_norm, ly.q_norm, cos, sin, eps)
            keys, values = shared[ly.src]
        a = attention(q, keys, values, plan.mask, 1.0)
        x = add_rms_norm(x, linear(ly.o, a.reshape(t, hq * d)), ly.post_attn_norm, eps)
        h = rms_norm(x, ly.ffn_norm, eps)
        if ly.gate_up is not None:
            f = linear(ly.down, gelu_mul(linear(ly.gate_up, h)))
        else:
            f = linear(ly.down, gelu_mul_by(linear(ly.gate, h), linear(ly.up, h)))
        if c.enable_moe_block:
            w = self.weights
            f = (rms_norm(f, w[f"blk.{i}.post_ffw_norm_1.weight"], eps)
                 + rms_norm(self._moe(i, x), w[f"blk.{i}.post_ffw_norm_2.weight"], eps))
        x = add_rms_norm(x, f, ly.post_ffn_norm, eps)
        if ple is not None:
            g = gelu_mul_by(linear(ly.ple_gate, x), ple[:, i])
            x = add_rms_norm(x, linear(ly.ple_proj, g), ly.ple_norm, eps)
        if ly.scale is not None:
            x = x * ly.scale
        return x
