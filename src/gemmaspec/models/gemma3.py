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

import itertools
import math

import gguf
import torch
import torch.nn.functional as F

from .config import Gemma3Config
from .decode_step import run_layers
from ..kernels import SMALL_M, BlockWeight, StackedWeight
from ..kv_cache import KVCache
from .base import (ForwardOutput, add_rms_norm, apply_rope, attention, attention_seqs, gelu_mul, linear, norm_rope,
                   open_images, rms_norm, rope_cos_sin, rope_span, step_threads)


def _fuse(parts):
    """The weights ``parts`` (same K) side by side along N, so one kernel call computes them all
    (:class:`~gemmaspec.kernels.StackedWeight`: no copy, each keeps its format); None when they are not
    all block-quantized on one device."""
    if not all(isinstance(p, BlockWeight) for p in parts):
        return None
    try:
        return StackedWeight(parts)
    except ValueError:
        return None


_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


def hf_to_gguf_name(name: str, n_layers: int) -> str | None:
    """A Gemma 3 transformers tensor name (text model, or the text part of a multimodal checkpoint)
    → llama.cpp's GGUF name through ``gguf.TensorNameMap``; None for tensors the text model does not
    use (vision tower, projector)."""
    if name != "lm_head.weight":
        for prefix in _HF_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
                break
        else:
            return None
    base, _, suffix = name.rpartition(".")
    mapped = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, n_layers).get_name(base)
    return f"{mapped}.{suffix}" if mapped else None


def hf_to_gguf_value(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """transformers' Gemma 3 RMSNorm multiplies by ``1 + weight``; GGUF files (llama.cpp's converter)
    store ``weight + 1``, which is what this model uses. Other tensors are unchanged."""
    return tensor + 1.0 if name.endswith("norm.weight") else tensor


_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                  "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")


