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
from .base import add_rms_norm, attention, gelu_mul, linear, norm_rope, rms_norm
from .gemma4 import rope_tables


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
        ids, scores = self._candidates(hidden)
        out = torch.full((self.head.shape[0],), float(scores.min()) - 1.0, dtype=hidden.dtype)
        out[ids] = scores
        return out

    def _candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The clustered head: (token ids int64 [top_k * per], their scores float32) for hidden [H]:
        the ``top_k`` best of ``num_centroids`` centroids, the tokens of those clusters scored against
        the tied embedding (``BlockWeight.dot_rows``: only those rows unpacked)."""
        n_c, top_k = self.clustered
        per = self.head.shape[0] // n_c
        cent = linear(self.weights["masked_embd_centroids.weight"], hidden[None])[0]
        top = torch.topk(cent, top_k).indices
        ids = self.weights["masked_embd_ordering"].long().view(n_c, per)[top].reshape(-1)
        if hasattr(self.head, "dot_rows"):
            return ids, self.head.dot_rows(ids, hidden)
        if isinstance(self.head, BlockWeight):
            return ids, self.head.rows(ids) @ hidden
        return ids, self.head[ids] @ hidden

    def rope_at(self, position: int) -> dict:
        """Per layer type (cos, sin) float32 [1, head dim] at ``position`` (every step of a round uses
        the same position, so a round computes them once)."""
        return rope_tables(self.config, torch.tensor([position], device=self.device))

    def ropes_at(self, positions: list[int]) -> list[dict]:
        """:meth:`rope_at` of each position, from one lookup: row r's (cos, sin) are rows of one
        [B, head dim] table (the same values; RoPE is elementwise in the position)."""
        t = rope_tables(self.config, torch.tensor(positions, device=self.device))
        return [{k: (c[r:r + 1], s[r:r + 1]) for k, (c, s) in t.items()} for r in range(len(positions))]

    def step(self, x_embed: torch.Tensor, h: torch.Tensor, position: int, kv: dict, rope: dict | None = None):
        """One draft step.

        Args:
            x_embed: the target's scaled embedding of the last token, float32 [Hb].
            h: float32 [Hb]: the target's final-norm hidden state (first step) or the previous
                step's projected state.
            position: p, the last token's position.
            kv: per layer type ("sliding"/"full"): (keys [L, Hkv, D], values, mask bool [1, L] or None).
            rope: :meth:`rope_at` (position) when the caller has it already.

        Returns:
            (logits float32 [V], next h float32 [Hb]).
        """
        hidden, next_h = self.step_hidden(x_embed, h, position, kv, rope)
        return self.logits(hidden), next_h

    def step_hidden(self, x_embed: torch.Tensor, h: torch.Tensor, position: int, kv: dict,
                    rope: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step` up to the head: ``(hidden float32 [H], next h float32 [Hb])``, ``hidden`` being
        the final-norm state the head scores. On the CPU with the C kernel and block-quantized matrices
        the whole step is one call of ``gs_assistant_step`` (:mod:`.assistant_step`; the same C
        functions in the same order as the ops below, so the same bits)."""
        return self._step(x_embed, h, position, kv, rope, False)[:2]

    def draft_step(self, x_embed: torch.Tensor, h: torch.Tensor, position: int, kv: dict,
                   rope: dict | None = None) -> tuple[int, torch.Tensor]:
        """``(greedy draft token, next h float32 [Hb])`` of one step: :meth:`draft_token` of
        :meth:`step_hidden`'s hidden state; with a reduced head in the C step, scored in the same call."""
        hidden, next_h, tok = self._step(x_embed, h, position, kv, rope, True)
        return (self.draft_token(hidden) if tok is None else tok[0]), next_h

    def draft_step_p(self, x_embed: torch.Tensor, h: torch.Tensor, position: int, kv: dict,
                     rope: dict | None = None) -> tuple[int, float, torch.Tensor]:
        """:meth:`draft_step` with the draft's probability: ``(token, p, next h float32 [Hb])``, p the
        softmax probability of the greedy token over the head's rows (the draft vocabulary of a reduced
        head, the scored clusters of a clustered one, else the whole vocabulary); what
        ``--spec-draft-p-min`` compares, as llama.cpp's draft-model loop does."""
        hidden, next_h, tok = self._step(x_embed, h, position, kv, rope, True)
        if tok is not None:
            return tok[0], tok[1], next_h
        if self.token_map is not None:
            scores = linear(self.head, hidden[None])[0]
        else:
            scores = self.logits(hidden)
            if self.clustered:  # only the scored clusters' tokens (the rest hold a filler below them all)
                scores = scores[scores > scores.min()]
        probs = torch.softmax(scores.double(), dim=-1)
        t = self.draft_token(hidden)
        return t, float(probs.max()), next_h

    def draft_steps(self, x_embed: torch.Tensor, h: torch.Tensor, positions: list[int], kvs: list[dict],
                    ropes: list[dict] | None = None, probs: bool = True, prepared=None,
                    rows: list[int] | None = None) -> tuple[list[int], list, torch.Tensor]:
        """One draft step for several sequences at once (several slots drafting in the same round):
        ``(tokens, probabilities, next h float32 [B, Hb])``, row b exactly :meth:`draft_step_p` on
        row b alone. On the CPU with the C kernel and a reduced block-quantized head, the rows run
        together in one call (``gs_assistant_steps``: the products over all rows at once, 16 rows per
        call at most); otherwise row by row.

        Args:
            x_embed, h: float32 [B, Hb] (see :meth:`step`).
            positions: each row's draft position p.
            kvs: each row's target K/V (as :meth:`step`'s ``kv``).
            ropes: each row's :meth:`rope_at` (computed when None).
            probs: whether the probabilities are needed (a p-min to compare): row by row without
                them, each row runs :meth:`draft_step` (the same token, no softmax) and gets None.
            prepared, rows: :meth:`prepare_steps` of the round's rows and which of them these B are
                (each row's part of the C call's arguments is then not built again every step).
        """
        ropes = [self.rope_at(p) for p in positions] if ropes is None else ropes
        n = x_embed.shape[0]
        if self.device.type == "cpu":
            from .assistant_step import run_steps

            toks, ps, hs = [], [], []
            for i in range(0, n, 16):
                if prepared is not None and rows is not None:
                    got = run_steps(self, x_embed[i:i + 16], h[i:i + 16], None, None, rows[i:i + 16], prepared)
                else:
                    got = run_steps(self, x_embed[i:i + 16], h[i:i + 16], kvs[i:i + 16], ropes[i:i + 16])
                if got is None:
                    break
                toks += got[2]
                ps += got[3]
                hs.append(got[1])
            else:
                return toks, ps, torch.cat(hs) if hs else h[:0].clone()
        toks, ps, hs = [], [], []
        for i in range(n):
            if probs:
                t, p, nh = self.draft_step_p(x_embed[i], h[i], positions[i], kvs[i], ropes[i])
            else:
                (t, nh), p = self.draft_step(x_embed[i], h[i], positions[i], kvs[i], ropes[i]), None
            toks.append(t)
            ps.append(p)
            hs.append(nh)
        return toks, ps, torch.stack(hs)

    def prepare_steps(self, kvs: list[dict], ropes: list[dict]):
        """What the batched C step needs of each row that stays the same through a round (its target
        K/V, mask and RoPE at its draft position), built once for the round's :meth:`draft_steps`;
        None where the C step does not apply (those then build per call or run row by row)."""
        if self.device.type != "cpu":
            return None
        from .assistant_step import prepare_rows

        return prepare_rows(self, kvs, ropes)

    def _step(self, x_embed, h, position, kv, rope, token: bool):
        rope = self.rope_at(position) if rope is None else rope
        if self.device.type == "cpu":
            from .assistant_step import run_step

            got = run_step(self, x_embed, h, kv, rope, token)
            if got is not None:
                return got
        c, w, eps = self.config, self.weights, self.config.rms_norm_eps
        x = linear(w["nextn.pre_projection.weight"], torch.cat([x_embed, h])[None])  # [1, H]
        for i in range(c.num_layers):
            p, kind = f"blk.{i}.", c.layer_types[i]
            d = c.layer_head_dim(i)
            cos, sin = rope[kind]
            hn = rms_norm(x, w[p + "attn_norm.weight"], eps)
            q = linear(w[p + "attn_q.weight"], hn)  # [1, heads * d]
            q = norm_rope(q, c.num_heads, 0, d, w[p + "attn_q_norm.weight"], w[p + "attn_q_norm.weight"], cos, sin, eps)
            keys, values, mask = kv[kind]
            a = attention(q, keys, values, mask, 1.0)
            a = linear(w[p + "attn_output.weight"], a.reshape(1, c.num_heads * d))
            x = add_rms_norm(x, a, w[p + "post_attention_norm.weight"], eps)
            hn = rms_norm(x, w[p + "ffn_norm.weight"], eps)
            gu = torch.cat([linear(w[p + "ffn_gate.weight"], hn), linear(w[p + "ffn_up.weight"], hn)], dim=-1)
            f = linear(w[p + "ffn_down.weight"], gelu_mul(gu))
            x = add_rms_norm(x, f, w[p + "post_ffw_norm.weight"], eps)
            scalar = w.get(p + "layer_output_scale.weight")
            if scalar is not None:
                x = x * scalar
        hidden = rms_norm(x, w["output_norm.weight"], eps)[0]
        return hidden, linear(w["nextn.post_projection.weight"], hidden[None])[0], None

    def draft_token(self, hidden: torch.Tensor) -> int:
        """The greedy draft for ``hidden`` float32 [H]: ``int(self.logits(hidden).argmax())`` (the lowest
        target id among equal best scores), without building the target-vocabulary logits when the head
        is reduced (it scores only the draft vocabulary's rows)."""
        if self.token_map is not None:
            scores = linear(self.head, hidden[None])[0]
            return int(self.token_map[scores == scores.max()].min())
        if self.clustered:  # argmax over the candidates only (the others hold a filler below them all)
            ids, scores = self._candidates(hidden)
            return int(ids[scores == scores.max()].min())
        return int(self.logits(hidden).argmax())
