"""Gemma 4 assistant: the multi-token-prediction (MTP) drafter shipped with every Gemma 4 model.

Reference: transformers ``models/gemma4_assistant/modeling_gemma4_assistant.py``
(``Gemma4AssistantForCausalLM``) and ``generation/candidate_generator.py``
(``SinglePositionMultiTokenCandidateGenerator``). One draft step, at the position p of the last
token (every step of a round uses the same p):

    x = pre_projection(concat(target_embed(token) * sqrt(target width), h))      [1, 2·Hb] → [1, H]
    4 decoder layers: queries only (q_proj, q_norm, RoPE at p), attending over the *target's* cached
        K/V of the last unshared target layer of the same type (sliding layers: keys within the
        window of p); then the Gemma 4 MLP, norms and layer scalar
    hidden = norm(x); logits = hidden @ embed^T (tied head; or the clustered head below)
    h = post_projection(hidden)                                                   [1, H] → [1, Hb]

The assistant keeps no KV cache. The key set is the target's cache as it stands when drafting:
positions 0..p-1 (the last token at p has not been run by the target yet).

Clustered head (``use_ordered_embeddings``): score ``num_centroids`` centroids, keep the top
``centroid_intermediate_top_k`` clusters of ``vocab / num_centroids`` tokens each (given by
``token_ordering``), and score only those tokens; all others get the lowest score minus 1.
"""

from __future__ import annotations

import torch

from ..config import Gemma4Config
from ..kernels import QuantizedWeight
from .base import apply_rope, attention, linear, rms_norm
from .gemma4 import gated_mlp, rope_tables


class Gemma4Assistant:
    """An assistant drafter's weights and its draft step.

    Args:
        config: the assistant's own text config (all layers KV-shared, no PLE/MoE).
        backbone_hidden_size: the target's width.
        weights: transformers names (``model.layers.0.self_attn.q_proj.weight``, ``pre_projection.weight``,
            ``masked_embedding.centroids.weight``, ...), float32 (``token_ordering`` int64).
        clustered: (num_centroids, top_k) when the clustered head is used, else None.

    Raises:
        KeyError: naming a tensor the assistant needs.
    """

    def __init__(self, config: Gemma4Config, backbone_hidden_size: int, weights: dict, clustered=None,
                 device="cpu"):
        self.config, self.backbone_hidden_size, self.w = config, backbone_hidden_size, weights
        self.device = torch.device(device)
        self.clustered = clustered
        need = ["model.norm.weight", "pre_projection.weight", "post_projection.weight"]
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            need += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                     "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
                                     "self_attn.q_proj.weight", "self_attn.q_norm.weight", "self_attn.o_proj.weight",
                                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
        if clustered:
            need += ["masked_embedding.centroids.weight", "masked_embedding.token_ordering"]
        if "lm_head.weight" not in weights and "model.embed_tokens.weight" not in weights:
            need.append("model.embed_tokens.weight")
        missing = [n for n in need if n not in weights]
        if missing:
            raise KeyError(missing[0])
        self.head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))

    @property
    def has_clustered_head(self) -> bool:
        return bool(self.clustered)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [V] scores for hidden float32 [H] (full tied head, or the clustered head)."""
        if not self.clustered:
            return linear(self.head, hidden[None])[0]
        n_c, top_k = self.clustered
        v = self.head.shape[0]
        per = v // n_c
        cent = linear(self.w["masked_embedding.centroids.weight"], hidden[None])[0]
        top = torch.topk(cent, top_k).indices
        ids = self.w["masked_embedding.token_ordering"].long().view(n_c, per)[top].reshape(-1)
        rows = self.head.rows(ids) if isinstance(self.head, QuantizedWeight) else self.head[ids]
        scores = rows @ hidden
        out = torch.full((v,), float(scores.min()) - 1.0, dtype=hidden.dtype)
        out[ids] = scores
        return out

    def step(self, x_embed: torch.Tensor, h: torch.Tensor, position: int, kv: dict):
        """One draft step.

        Args:
            x_embed: the target's scaled embedding of the last token, float32 [Hb].
            h: float32 [Hb]: the target's final-norm hidden state (first step) or the previous
                step's projected state.
            position: p, the last token's position.
            kv: per layer type ("sliding"/"full"): (keys [L, Hkv, D], values, mask bool [1, L] or None).

        Returns:
            (logits float32 [V], next h float32 [Hb]).
        """
        c, w, eps = self.config, self.w, self.config.rms_norm_eps
        x = linear(w["pre_projection.weight"], torch.cat([x_embed, h])[None])  # [1, H]
        pos = torch.tensor([position], device=x.device)
        rope = rope_tables(c, pos)
        for i in range(c.num_layers):
            p, kind = f"model.layers.{i}.", c.layer_types[i]
            d = c.layer_head_dim(i)
            cos, sin = rope[kind]
            hn = rms_norm(x, w[p + "input_layernorm.weight"], eps)
            q = linear(w[p + "self_attn.q_proj.weight"], hn).view(1, c.num_heads, d)
            q = apply_rope(rms_norm(q, w[p + "self_attn.q_norm.weight"], eps), cos, sin)
            keys, values, mask = kv[kind]
            a = attention(q, keys, values, mask, 1.0)
            a = linear(w[p + "self_attn.o_proj.weight"], a.reshape(1, c.num_heads * d))
            x = x + rms_norm(a, w[p + "post_attention_layernorm.weight"], eps)
            hn = rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], eps)
            f = gated_mlp(w, p, hn)
            x = x + rms_norm(f, w[p + "post_feedforward_layernorm.weight"], eps)
            scalar = w.get(p + "layer_scalar")
            if scalar is not None:
                x = x * scalar
        hidden = rms_norm(x, w["model.norm.weight"], eps)[0]
        return self.logits(hidden), linear(w["post_projection.weight"], hidden[None])[0]
