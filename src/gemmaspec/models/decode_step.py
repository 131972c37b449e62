"""A Gemma 3 decode or verify step's decoder layers in one C call (``kernels/layers.h``).

A step of a few rows spends more time dispatching than computing: ~25 Python and PyTorch calls per
layer (norms, products, RoPE, cache writes, attention, residual adds), each a few microseconds. For one
sequence of at most ``SMALL_M`` rows on the CPU with the C kernel, :func:`run_layers` hands all layers
to ``gs_decode_layers``, which calls the same C functions in the same order as the per-op path of
:mod:`gemmaspec.models.gemma3` (so the bits are identical; ``tests/test_decode_step.py``). The layer
descriptions (weight pointers, per activation mode) are built once per model; the KV cache pointers
once per cache.
"""

from __future__ import annotations

import ctypes

import torch

from .. import kernels
from ..kernels import SMALL_M, CPUBlockWeight

P = ctypes.c_void_p


class _Prod(ctypes.Structure):
    _fields_ = [("nseg", ctypes.c_int), ("fmts", P), ("ws", P), ("ss", P), ("os", P), ("Gs", P), ("Ns", P),
                ("q8", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", P), ("q_norm", P), ("k_norm", P), ("post_attn_norm", P), ("ffn_norm", P),
                ("post_ffn_norm", P), ("qkv", _Prod), ("o", _Prod), ("gate_up", _Prod), ("down", _Prod),
                ("sliding", ctypes.c_int)]


class _Kind(ctypes.Structure):
    _fields_ = [("cos", P), ("sin", P), ("wrap", ctypes.c_int), ("L", ctypes.c_int), ("mask", P)]


def _prod(lib, w: CPUBlockWeight, q8: bool) -> _Prod:
    """Points into the ctypes arrays that ``w.kernel_args`` keeps on the weight (so they stay alive), in
    the step's activation mode (``q8``) or int8 where the weight's own products are (``auto_q8``)."""
    q8 = q8 or w._marked_q8()
    (ns, fmts, ws, ss, os_, gs, n), _, _ = w.kernel_args(lib, q8)
    a = ctypes.addressof
    return _Prod(ns, a(fmts), a(ws), a(ss), a(os_), a(gs), a(n), int(q8))


def _plain(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"


def _layers(model, lib, q8: bool):
    """The ctypes layer array for this model and mode, or None when a layer does not fit the C step."""
    # the products' modes: the step's, and under auto the weights marked auto_q8 (_prod)
    key = ("_c_layers_q8" if q8 else "_c_layers") + ("_auto" if kernels.build._act_mode == "auto" else "")
    got = model.__dict__.get(key, False)
    if got is not False:
        return got
    arr = None
    c = model.config
    ok = all(isinstance(ly.qkv, CPUBlockWeight) and isinstance(ly.gate_up, CPUBlockWeight)
             and isinstance(ly.o, CPUBlockWeight) and isinstance(ly.down, CPUBlockWeight)
             and all(_plain(t) for t in (ly.attn_norm, ly.q_norm, ly.k_norm, ly.post_attn_norm, ly.ffn_norm,
                                         ly.post_ffn_norm))
             for ly in model.layers)
    if ok and c.head_dim % 16 == 0 and c.head_dim <= 1024 and c.hidden_size % 8 == 0:
        arr = (_Layer * len(model.layers))()
        for i, ly in enumerate(model.layers):
            arr[i] = _Layer(ly.attn_norm.data_ptr(), ly.q_norm.data_ptr(), ly.k_norm.data_ptr(),
                            ly.post_attn_norm.data_ptr(), ly.ffn_norm.data_ptr(), ly.post_ffn_norm.data_ptr(),
                            _prod(lib, ly.qkv, q8), _prod(lib, ly.o, q8), _prod(lib, ly.gate_up, q8),
                            _prod(lib, ly.down, q8), int(ly.sliding))
    model.__dict__[key] = arr
    return arr


def _owners(model) -> list:
    """The stored weights behind the layers' products (kept on the model)."""
    got = model.__dict__.get("_c_owners")
    if got is None:
        got = [o for ly in model.layers for w in (ly.qkv, ly.o, ly.gate_up, ly.down) for o in w._segment_owners()]
        model.__dict__["_c_owners"] = got
    return got


def _kv(cache, n_layers: int):
    """Layer l's key and value buffers as 2 * n_layers pointers, kept on the cache (its buffers never move)."""
    got = cache.__dict__.get("_c_kv")
    if got is None:
        got = (P * (2 * n_layers))()
        for i, lk in enumerate(cache.layers):
            if lk is None or not (_plain(lk.k) and _plain(lk.v)):
                return None
            got[2 * i], got[2 * i + 1] = lk.k.data_ptr(), lk.v.data_ptr()
        cache._c_kv = got
    return got


def run_layers(model, x: torch.Tensor, cache, start: int, plans: dict, rope: dict) -> torch.Tensor | None:
    """x float32 [T, hidden] after every decoder layer of ``model`` (Gemma 3) at positions start.. of
    ``cache``, through one call of ``gs_decode_layers``; None where that does not apply (more than
    ``SMALL_M`` rows, no C kernel, autograd, a plan that gathers keys, weights not in the kernel's
    formats), and the caller runs its per-op path. ``plans``/``rope``: the forward's read plans and
    (cos, sin) by ``sliding`` flag. The cache rows of the new positions are written; the caller
    advances the cache as usual."""
    t = x.shape[0]
    if t > SMALL_M or x.device.type != "cpu" or torch.is_grad_enabled() or x.dtype != torch.float32:
        return None
    lib = kernels.load_library()
    if lib is None or not hasattr(lib, "gs_decode_layers"):
        return None
    q8 = kernels.act_quant() == "q8_0"
    layers = _layers(model, lib, q8)
    if layers is not None and kernels._bg_ready:  # copies regrouped in the background: in use from this step
        kernels.sync_layouts(_owners(model))
    kv = None if layers is None else _kv(cache, len(model.layers))
    if kv is None:
        return None
    kinds = (_Kind * 2)()
    keep = []
    for sliding in (False, True):
        plan = plans[sliding]
        if plan.mode == "gather":
            return None
        layer = next((lk for lk, ly in zip(cache.layers, model.layers) if ly.sliding == sliding), None)
        if layer is None:
            continue
        cos, sin = (r.contiguous() for r in rope[sliding])
        mask = None if plan.mask is None else plan.mask.contiguous()
        keep += [cos, sin, mask]
        if plan.mode == "prefix":
            wrap, L = 0, plan.end
        else:  # "ring": the new rows are written into the ring, the queries read every ring row
            wrap, L = layer.rows, layer.rows
        if mask is not None and tuple(mask.shape) != (t, L):
            return None
        kinds[int(sliding)] = _Kind(cos.data_ptr(), sin.data_ptr(), wrap, L, None if mask is None else mask.data_ptr())
    c = model.config
    out = x.contiguous().clone()
    rc = lib.gs_decode_layers(len(model.layers), ctypes.addressof(layers), ctypes.addressof(kv), ctypes.addressof(kinds),
                              out.data_ptr(), t, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                              c.intermediate_size, c.rms_norm_eps, model.attn_scale, start, kernels.threads(), int(q8))
    if rc != 0:
        raise MemoryError("gs_decode_layers: out of memory for a decode step's scratch buffers")
    return out
