"""The contract every model file implements, and the small ops they share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

import contextlib
import ctypes

from ..kernels import SMALL_M, BlockWeight, load_library, ops_on_one_thread, threads
from ..kv_cache import KVCache, ReadPlan

@dataclass
class ForwardOutput:
    """What one forward returns.

    Attributes:
        logits: float32 [T', vocab]; T' = 1 (last position) or T (every position), per the call.
        hidden: float32 [T, hidden_size], the hidden state after the final norm (what an MTP
            drafter reads).
    """

    logits: torch.Tensor
    hidden: torch.Tensor


class CausalLM(Protocol):
    """A decoder-only language model over one sequence with a KV cache."""

    config: object

    def new_cache(self, capacity: int, max_rollback: int = 16) -> KVCache: ...

    def forward(self, tokens: torch.Tensor, cache: KVCache, all_logits: bool = False) -> ForwardOutput:
        """Run tokens int64 [T] at positions cache.length .. cache.length+T-1, append them to the
        cache, and return logits for the last position (or all with ``all_logits``)."""
        ...

    # Optional: ``forward_batch(seqs, all_logits) -> list[ForwardOutput]`` runs several
    # ``(tokens, cache)`` sequences in one forward, each output bit-identical to its solo forward
    # (Gemma 3 has it). The server batches slots through it and runs slots one forward at a time
    # for a model without it.


FEW_ROWS = 64  # a forward of at most this many rows runs PyTorch's ops on one thread

MAX_ROLLBACK = 16
"""Tokens a KV cache can take back after a verify forward (the engine's default): the rows of the largest
verify forward, ``MAX_DRAFT_TOKENS`` + 1."""
PREFILL_CHUNK = 256
"""Most tokens one forward runs when a prompt (or any run of known tokens) goes through a model: the
engine's prefill and a draft model's catch-up both run in chunks of this many, which bounds one
forward's activations (``[PREFILL_CHUNK, hidden]`` and the attention scores) whatever the prompt's
length."""


def step_threads(rows: int):
    """The thread context for a forward of ``rows`` token rows: at most ``FEW_ROWS`` (decode, verify,
    a batch of slots) → :func:`~gemmaspec.kernels.ops_on_one_thread` (the weight products keep every
    thread, the small PyTorch ops run on one); more (a prefill chunk) → unchanged."""
    return ops_on_one_thread() if rows <= FEW_ROWS else contextlib.nullcontext()


def linear(w, x: torch.Tensor) -> torch.Tensor:
    """x float32 [..., K] @ W.T for a block-quantized weight (:class:`~gemmaspec.kernels.BlockWeight`) or a dense float32 [N, K] tensor."""
    if isinstance(w, BlockWeight):
        return w(x)
    return torch.nn.functional.linear(x, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, float32 [..., D] → float32 [..., D]
    (weight float32 [D], or None: no scale). On the CPU with the C kernel and no autograd, one call of
    ``gs_rms_norm`` (qmatmul.c; D a multiple of 8); else ``torch.nn.functional.rms_norm``."""
    d = x.shape[-1]
    lib = load_library() if x.device.type == "cpu" and x.dtype == torch.float32 and d % 8 == 0 else None
    plain_w = weight is None or (weight.dtype == torch.float32 and weight.is_contiguous() and weight.device == x.device
                                 and not weight.requires_grad)
    if lib is None or not plain_w or (x.requires_grad and torch.is_grad_enabled()):
        return torch.nn.functional.rms_norm(x, (d,), weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.gs_rms_norm(x.data_ptr(), None if weight is None else weight.data_ptr(), x.numel() // d, d, eps,
                    out.data_ptr())
    return out


def norm_rope(x: torch.Tensor, heads_first: int, heads_rest: int, d: int, w_first: torch.Tensor,
              w_rest: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm then rotate-half RoPE for the query and key heads of a fused projection.

    Args:
        x: float32 [T, >= (heads_first + heads_rest) * d]: each row starts with heads_first heads of d
            values (the queries), then heads_rest (the keys); more columns (the values) are left alone.
        w_first, w_rest: float32 [d], the norm weights of the first heads and of the rest.
        cos, sin: float32 [T, d] (:func:`rope_cos_sin`).

    Returns:
        float32 [T, heads_first + heads_rest, d]: ``apply_rope(rms_norm(head, w), cos, sin)`` for each
        head. On the CPU with the C kernel, one call of ``gs_norm_rope`` (qmatmul.c; the same operations
        as the PyTorch ops, row by row); else those ops.
    """
    t, heads = x.shape[0], heads_first + heads_rest
    lib = load_library() if x.device.type == "cpu" and d % 8 == 0 and d <= 1024 else None
    plain = all(a.dtype == torch.float32 and a.is_contiguous() and not a.requires_grad
                for a in (w_first, w_rest, cos, sin)) and x.dtype == torch.float32 and x.stride(-1) == 1
    if lib is None or not plain or (x.requires_grad and torch.is_grad_enabled()):
        q = rms_norm(x[:, :heads_first * d].reshape(t, heads_first, d), w_first, eps)
        k = rms_norm(x[:, heads_first * d:heads * d].reshape(t, heads_rest, d), w_rest, eps)
        return torch.cat([apply_rope(q, cos, sin), apply_rope(k, cos, sin)], dim=1)
    out = torch.empty(t, heads, d, dtype=torch.float32)
    lib.gs_norm_rope(x.data_ptr(), x.stride(0), t, heads, d, w_first.data_ptr(), heads_first, w_rest.data_ptr(),
                     cos.data_ptr(), sin.data_ptr(), eps, out.data_ptr())
    return out


_ROPE_TABLE_ROWS = 8192  # positions below this come from a per-(shape, theta) table; above, computed
_rope_tables: dict = {}


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: float = 1.0,
                 rotary_dim: int | None = None):
    """cos/sin float32 [T, head_dim] for rotate-half RoPE (transformers ``rotate_half`` layout), for
    positions int64 [T].

    ``rotary_dim`` < head_dim rotates only the first frequencies ("proportional" partial RoPE,
    Gemma 4 global layers): the remaining frequencies get cos 1, sin 0.

    On the CPU, positions below ``_ROPE_TABLE_ROWS`` are looked up in a table of the same formula
    over every position up to a power of two (built on first need, grown by doubling): the same bits
    as computing them (each element is one float multiply and one vectorized cos/sin either way), in
    ~10 us instead of ~100 us per call — twice per decode step.
    """
    if positions.device.type == "cpu" and positions.numel():
        hi = int(positions.max())
        if 0 <= int(positions.min()) and hi < _ROPE_TABLE_ROWS:
            key = (head_dim, float(theta), float(scaling), rotary_dim)
            table = _rope_tables.get(key)
            if table is None or table[0].shape[0] <= hi:
                n = 256
                while n <= hi:
                    n *= 2
                table = _rope_compute(torch.arange(n), head_dim, theta, scaling, rotary_dim)
                _rope_tables[key] = table
            return table[0].index_select(0, positions), table[1].index_select(0, positions)
    return _rope_compute(positions, head_dim, theta, scaling, rotary_dim)


def rope_span(start: int, t: int, head_dim: int, theta: float, scaling: float = 1.0,
              rotary_dim: int | None = None):
    """:func:`rope_cos_sin` of positions ``start .. start + t - 1``: on the CPU, views of the table's rows
    (no tensor op beyond the slice, which a decode step pays twice), else computed."""
    key = (head_dim, float(theta), float(scaling), rotary_dim)
    table = _rope_tables.get(key)
    if table is not None and 0 <= start and start + t <= table[0].shape[0]:
        return table[0][start:start + t], table[1][start:start + t]
    return rope_cos_sin(torch.arange(start, start + t), head_dim, theta, scaling, rotary_dim)


def _rope_compute(positions, head_dim, theta, scaling, rotary_dim):
    rdim = head_dim if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, rdim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    if rdim < head_dim:
        pad = torch.zeros(head_dim // 2 - rdim // 2, device=positions.device)
        inv_freq = torch.cat([inv_freq, pad])
    inv_freq = inv_freq / scaling
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None = None) -> torch.Tensor:
    """Grouped-query attention for one sequence.

    Args:
        q: float32 [T, H, D]; k, v: float32 [L, Hkv, D] (H a multiple of Hkv).
        mask: bool [T, L], True where a query may attend a key; None: every key is visible.
        scale: multiplies q·k.

    Returns:
        float32 [T, H, D]. On the CPU with the C kernel, query rows go through ``gs_attention_mt``
        (``kernels/stepops.h``: blocks of 256 keys on the kernel's threads, each K/V head read once for
        the query heads sharing it, every order fixed, so a row's bits depend neither on the other rows
        nor on the thread count), at most ``SMALL_M`` per call: a prefill's rows get the bits a decode
        or verify step gives the same positions (with products that are batch-invariant too, a cached
        prompt's last position then equals a fresh one's). Autograd and other devices use PyTorch's
        ops below. Both compute softmax(q k^T * scale) v in float32; they differ by float rounding.
    """
    t, h, d = q.shape
    hkv = k.shape[1]
    if t > SMALL_M and q.device.type == "cpu" and not torch.is_grad_enabled():
        parts = []
        for i in range(0, t, SMALL_M):
            part = _attention_c(q[i:i + SMALL_M], k, v, None if mask is None else mask[i:i + SMALL_M], scale, softcap)
            if part is None:
                break
            parts.append(part)
        else:
            return torch.cat(parts)
    out = _attention_c(q, k, v, mask, scale, softcap)
    if out is not None:
        return out
    g = h // hkv
    # [Hkv, g*T, D]: the query heads that share a K/V head ride in one matmul
    qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * t, d)
    scores = torch.matmul(qg, k.permute(1, 2, 0)) * scale  # [Hkv, g*T, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.view(hkv, g, t, -1).masked_fill(~mask, float("-inf")).view(hkv, g * t, -1)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(1, 0, 2))  # [Hkv, g*T, D]
    return out.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, h, d)


def _c_query_ok(q: torch.Tensor) -> bool:
    """Whether query rows q [T, H, D] suit ``gs_attention`` (CPU float32, D a multiple of 16, heads
    packed in a row, no gradient wanted)."""
    d = q.shape[2]
    return (q.device.type == "cpu" and d % 16 == 0 and q.dtype == torch.float32 and q.stride(2) == 1
            and q.stride(1) == d and not (torch.is_grad_enabled() and q.requires_grad))


def _c_keys_ok(t: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether t query rows against keys k, values v [L, Hkv, D] and ``mask`` suit ``gs_attention``:
    1..``SMALL_M`` rows, contiguous float32 keys and values of one shape, a bool [t, L] mask or none."""
    return (0 < t <= SMALL_M and k.dtype == torch.float32 and v.dtype == torch.float32 and k.is_contiguous()
            and v.is_contiguous() and v.shape == k.shape
            and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))
            and (mask is None or (mask.dtype == torch.bool and tuple(mask.shape) == (t, k.shape[0]))))


def _attention_c(q, k, v, mask, scale, softcap):
    """:func:`attention` through ``gs_attention``, or None where that does not apply."""
    t, h, d = q.shape
    if not _c_query_ok(q) or not _c_keys_ok(t, k, v, mask):
        return None
    lib = load_library()
    if lib is None:
        return None
    mask = None if mask is None else mask.contiguous()
    out = torch.empty(t, h, d, dtype=torch.float32)
    rc = lib.gs_attention_mt(q.data_ptr(), q.stride(0), t, h, k.shape[1], d, k.data_ptr(), v.data_ptr(), k.shape[0],
                             None if mask is None else mask.data_ptr(), scale, softcap or 0.0, out.data_ptr(),
                             threads())
    return out if rc == 0 else None


def attention_seqs(q: torch.Tensor, bounds: list[int], kvs: list, scale: float) -> torch.Tensor:
    """:func:`attention` for several sequences of one batched forward, each against its own cache.

    Args:
        q: float32 [N, H, D], sequence j's query rows at ``bounds[j]:bounds[j + 1]``.
        bounds: N row offsets, ``len(kvs) + 1`` of them, from 0.
        kvs: per sequence ``(keys, values, mask)``, as :func:`attention`'s k, v, mask.
        scale: multiplies q·k.

    Returns:
        float32 [N, H, D], each sequence's rows bit for bit what :func:`attention` gives them alone. On
        the CPU with the C kernel, one call of ``gs_attention_seqs`` (``kernels/stepops.h``) runs every
        sequence on the kernel's threads where each of them would have taken the C path alone (an
        8-slot decode forward of the default model: 18 calls instead of 144, its attention 8.2 -> 4.3 ms
        under cProfile on a 2-core Zen 4); otherwise one :func:`attention` per sequence.
    """
    out = _attention_seqs_c(q, bounds, kvs, scale)
    if out is not None:
        return out
    return torch.cat([attention(q[bounds[j]:bounds[j + 1]], k, v, mask, scale) for j, (k, v, mask) in enumerate(kvs)])


def _attention_seqs_c(q, bounds, kvs, scale):
    """:func:`attention_seqs` in one ``gs_attention_seqs`` call, or None where a sequence would not take
    the C path alone (:func:`_attention_c`'s conditions)."""
    n, h, d = q.shape
    hkv = kvs[0][0].shape[1]
    if not _c_query_ok(q) or any(k.shape[1] != hkv or not _c_keys_ok(bounds[j + 1] - bounds[j], k, v, mask)
                                 for j, (k, v, mask) in enumerate(kvs)):
        return None
    lib = load_library()
    if lib is None:
        return None
    masks = [None if mask is None else mask.contiguous() for _, _, mask in kvs]  # alive through the call
    out = torch.empty(n, h, d, dtype=torch.float32)
    s, ld, row = len(kvs), q.stride(0), h * d
    P, I = ctypes.c_void_p * s, ctypes.c_int * s
    base_q, base_o = q.data_ptr(), out.data_ptr()
    rc = lib.gs_attention_seqs(s, P(*[base_q + 4 * ld * a for a in bounds[:-1]]), ld,
                               I(*[b - a for a, b in zip(bounds, bounds[1:])]), h, hkv, d,
                               P(*[k.data_ptr() for k, _, _ in kvs]), P(*[v.data_ptr() for _, v, _ in kvs]),
                               I(*[k.shape[0] for k, _, _ in kvs]),
                               P(*[None if m is None else m.data_ptr() for m in masks]), scale, 0.0, P(*[base_o + 4 * row * a for a in bounds[:-1]]), threads())
    return out if rc == 0 else None


def gelu_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for x float32 [T, 2F] = [gate | up] (Gemma's MLP) → float32 [T, F]. On the
    CPU with the C kernel: one call of ``gs_gelu_mul`` (``kernels/stepops.h``; element-wise, so any
    number of rows, each row's bits its own); else PyTorch's ``gelu(approximate="tanh") * up`` (the
    same formula, different float rounding)."""
    t, f2 = x.shape
    f = f2 // 2
    lib = load_library() if (x.device.type == "cpu" and x.dtype == torch.float32
                             and x.stride(1) == 1 and not (x.requires_grad and torch.is_grad_enabled())) else None
    if lib is None:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    out = torch.empty(t, f, dtype=torch.float32)
    lib.gs_gelu_mul(x.data_ptr(), x.stride(0), t, f, out.data_ptr())
    return out


def gelu_mul_by(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(g) * u for g, u float32 [T, F] (u may be a strided view, e.g. one layer's column of
    Gemma 4's per-layer inputs [T, layers, F]) → float32 [T, F]. On the CPU with the C kernel: one call
    of ``gs_gelu_mul2`` (``kernels/layers4.h``; :func:`gelu_mul`'s arithmetic, row by row); else
    PyTorch's ``gelu(approximate="tanh") * u``."""
    t, f = g.shape
    ok = (g.device.type == "cpu" and u.device.type == "cpu" and g.dtype == u.dtype == torch.float32
          and tuple(u.shape) == (t, f) and g.stride(1) == 1 and u.stride(1) == 1
          and not (torch.is_grad_enabled() and (g.requires_grad or u.requires_grad)))
    lib = load_library() if ok else None
    if lib is None:
        return torch.nn.functional.gelu(g, approximate="tanh") * u
    out = torch.empty(t, f, dtype=torch.float32)
    lib.gs_gelu_mul2(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), t, f, out.data_ptr())
    return out


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x + :func:`rms_norm` (a, weight, eps), float32 [..., D] (the residual add after Gemma's post-norms):
    one call of ``gs_add_rms_norm`` on the CPU with the C kernel, the same bits as the two ops."""
    d = a.shape[-1]
    lib = load_library() if (a.device.type == "cpu" and a.dtype == torch.float32 and x.dtype == torch.float32
                             and d % 8 == 0 and x.shape == a.shape) else None
    plain_w = weight is None or (weight.dtype == torch.float32 and weight.is_contiguous() and weight.device == a.device
                                 and not weight.requires_grad)
    if lib is None or not plain_w or (torch.is_grad_enabled() and (a.requires_grad or x.requires_grad)):
        return x + rms_norm(a, weight, eps)
    a, x = a.contiguous(), x.contiguous()
    out = torch.empty_like(x)
    lib.gs_add_rms_norm(a.data_ptr(), None if weight is None else weight.data_ptr(), a.numel() // d, d, eps,
                        x.data_ptr(), out.data_ptr())
    return out


def open_images(plan: ReadPlan, start: int, t: int, images, window: int | None, cache) -> ReadPlan:
    """``plan`` with each image's rows allowed to see each other's keys (bidirectional within an
    image, still within ``window``; Gemma 3 on every layer, Gemma 4 on sliding layers). ``images``:
    ``[(row, embeddings [n, hidden])]`` of this forward's ``t`` rows starting at position ``start``. The new keys' columns: ``start + r`` (prefix), the last ``t``
    (gather), ``(start + r) % ring rows`` (ring)."""
    dev = cache.device
    rows = torch.arange(t, device=dev)
    if plan.mode == "prefix":
        cols, width = start + rows, plan.end
    elif plan.mode == "gather":
        width = plan.mask.shape[1]
        cols = width - t + rows
    else:
        width = plan.mask.shape[1]
        cols = (start + rows) % cache.ring_rows
    mask = (plan.mask.clone() if plan.mask is not None
            else torch.tril(torch.ones(t, width, dtype=torch.bool, device=dev), start))
    for row, emb in images:
        r = torch.arange(row, row + emb.shape[0], device=dev)
        ok = torch.ones(len(r), len(r), dtype=torch.bool, device=dev)
        if window is not None:
            ok = (r[:, None] - r[None, :]) < window
        at = (r[:, None], cols[r][None, :])
        mask[at] = mask[at] | ok
    return ReadPlan(plan.mode, plan.end, plan.old_idx, mask)
