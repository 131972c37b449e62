"""A Gemma 4 decode or verify step's decoder layers in one C call (``kernels/layers4.h``).

The per-op path (:meth:`~gemmaspec.models.gemma4.Gemma4Model._layer`) makes ~8 products and ~15 more
C helper and PyTorch calls per layer, each a few microseconds of dispatch: at full E2B size (35
layers) that is most of a few-row step's time beside the products themselves. For one sequence of at
most ``SMALL_M`` rows on the CPU with the C kernel, :func:`run_layers4` hands every layer to
``gs_gemma4_layers``, which calls the same C functions in the same order as that per-op path (so the
bits are identical; ``tests/test_decode_step4.py``). What stays in Python: the embedding lookup, the
per-layer inputs (PLE, one [T, layers, ple_dim] buffer the call reads), the final norm, the head and
the logit soft-cap. Mixture-of-experts models keep the per-op path. The layer descriptions (weight
pointers, per activation mode) are built once per model; the KV cache pointers once per cache.

Reference: transformers ``models/gemma4/modeling_gemma4.py`` (``Gemma4TextModel``,
``Gemma4TextDecoderLayer``).
"""

from __future__ import annotations

import ctypes

import torch

from .. import kernels
from ..kernels import SMALL_M, CPUBlockWeight
from .decode_step import _Kind, _plain, _prod, _Prod

P = ctypes.c_void_p


class _Layer4(ctypes.Structure):
    _fields_ = [("attn_norm", P), ("q_norm", P), ("k_norm", P), ("post_attn_norm", P), ("ffn_norm", P),
                ("post_ffn_norm", P), ("ple_norm", P), ("out_scale", ctypes.c_float), ("qkv", _Prod),
                ("o", _Prod), ("gate_up", _Prod), ("down", _Prod), ("ple_gate", _Prod), ("ple_proj", _Prod),
                ("sliding", ctypes.c_int), ("hd", ctypes.c_int), ("hkv", ctypes.c_int), ("F", ctypes.c_int),
                ("kv", ctypes.c_int)]


def _qkv(ly):
    """The layer's attention input product: the fused weight, or a KV-shared layer's q alone."""
    return ly.qkv if ly.qkv is not None else (ly.qkv_parts[0] if ly.kv == 0 else None)


def _fits(model, ly) -> bool:
    """Whether layer ``ly`` has every weight in a form and shape ``gs_gemma4_layers`` reads."""
    c = model.config
    hidden, hq, d, hkv, ple = c.hidden_size, c.num_heads, ly.d, ly.hkv, c.hidden_size_per_layer_input
    mats = [(_qkv(ly), ((hq + ly.kv * hkv) * d, hidden)), (ly.o, (hidden, hq * d)),
            (ly.gate_up, None), (ly.down, None)]
    if ple:
        mats += [(ly.ple_gate, (ple, hidden)), (ly.ple_proj, (hidden, ple))]
    if not all(isinstance(m, CPUBlockWeight) and (shape is None or tuple(m.shape) == shape) for m, shape in mats):
        return False
    f = ly.gate_up.shape[0] // 2
    norms = [ly.attn_norm, ly.q_norm, ly.k_norm, ly.post_attn_norm, ly.ffn_norm, ly.post_ffn_norm]
    norms += [ly.ple_norm] if ple else []
    return (tuple(ly.gate_up.shape) == (2 * f, hidden) and tuple(ly.down.shape) == (hidden, f)
            and all(_plain(t) for t in norms) and (ly.scale is None or _plain(ly.scale))
            and d % 16 == 0 and d <= 1024)


