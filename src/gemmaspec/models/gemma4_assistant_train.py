"""A trainable Gemma 4 assistant (MTP drafter) in PyTorch autograd form.

The same computation as :meth:`gemmaspec.models.gemma4_assistant.Gemma4Assistant.step` (the runtime
path ``--spec-type draft-mtp`` uses), written for training: many draft positions of one text chunk at
once, all attending over the target's K/V of that chunk. Its weights use the GGUF names the runtime
reads, so :mod:`gemmaspec.loading.assistant_gguf` writes them as they are and the exported file drafts
exactly what this module computes (tested).

One draft step for the positions p of a chunk (reference: transformers ``Gemma4AssistantForCausalLM``
and ``SinglePositionMultiTokenCandidateGenerator``; DESIGN §1):

    x = pre_projection([target_embed(token) * sqrt(Hb), h])        [P, 2 Hb] → [P, H]
    L layers: queries only, RoPE at p, attending over the target keys/values at positions < p
        (sliding layers: > p - window too), Gemma 4 MLP, norms, optional layer scalar
    hidden = output_norm(x); logits = head(hidden) (a reduced draft vocabulary); h' = post_projection(hidden)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import apply_rope, rope_cos_sin
from .config import Gemma4AssistantConfig


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)


class TrainableAssistant(nn.Module):
    """The assistant's parameters (named as in GGUF, with ``.`` → ``__``) and a batched draft step.

    Args:
        config: the assistant's :class:`~gemmaspec.models.config.Gemma4AssistantConfig` (its
            ``draft_vocab_size`` rows of head; ``text`` gives width, layers, heads, head dims, RoPE).
        token_map: int64 [draft_vocab_size], the target token id of each head row.
        seed: initialisation seed.
    """

    def __init__(self, config: Gemma4AssistantConfig, token_map: torch.Tensor, seed: int = 0):
        super().__init__()
        c = config.text
        self.config, self.c = config, c
        n_draft = int(token_map.numel())
        if config.draft_vocab_size != n_draft:
            raise ValueError(f"config says {config.draft_vocab_size} draft tokens, token_map has {n_draft}")
        g = torch.Generator().manual_seed(seed)
        hb, h = config.backbone_hidden_size, c.hidden_size

        def lin(n_out, n_in):
            return nn.Parameter(torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in))

        def ones(n, value=1.0):
            return nn.Parameter(torch.full((n,), value))

        p = {"nextn.pre_projection.weight": lin(h, 2 * hb), "nextn.post_projection.weight": lin(hb, h),
             "output_norm.weight": ones(h), "token_embd.weight": nn.Parameter(torch.randn(n_draft, h, generator=g) * 0.02)}
        for i in range(c.num_layers):
            d = c.layer_head_dim(i)
            b = f"blk.{i}."
            p.update({b + "attn_norm.weight": ones(h), b + "attn_q.weight": lin(c.num_heads * d, h),
                      # attention scale is 1 (Gemma 4): the query norm starts at 1/sqrt(d), so the first
                      # scores over the target's keys are those of ordinary scaled attention, not 16x sharper
                      b + "attn_q_norm.weight": ones(d, d ** -0.5), b + "attn_output.weight": lin(h, c.num_heads * d),
                      b + "post_attention_norm.weight": ones(h), b + "ffn_norm.weight": ones(h),
                      b + "ffn_gate.weight": lin(c.intermediate_size, h), b + "ffn_up.weight": lin(c.intermediate_size, h),
                      b + "ffn_down.weight": lin(h, c.intermediate_size), b + "post_ffw_norm.weight": ones(h)})
        self.params = nn.ParameterDict({k.replace(".", "__"): v for k, v in p.items()})
        self.register_buffer("token_map", token_map.long().clone())
        self.quant = None  # optional fake-quantizer applied to every 2-D weight (QAT)

    def weight(self, name: str) -> torch.Tensor:
        """The parameter with GGUF name ``name`` (fake-quantized for QAT when ``self.quant`` is set and it
        is a matrix)."""
        w = self.params[name.replace(".", "__")]
        if self.quant is not None and w.dim() == 2:
            return self.quant(w)
        return w

    def gguf_weights(self) -> dict[str, torch.Tensor]:
        """Every tensor under its GGUF name, detached float32 (matrices fake-quantized when QAT is on),
        plus ``draft_token_map``."""
        with torch.no_grad():
            out = {k.replace("__", "."): self.weight(k.replace("__", ".")).detach().float().clone()
                   for k in self.params.keys()}
        out["draft_token_map"] = self.token_map.clone()
        return out

    def step(self, x_embed: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, kv: dict) -> tuple:
        """One draft step for P positions.

        Args:
            x_embed: float32 [P, Hb], the target's scaled embedding of each position's input token.
            h: float32 [P, Hb], the target's final-norm hidden state of the position before (first
                step) or the previous step's ``post_projection`` output.
            positions: int64 [P], the position p of each query (RoPE; every step of a round uses the same p).
            kv: per layer type (``sliding``/``full``): (keys float32 [L, Hkv, D], values, mask bool [P, L]).

        Returns:
            (logits float32 [P, draft vocab], next h float32 [P, Hb]).
        """
        c, eps = self.c, self.c.rms_norm_eps
        w = self.weight
        x = torch.cat([x_embed, h], dim=-1) @ w("nextn.pre_projection.weight").T
        n = x.shape[0]
        rope = {"sliding": rope_cos_sin(positions, c.head_dim, c.rope_theta_local),
                "full": rope_cos_sin(positions, c.global_head_dim, c.rope_theta_global,
                                     rotary_dim=2 * int(c.partial_rotary_factor * c.global_head_dim // 2))}
        for i in range(c.num_layers):
            b, kind, d = f"blk.{i}.", c.layer_types[i], c.layer_head_dim(i)
            cos, sin = rope[kind]
            hn = _rms(x, w(b + "attn_norm.weight"), eps)
            q = (hn @ w(b + "attn_q.weight").T).view(n, c.num_heads, d)
            q = apply_rope(_rms(q, w(b + "attn_q_norm.weight"), eps), cos, sin)
            keys, values, mask = kv[kind]
            hkv = keys.shape[1]
            g = c.num_heads // hkv
            qg = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
            scores = qg @ keys.permute(1, 2, 0)  # [Hkv, g*P, L]; attention scale 1.0 (Gemma 4)
            scores = scores.view(hkv, g, n, -1).masked_fill(~mask, float("-inf")).view(hkv, g * n, -1)
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a position with no visible key
            a = (probs @ values.permute(1, 0, 2)).view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, c.num_heads * d)
            a = a @ w(b + "attn_output.weight").T
            x = x + _rms(a, w(b + "post_attention_norm.weight"), eps)
            hn = _rms(x, w(b + "ffn_norm.weight"), eps)
            f = torch.nn.functional.gelu(hn @ w(b + "ffn_gate.weight").T, approximate="tanh") * (hn @ w(b + "ffn_up.weight").T)
            x = x + _rms(f @ w(b + "ffn_down.weight").T, w(b + "post_ffw_norm.weight"), eps)
        hidden = _rms(x, w("output_norm.weight"), eps)
        return hidden @ w("token_embd.weight").T, hidden @ w("nextn.post_projection.weight").T


def assistant_config(target_config, width: int = 256, layers: int = 4, heads: int = 4, ffn: int = 1024,
                     draft_vocab: int = 16384) -> Gemma4AssistantConfig:
    """The configuration of an assistant for a target (Gemma 3 or Gemma 4 config), read from the
    target: its width (``backbone_hidden_size``), vocabulary, head dims, sliding window and RoPE of each
    layer type, so the assistant's queries meet the target's cached keys in the same rotary frame.

    Layers alternate like Google's assistants (sliding, ..., full last). For a Gemma 3 target the full
    layers rotate the whole head (Gemma 3's global RoPE) with its base, and both layer types use the
    target's single head dim: this is said in the config (``partial_rotary_factor`` 1.0,
    ``global_head_dim`` = ``head_dim``), not in special cases.

    Raises:
        ValueError: the target lacks sliding or full layers.
    """
    from .config import Gemma4Config

    t = target_config
    types = tuple(getattr(t, "layer_types", ()))
    if "sliding" not in types or "full" not in types:
        raise ValueError("the target needs sliding and full attention layers for an assistant to read")
    is_g4 = hasattr(t, "global_head_dim")
    head_dim = t.head_dim
    global_hd = t.global_head_dim if is_g4 else t.head_dim
    partial = t.partial_rotary_factor if is_g4 else 1.0
    if not is_g4 and getattr(t, "rope_scaling_factor", 1.0) != 1.0:
        raise ValueError("a Gemma 3 target with linear RoPE scaling is not supported by the assistant's RoPE yet")
    text = Gemma4Config(
        vocab_size=t.vocab_size, hidden_size=width, num_layers=layers, intermediate_size=ffn, num_heads=heads,
        num_kv_heads=t.num_kv_heads, head_dim=head_dim, global_head_dim=global_hd,
        rms_norm_eps=t.rms_norm_eps, context_length=t.context_length, sliding_window=t.sliding_window,
        rope_theta_local=getattr(t, "rope_theta_local", 10_000.0), rope_theta_global=t.rope_theta_global,
        partial_rotary_factor=partial, final_logit_softcapping=None,
        layer_types=tuple(["sliding"] * (layers - 1) + ["full"]), num_kv_shared_layers=layers,
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id, architecture="gemma4-assistant")
    return Gemma4AssistantConfig(text=text, backbone_hidden_size=t.hidden_size, draft_vocab_size=draft_vocab)
