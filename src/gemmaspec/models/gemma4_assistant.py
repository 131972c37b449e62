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

Reduced head (gemmaspec's trained assistants, ``gemmaspec train-drafter``): the head has one row per
token of a draft vocabulary, ``draft_token_map`` (int [N]) gives each row's target token id; every
other token gets the lowest score minus 1. llama.cpp's ``draft-mtp`` cannot load this form (it expects
a head over the whole vocabulary).
"""

from __future__ import annotations

import torch

from .config import Gemma4AssistantConfig
from ..kernels import BlockWeight
from .base import apply_rope, attention, linear, rms_norm
from .gemma4 import gated_mlp, rope_tables


class Gemma4Assistant:
    """An assistant drafter's weights and its draft step.

    Args:
        config: :class:`~gemmaspec.models.config.Gemma4AssistantConfig` (its own layers: all KV-shared, no
            PLE/MoE; the target's width; the clustered head's sizes).
        weights: llama.cpp GGUF names (``blk.0.attn_q.weight``, ``nextn.pre_projection.weight``,
            ``masked_embd_centroids.weight``, ...), float32 or block-quantized
            (``masked_embd_ordering`` int64).
        device: where the weights live.

    Raises:
        KeyError: naming a tensor the assistant needs.
    """

    def __init__(self, config: Gemma4AssistantConfig, weights: dict, device="cpu"):
        self.full_config, self.config = config, config.text
        self.backbone_hidden_size = config.backbone_hidden_size
        self.weights = weights
        self.device = torch.device(device)
        self.clustered = config.clustered
        need = ["output_norm.weight", "nextn.pre_projection.weight", "nextn.post_projection.weight"]
        for i in range(self.config.num_layers):
            p = f"blk.{i}."
            need += [p + n for n in ("attn_norm.weight", "post_attention_norm.weight",
                                     "ffn_norm.weight", "post_ffw_norm.weight",
                                     "attn_q.weight", "attn_q_norm.weight", "attn_output.weight",
                                     "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")]
        if self.clustered:
            need += ["masked_embd_centroids.weight", "masked_embd_ordering"]
        if "output.weight" not in weights:
            need.append("token_embd.weight")
        missing = [n for n in need if n not in weights]
        if missing:
            raise KeyError(missing[0])
        for i in range(self.config.num_layers):
            name = f"blk.{i}.layer_output_scale.weight"
            if name in weights:
                weights[name] = weights[name].reshape(1)
        self.head = weights.get("output.weight", weights.get("token_embd.weight"))
        self.token_map = weights.get("draft_token_map")
        if self.token_map is not None:
            self.token_map = self.token_map.long().reshape(-1)
            if self.token_map.shape[0] != self.head.shape[0]:
                raise ValueError(f"draft_token_map has {self.token_map.shape[0]} entries for a head of "
                                 f"{self.head.shape[0]} rows")
            if int(self.token_map.min()) < 0 or int(self.token_map.max()) >= config.vocab_size:
                raise ValueError(f"draft_token_map holds ids outside the target vocabulary of {config.vocab_size}")

    def to(self, device) -> "Gemma4Assistant":
        """The same assistant with every weight on ``device``."""
        return Gemma4Assistant(self.full_config, {k: v.to(device) for k, v in self.weights.items()}, device)

    @property
    def has_clustered_head(self) -> bool:
        return bool(self.clustered)

    @property
    def vocab_size(self) -> int:
        """The vocabulary the drafts are in: the target's (a reduced head maps into it)."""
        return self.full_config.vocab_size if self.token_map is not None else self.head.shape[0]

    def head_dims(self) -> dict:
        """Per layer type the head dim its queries use: what the target's cache must match."""
        c = self.config
        return {c.layer_types[i]: c.layer_head_dim(i) for i in range(c.num_layers)}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [V] scores for hidden float32 [H] (full tied head, the clustered head, or a reduced
        head mapped into the target's vocabulary)."""
        if self.token_map is not None:
            scores = linear(self.head, hidden[None])[0]
            out = torch.full((self.vocab_size,), float(scores.min()) - 1.0, dtype=hidden.dtype, device=hidden.device)
            out[self.token_map] = scores
            return out
        if not self.clustered:
            return linear(self.head, hidden[None])[0]
        n_c, top_k = self.clustered
        v = self.head.shape[0]
        per = v // n_c
        cent = linear(self.weights["masked_embd_centroids.weight"], hidden[None])[0]
        top = torch.topk(cent, top_k).indices
        ids = self.weights["masked_embd_ordering"].long().view(n_c, per)[top].reshape(-1)
        rows = self.head.rows(ids) if isinstance(self.head, BlockWeight) else self.head[ids]
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
        c, w, eps = self.config, self.weights, self.config.rms_norm_eps
        x = linear(w["nextn.pre_projection.weight"], torch.cat([x_embed, h])[None])  # [1, H]
        pos = torch.tensor([position], device=x.device)
        rope = rope_tables(c, pos)
        for i in range(c.num_layers):
            p, kind = f"blk.{i}.", c.layer_types[i]
            d = c.layer_head_dim(i)
            cos, sin = rope[kind]
            hn = rms_norm(x, w[p + "attn_norm.weight"], eps)
            q = linear(w[p + "attn_q.weight"], hn).view(1, c.num_heads, d)
            q = apply_rope(rms_norm(q, w[p + "attn_q_norm.weight"], eps), cos, sin)
            keys, values, mask = kv[kind]
            a = attention(q, keys, values, mask, 1.0)
            a = linear(w[p + "attn_output.weight"], a.reshape(1, c.num_heads * d))
            x = x + rms_norm(a, w[p + "post_attention_norm.weight"], eps)
            hn = rms_norm(x, w[p + "ffn_norm.weight"], eps)
            f = gated_mlp(w, p, hn)
            x = x + rms_norm(f, w[p + "post_ffw_norm.weight"], eps)
            scalar = w.get(p + "layer_output_scale.weight")
            if scalar is not None:
                x = x * scalar
        hidden = rms_norm(x, w["output_norm.weight"], eps)[0]
        return self.logits(hidden), linear(w["nextn.post_projection.weight"], hidden[None])[0]