def _layers(model, lib, q8: bool):
    """The ctypes layer array for this model and mode, or None when a layer does not fit the C step.
    Kept on the model."""
    # the products' modes: the step's, and under auto the weights marked auto_q8 (decode_step._prod)
    key = ("_c_layers4_q8" if q8 else "_c_layers4") + ("_auto" if kernels.build._act_mode == "auto" else "")
    got = model.__dict__.get(key, False)
    if got is not False:
        return got
    c, arr = model.config, None
    ple = c.hidden_size_per_layer_input
    if (not c.enable_moe_block and c.hidden_size % 8 == 0 and ple % 8 == 0
            and all(_fits(model, ly) for ly in model.layers)):
        arr = (_Layer4 * len(model.layers))()
        none = _Prod()
        for i, ly in enumerate(model.layers):
            arr[i] = _Layer4(ly.attn_norm.data_ptr(), ly.q_norm.data_ptr(), ly.k_norm.data_ptr(),
                             ly.post_attn_norm.data_ptr(), ly.ffn_norm.data_ptr(), ly.post_ffn_norm.data_ptr(),
                             ly.ple_norm.data_ptr() if ple else None,
                             1.0 if ly.scale is None else float(ly.scale.reshape(-1)[0]),
                             _prod(lib, _qkv(ly), q8), _prod(lib, ly.o, q8), _prod(lib, ly.gate_up, q8),
                             _prod(lib, ly.down, q8), _prod(lib, ly.ple_gate, q8) if ple else none,
                             _prod(lib, ly.ple_proj, q8) if ple else none, int(ly.kind == "sliding"), ly.d,
                             ly.hkv, ly.gate_up.shape[0] // 2, ly.kv)
    model.__dict__[key] = arr
    return arr


def _owners(model) -> list:
    """The stored weights behind the layers' products (kept on the model)."""
    got = model.__dict__.get("_c_owners4")
    if got is None:
        got = [o for ly in model.layers for w in ly.products() if isinstance(w, CPUBlockWeight)
               for o in w._segment_owners()]
        model.__dict__["_c_owners4"] = got
    return got


def _kv(cache, model):
    """The key and value buffers each layer reads (its own, or its KV source's) as 2 * layers pointers,
    kept on the cache (its buffers never move); None when one is missing or not plain float32."""
    got = cache.__dict__.get("_c_kv4")
    if got is None:
        n = len(model.layers)
        if len(cache.layers) != n:
            return None
        got = (P * (2 * n))()
        for i, ly in enumerate(model.layers):
            lk = cache.layers[ly.src]
            if lk is None or not (_plain(lk.k) and _plain(lk.v)) or tuple(lk.k.shape[1:]) != (ly.hkv, ly.d):
                return None
            got[2 * i], got[2 * i + 1] = lk.k.data_ptr(), lk.v.data_ptr()
        cache._c_kv4 = got
    return got


def _kinds(model, cache, plans: dict, rope: dict, t: int):
    """(gs_kind array [full, sliding], the tensors it points into), or None for a plan the call cannot
    follow (keys gathered, a mask of another shape)."""
    kinds = (_Kind * 2)()
    keep = []
    for sliding, kind in ((0, "full"), (1, "sliding")):
        own = next((cache.layers[i] for i, ly in enumerate(model.layers) if ly.kind == kind and ly.kv), None)
        if own is None:
            continue
        plan = plans[kind]
        if plan.mode == "gather":
            return None
        cos, sin = (r.contiguous() for r in rope[kind])
        mask = None if plan.mask is None else plan.mask.contiguous()
        keep += [cos, sin, mask]
        wrap, L = (0, plan.end) if plan.mode == "prefix" else (own.rows, own.rows)  # ring: every ring row
        if mask is not None and tuple(mask.shape) != (t, L):
            return None
        kinds[sliding] = _Kind(cos.data_ptr(), sin.data_ptr(), wrap, L, None if mask is None else mask.data_ptr())
    return kinds, keep


def run_layers4(model, x: torch.Tensor, ple: torch.Tensor | None, cache, start: int, plans: dict,
                rope: dict) -> torch.Tensor | None:
    """x float32 [T, hidden] after every decoder layer of ``model`` (Gemma 4) at positions start.. of
    ``cache``, through one call of ``gs_gemma4_layers``; None where that does not apply (more than
    ``SMALL_M`` rows, no C kernel, autograd, a plan that gathers keys, a mixture-of-experts model,
    weights not in the kernel's formats), and the caller runs its per-op path.

    Args:
        ple: the per-layer inputs float32 [T, layers, ple_dim] (``Gemma4Model._per_layer_inputs``), or
            None for a model without per-layer embeddings.
        plans, rope: the forward's read plans and (cos, sin) float32 [T, head dim] by layer type
            (``"sliding"``/``"full"``).

    The cache rows of the new positions are written (layers with their own K/V); the caller advances
    the cache as usual."""
    t, c = x.shape[0], model.config
    if (t > SMALL_M or x.device.type != "cpu" or torch.is_grad_enabled() or x.dtype != torch.float32
            or c.enable_moe_block):
        return None
    lib = kernels.load_library()
    if lib is None or not hasattr(lib, "gs_gemma4_layers"):
        return None
    q8 = kernels.act_quant() == "q8_0"
    layers = _layers(model, lib, q8)
    if layers is not None and kernels._bg_ready:  # copies regrouped in the background: in use from this step
        kernels.sync_layouts(_owners(model))
    kv = None if layers is None else _kv(cache, model)
    got = None if kv is None else _kinds(model, cache, plans, rope, t)
    if got is None:
        return None
    kinds, keep = got
    if ple is not None:
        ple = ple.contiguous()
        if ple.dtype != torch.float32 or tuple(ple.shape) != (t, len(model.layers), c.hidden_size_per_layer_input):
            return None
    out = x.contiguous().clone()
    rc = lib.gs_gemma4_layers(len(model.layers), ctypes.addressof(layers), ctypes.addressof(kv),
                              ctypes.addressof(kinds), out.data_ptr(), None if ple is None else ple.data_ptr(),
                              c.hidden_size_per_layer_input, t, c.hidden_size, c.num_heads, c.rms_norm_eps, start,
                              kernels.threads(), int(q8))
    del keep
    if rc != 0:
        raise MemoryError("gs_gemma4_layers: out of memory for a decode step's scratch buffers")
    return out