def required_tensors(config: Gemma3Config) -> list[str]:
    """GGUF names of the tensors a Gemma 3 text model needs (``output.weight`` is optional: tied head)."""
    return ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{n}.weight" for i in range(config.num_layers) for n in _LAYER_TENSORS]


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
    """Gemma 3 decoder over one sequence (:meth:`forward`) or several at once (:meth:`forward_batch`).

    Args:
        config: the model's :class:`Gemma3Config`.
        weights: GGUF tensor name → float32 tensor (norms, dense matrices) or
            :class:`QuantizedWeight` (block-quantized matrices), already on ``device``.
        device: torch device the weights live on.

    Raises:
        KeyError: a tensor the architecture needs is missing; ValueError: the embedding's shape
            disagrees with the config (the loader turns both into a
            :class:`~gemmaspec.errors.ModelFileError`).
    """

    def __init__(self, config: Gemma3Config, weights: dict, device: torch.device | str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        self.weights = weights
        missing = [n for n in required_tensors(config) if n not in weights]
        if missing:
            raise KeyError(missing[0])
        emb = weights["token_embd.weight"]
        if tuple(emb.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"token_embd has shape {tuple(emb.shape)}, expected "
                             f"({config.vocab_size}, {config.hidden_size}) from the metadata")
        self.embed = emb
        self.head = weights.get("output.weight", self.embed)
        self.final_norm = weights["output_norm.weight"]
        self.layers = [_Layer(weights, i, config) for i in range(config.num_layers)]
        self.embed_scale = torch.tensor(math.sqrt(config.hidden_size), dtype=torch.float32)
        self.attn_scale = config.query_pre_attn_scalar ** -0.5

    def to(self, device) -> "Gemma3Model":
        """The same model with every weight on ``device``."""
        return Gemma3Model(self.config, {k: v.to(device) for k, v in self.weights.items()}, device)

    def embed_row(self, token: int) -> torch.Tensor:
        """The scaled input embedding of one token, float32 [hidden] (what an MTP assistant reads)."""
        return self.embed_rows([token])[0]

    def embed_rows(self, tokens: list[int]) -> torch.Tensor:
        """:meth:`embed_row` of each token, float32 [len(tokens), hidden], in one lookup (each row
        unpacked and scaled on its own: the same values)."""
        return self.embed_tokens(torch.tensor(tokens, dtype=torch.int64, device=self.device))

    def kv_layout(self) -> dict:
        """Per layer type, the cache layer an MTP assistant reads: ``{"sliding"|"full": (layer index,
        KV heads, head dim)}``, the last layer of that type."""
        c = self.config
        return {t: (i, c.num_kv_heads, c.head_dim) for i, t in enumerate(c.layer_types)}

    def new_cache(self, capacity: int, max_rollback: int = 16, ring: bool = True) -> KVCache:
        """An empty KV cache for up to ``capacity`` positions (see :class:`KVCache`); ``ring=False``
        keeps every position of the sliding-window layers too (row = position; drafter training reads
        them by position)."""
        c = self.config
        windows = [c.sliding_window if t == "sliding" and ring else None for t in c.layer_types]
        return KVCache(windows, capacity, c.num_kv_heads, c.head_dim, max_rollback, device=self.device)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64 [T] → float32 [T, hidden] (scaled by sqrt(hidden))."""
        e = self.embed.rows(tokens) if isinstance(self.embed, BlockWeight) else self.embed[tokens]
        return e * self.embed_scale

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, all_logits: bool = False,
                images: list | None = None) -> ForwardOutput:
        """Run ``tokens`` int64 [T] at positions cache.length.., append them to ``cache``.

        ``images``: ``[(row, embeddings float32 [n, hidden])]``: rows ``row .. row + n - 1`` of this
        forward take those embeddings instead of their tokens' (unscaled, as transformers'
        ``masked_scatter``), and attend to each other in both directions (transformers'
        ``token_type_ids`` block mask; within the sliding window on sliding layers). Each image must lie
        wholly in one forward.

        Returns:
            :class:`ForwardOutput`: logits float32 [1 or T, vocab]; hidden float32 [T, hidden]
            (after the final norm).

        Raises:
            ValueError: the tokens would run past the cache's capacity.
        """
        with step_threads(tokens.shape[0]):
            return self._run([(tokens, cache)], [all_logits], split_rows=False, images=images or None)[0]

    @torch.inference_mode()
    def forward_batch(self, seqs, all_logits=False) -> list[ForwardOutput]:
        """Run several sequences in one forward: every row of every sequence goes through the
        embedding, norms, projections and MLP together; attention runs per sequence against its
        own cache. Each sequence's output is bit-identical to :meth:`forward` on it alone (the
        quantized kernel is batch-invariant, products are fed to it at most ``SMALL_M`` rows at a
        time, and every other op works row by row), which is what lets a server batch users
        without changing anyone's tokens.

        Args:
            seqs: list of ``(tokens int64 [T_i], cache)``; distinct caches, each T_i ≤ ``SMALL_M``
                for exact results (longer ones are correct but run like a prefill).
            all_logits: one bool for all, or one per sequence (as :meth:`forward`'s).

        Returns:
            one :class:`ForwardOutput` per sequence, in order.

        Raises:
            ValueError: a sequence would run past its cache's capacity, or a cache appears twice.
        """
        flags = [all_logits] * len(seqs) if isinstance(all_logits, bool) else list(all_logits)
        if len(flags) != len(seqs):
            raise ValueError(f"{len(flags)} all_logits flags for {len(seqs)} sequences")
        if len({id(cache) for _, cache in seqs}) != len(seqs):
            raise ValueError("forward_batch needs a distinct cache per sequence")
        with step_threads(sum(tok.shape[0] for tok, _ in seqs)):
            return self._run(seqs, flags, split_rows=True) if seqs else []

    def _run(self, seqs, flags, split_rows: bool, images=None) -> list[ForwardOutput]:
        c = self.config
        starts, bounds = [], [0]
        for tokens, cache in seqs:
            t, start = tokens.shape[0], cache.length
            if start + t > cache.capacity:
                raise ValueError(f"{start + t} positions exceed the context size {cache.capacity}")
            starts.append(start)
            bounds.append(bounds[-1] + t)
        single = len(seqs) == 1
        tokens = seqs[0][0] if single else torch.cat([tok for tok, _ in seqs])
        n = bounds[-1]
        if single and self.device.type == "cpu":  # rows of the RoPE table (views)
            rope = {
                True: rope_span(starts[0], n, c.head_dim, c.rope_theta_local),
                False: rope_span(starts[0], n, c.head_dim, c.rope_theta_global, c.rope_scaling_factor),
            }
        else:
            pos = torch.cat([torch.arange(s, s + tok.shape[0], device=self.device) for s, (tok, _) in zip(starts, seqs)])
            rope = {
                True: rope_cos_sin(pos, c.head_dim, c.rope_theta_local),
                False: rope_cos_sin(pos, c.head_dim, c.rope_theta_global, c.rope_scaling_factor),
            }
        lin = (lambda w, x: _linear_rows(w, x, bounds)) if split_rows else linear
        h_q, h_kv, d = c.num_heads, c.num_kv_heads, c.head_dim
        eps = c.rms_norm_eps
        x = self.embed_tokens(tokens)
        plans = [{True: cache.plan(s, tok.shape[0], c.sliding_window), False: cache.plan(s, tok.shape[0], None)}
                 for s, (tok, cache) in zip(starts, seqs)]
        if images:
            x = x.clone()
            for row, emb in images:
                x[row:row + emb.shape[0]] = emb.to(x.dtype)
            cache0, t0 = seqs[0][1], n
            plans = [{kind: open_images(plan, starts[0], t0, images, c.sliding_window if kind else None, cache0)
                      for kind, plan in plans[0].items()}]
        fast = run_layers(self, x, seqs[0][1], starts[0], plans[0], rope) if single and not images else None
        for li, layer in enumerate(self.layers if fast is None else []):
            h = rms_norm(x, layer.attn_norm, eps)
            cos, sin = rope[layer.sliding]
            if layer.qkv is not None:
                qkv = lin(layer.qkv, h)
                qk = norm_rope(qkv, h_q, h_kv, d, layer.q_norm, layer.k_norm, cos, sin, eps)
                q, k, v = qk[:, :h_q], qk[:, h_q:], qkv[:, (h_q + h_kv) * d:].reshape(n, h_kv, d)
            else:
                q, k, v = lin(layer.q, h), lin(layer.k, h), lin(layer.v, h)
                q = apply_rope(rms_norm(q.reshape(n, h_q, d), layer.q_norm, eps), cos, sin)
                k = apply_rope(rms_norm(k.reshape(n, h_kv, d), layer.k_norm, eps), cos, sin)
                v = v.reshape(n, h_kv, d)
            kvs = []
            for j, (_, cache) in enumerate(seqs):
                a0, a1 = bounds[j], bounds[j + 1]
                plan = plans[j][layer.sliding]
                kvs.append((*cache.layers[li].update(plan, starts[j], k[a0:a1], v[a0:a1]), plan.mask))
            if single:
                a = attention(q, *kvs[0], self.attn_scale)
            else:  # one call for every sequence, each against its own cache (bits as alone)
                a = attention_seqs(q, bounds, kvs, self.attn_scale)
            a = lin(layer.o, a.reshape(n, h_q * d))
            x = add_rms_norm(x, a, layer.post_attn_norm, eps)
            h = rms_norm(x, layer.ffn_norm, eps)
            if layer.gate_up is not None:
                f = lin(layer.down, gelu_mul(lin(layer.gate_up, h)))
            else:
                f = lin(layer.down, F.gelu(lin(layer.gate, h), approximate="tanh") * lin(layer.up, h))
            x = add_rms_norm(x, f, layer.post_ffn_norm, eps)
        if fast is not None:
            x = fast
        for s, (tok, cache) in zip(starts, seqs):
            cache.advance(s, tok.shape[0])
        hidden = rms_norm(x, self.final_norm, eps)
        if single:
            rows, counts = (hidden if flags[0] else hidden[-1:]), [n if flags[0] else 1]
        else:
            idx = [list(range(bounds[j], bounds[j + 1])) if flags[j] else [bounds[j + 1] - 1] for j in range(len(seqs))]
            counts = [len(i) for i in idx]
            rows = hidden[torch.tensor([i for ix in idx for i in ix], device=hidden.device)]
        if split_rows:  # each sequence's logits rows as its own forward computes them
            logits = _linear_rows(self.head, rows, [0, *itertools.accumulate(counts)])
        else:
            logits = linear(self.head, rows)
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        if single:
            return [ForwardOutput(logits=logits, hidden=hidden)]
        outs, at = [], 0
        for j, m in enumerate(counts):
            outs.append(ForwardOutput(logits=logits[at:at + m], hidden=hidden[bounds[j]:bounds[j + 1]]))
            at += m
        return outs


def _linear_rows(w, x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """:func:`linear` over the rows of several sequences (sequence j's rows are ``bounds[j]:bounds[j + 1]``),
    each row computed as that sequence's own forward computes it: a sequence of more than ``SMALL_M``
    rows (a prefill chunk) in a product of its own, as :meth:`Gemma3Model.forward` does; the rows of the
    shorter ones (decode, verify) at most ``SMALL_M`` at a time through the batch-invariant C kernel (a
    weight whose products multiply int8 activations: all rows in one call, the kernel's bits for any
    number of rows). So a request's output never depends on what shared its batch, in any activation
    mode."""
    if not isinstance(w, BlockWeight) or x.shape[0] <= SMALL_M or getattr(w, "_q8", bool)():
        return linear(w, x)  # (int8 activations: one kernel for any number of rows, batch-invariant)
    parts, run = [], bounds[0]  # run: the first row of the short sequences not yet multiplied

    def flush(end: int) -> None:
        parts.extend(linear(w, x[i:min(i + SMALL_M, end)]) for i in range(run, end, SMALL_M))

    for a0, a1 in zip(bounds, bounds[1:]):
        if a1 - a0 > SMALL_M:
            flush(a0)
            parts.append(linear(w, x[a0:a1]))
            run = a1
    flush(bounds[-1])
    return torch.cat(parts)
