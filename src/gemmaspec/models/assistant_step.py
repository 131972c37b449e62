"""An MTP assistant's draft step in one C call (``kernels/assistant.h``).

A draft step of the 4-layer assistant computes little (a few 256-wide products) and dispatches a lot:
~40 Python and PyTorch calls per layer, ~1.5 ms of a ~1.9 ms step on a 2-core AMD EPYC (Zen 4). On
the CPU with the C kernel, when every matrix is block-quantized (the GGUF formats the kernel reads),
:func:`run_step` hands the whole step to ``gs_assistant_step``, which calls the same C functions in
the same order as the per-op path of :meth:`~gemmaspec.models.gemma4_assistant.Gemma4Assistant.step`
(so the bits are identical; ``tests/test_assistant_step.py``). The weight descriptions are built once
per assistant and activation mode.
"""

from __future__ import annotations

import ctypes

import torch

from .. import kernels
from ..kernels import CPUBlockWeight, StackedWeight
from .decode_step import _plain, _prod, _Prod

P = ctypes.c_void_p


class _ALayer(ctypes.Structure):
    _fields_ = [("attn_norm", P), ("q_norm", P), ("post_attn_norm", P), ("ffn_norm", P), ("post_ffn_norm", P),
                ("out_scale", ctypes.c_float), ("q", _Prod), ("o", _Prod), ("gate_up", _Prod), ("down", _Prod),
                ("hd", ctypes.c_int), ("k", P), ("v", P), ("L", ctypes.c_int), ("mask", P), ("cos", P), ("sin", P)]


_MATS = ("attn_q", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_NORMS = ("attn_norm", "attn_q_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")


def _static(assistant, lib, q8: bool):
    """(layer array with the weights filled in, pre-projection, post-projection, reduced head or None,
    the per-layer gate and up :class:`~gemmaspec.kernels.StackedWeight` the layer array points into) for
    this assistant and mode, or None when a weight is not in a form the C step reads. Kept on the
    assistant."""
    # the products' modes: the step's, and under auto the weights marked auto_q8 (decode_step._prod)
    key = ("_c_step_q8" if q8 else "_c_step") + ("_auto" if kernels.build._act_mode == "auto" else "")
    got = assistant.__dict__.get(key, False)
    if got is not False:
        return got
    w, c = assistant.weights, assistant.config
    pre, post = w["nextn.pre_projection.weight"], w["nextn.post_projection.weight"]
    ok = isinstance(pre, CPUBlockWeight) and isinstance(post, CPUBlockWeight) and _plain(w["output_norm.weight"])
    for i in range(c.num_layers):
        p = f"blk.{i}."
        ok = ok and all(isinstance(w[p + m + ".weight"], CPUBlockWeight) for m in _MATS)
        ok = ok and all(_plain(w[p + n + ".weight"]) for n in _NORMS)
        d, f, hq, hd = c.layer_head_dim(i), c.intermediate_size, c.num_heads, c.hidden_size
        ok = ok and d % 16 == 0 and d <= 1024 and all(
            tuple(w[p + m + ".weight"].shape) == shape for m, shape in
            (("attn_q", (hq * d, hd)), ("attn_output", (hd, hq * d)), ("ffn_gate", (f, hd)), ("ffn_up", (f, hd)),
             ("ffn_down", (hd, f)))) if ok else False
    ok = ok and c.hidden_size % 8 == 0 and assistant.backbone_hidden_size % 8 == 0
    got = None
    if ok:
        try:  # gate and up in one product call (the target's layers stack theirs the same way)
            gate_up = [StackedWeight([w[f"blk.{i}.ffn_gate.weight"], w[f"blk.{i}.ffn_up.weight"]])
                       for i in range(c.num_layers)]
        except ValueError:
            ok = False
    if ok:
        arr = (_ALayer * c.num_layers)()
        for i in range(c.num_layers):
            p = f"blk.{i}."
            scale = w.get(p + "layer_output_scale.weight")
            arr[i] = _ALayer(*(w[p + n + ".weight"].data_ptr() for n in _NORMS),
                             1.0 if scale is None else float(scale.reshape(-1)[0]),
                             _prod(lib, w[p + "attn_q.weight"], q8), _prod(lib, w[p + "attn_output.weight"], q8),
                             _prod(lib, gate_up[i], q8), _prod(lib, w[p + "ffn_down.weight"], q8),
                             c.layer_head_dim(i))
        head = None
        if assistant.token_map is not None and isinstance(assistant.head, CPUBlockWeight) and \
                tuple(assistant.head.shape) == (assistant.token_map.numel(), c.hidden_size):
            head = (_prod(lib, assistant.head, q8), assistant.token_map.contiguous())
        got = (arr, _prod(lib, pre, q8), _prod(lib, post, q8), head, gate_up)
    assistant.__dict__[key] = got
    return got


def run_step(assistant, x_embed: torch.Tensor, h: torch.Tensor, kv: dict, rope: dict, token: bool = False):
    """``(hidden float32 [H], next h float32 [Hb], draft)`` of one draft step through
    ``gs_assistant_step``: ``draft`` the greedy token (:meth:`Gemma4Assistant.draft_token`) when
    ``token`` and the head is a reduced block-quantized one (scored in the same call), as
    ``(token, probability of it under the softmax over the draft vocabulary)``, else None. None
    where the C step does not apply (no C kernel, autograd, another device, weights it does not read,
    keys that are not contiguous float32); the caller then runs the per-op path.

    Args:
        x_embed, h: float32 [Hb] (see :meth:`Gemma4Assistant.step`).
        kv: per layer type: (keys [L, Hkv, D], values [L, Hkv, D], mask bool [1, L] or None).
        rope: per layer type: (cos, sin) float32 [1, D] at the draft position.
    """
    if torch.is_grad_enabled() or x_embed.device.type != "cpu" or x_embed.dtype != torch.float32:
        return None
    lib = kernels.load_library()
    if lib is None or not hasattr(lib, "gs_assistant_step"):
        return None
    q8 = kernels.draft_act_quant() == "q8_0"
    static = _static(assistant, lib, q8)
    if static is None:
        return None
    if kernels._bg_ready:  # copies regrouped in the background: in use from this step
        kernels.sync_layouts([o for w in assistant.weights.values() if isinstance(w, CPUBlockWeight)
                              for o in w._segment_owners()])
    base, pre, post, head, _ = static
    c = assistant.config
    tables = {}
    for kind, (keys, values, mask) in kv.items():
        if not (_plain(keys) and _plain(values)) or (mask is not None and not mask.is_contiguous()):
            return None
        if keys.dim() != 3 or keys.shape[1] != c.num_kv_heads:  # the C step takes one KV-head count for all
            return None  # layers: a target whose full layers have another (num_global_kv_heads) runs per op
        tables[kind] = tuple(r.contiguous() for r in rope[kind])
    arr = (_ALayer * c.num_layers)()  # a copy per call: the weights from the kept array, this step's K/V
    ctypes.memmove(arr, base, ctypes.sizeof(base))
    for i in range(c.num_layers):
        kind = c.layer_types[i]
        keys, values, mask = kv[kind]
        cos, sin = tables[kind]
        ly = arr[i]
        ly.k, ly.v, ly.L = keys.data_ptr(), values.data_ptr(), keys.shape[0]
        ly.mask = None if mask is None else mask.data_ptr()
        ly.cos, ly.sin = cos.data_ptr(), sin.data_ptr()
    inp = torch.cat([x_embed.reshape(-1), h.reshape(-1)]).contiguous()
    hb = assistant.backbone_hidden_size
    hidden = torch.empty(c.hidden_size, dtype=torch.float32)
    next_h = torch.empty(hb, dtype=torch.float32)
    use_head = token and head is not None
    best = torch.full((1,), -1, dtype=torch.int64)
    p_best = torch.zeros(1, dtype=torch.float32)
    rc = lib.gs_assistant_step(c.num_layers, ctypes.addressof(arr), ctypes.addressof(pre), ctypes.addressof(post),
                               assistant.weights["output_norm.weight"].data_ptr(), inp.data_ptr(), hb,
                               c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size, c.rms_norm_eps,
                               hidden.data_ptr(), next_h.data_ptr(), ctypes.addressof(head[0]) if use_head else None,
                               head[1].numel() if use_head else 0, head[1].data_ptr() if use_head else None,
                               best.data_ptr(), p_best.data_ptr(), kernels.threads(), int(q8))
    del tables
    if rc != 0:
        return None
    return hidden, next_h, (int(best[0]), float(p_best[0])) if use_head else None


class Rows:
    """The per-row half of the batched step's layer array, built once per round: row r's layers carry
    its target K/V, key count, mask and RoPE (what every draft step of a round reads unchanged: the
    draft position stays p). :meth:`select` lays out the rows still drafting for one call.

    Attributes:
        n: rows prepared.
    """

    def __init__(self, arr, n: int, nl: int, keep: list, q8: bool):
        self._arr, self.n, self._nl, self._keep = arr, n, nl, keep  # keep: the tensors the C call reads
        self.q8 = q8  # the activation mode whose weight layouts the array points into
        self._size = ctypes.sizeof(_ALayer) * nl

    def select(self, rows: list[int]):
        """The layer array of ``rows`` (indices into the prepared rows, in that order): the kept array
        itself when they are all of them in order, else a copy of their blocks."""
        if list(rows) == list(range(self.n)):
            return self._arr
        out = (_ALayer * (len(rows) * self._nl))()
        for j, r in enumerate(rows):
            ctypes.memmove(ctypes.addressof(out) + j * self._size, ctypes.addressof(self._arr) + r * self._size,
                           self._size)
        return out


def prepare_rows(assistant, kvs: list, ropes: list) -> Rows | None:
    """:class:`Rows` for one round of batched draft steps over these rows, or None where the batched
    C step does not apply (as :func:`run_steps`).

    Args:
        kvs: per row, per layer type: (keys [L, Hkv, D], values, mask bool [1, L] or None).
        ropes: per row, per layer type: (cos, sin) float32 [1, D] at that row's draft position.
    """
    if torch.is_grad_enabled() or assistant.device.type != "cpu":
        return None
    lib = kernels.load_library()
    if lib is None or not hasattr(lib, "gs_assistant_steps"):
        return None
    q8 = kernels.draft_act_quant() == "q8_0"
    static = _static(assistant, lib, q8)
    if static is None or static[3] is None:
        return None
    base, c = static[0], assistant.config
    nl, n = c.num_layers, len(kvs)
    arr = (_ALayer * (n * nl))()
    keep = []
    for r in range(n):
        tables = {}
        for kind, (keys, values, mask) in kvs[r].items():
            if not (_plain(keys) and _plain(values)) or (mask is not None and not mask.is_contiguous()):
                return None
            if keys.dim() != 3 or keys.shape[1] != c.num_kv_heads:  # one KV-head count for all layers (run_step)
                return None
            tables[kind] = tuple(t.contiguous() for t in ropes[r][kind])
        keep.append((tables, kvs[r]))  # the RoPE rows, keys, values and masks the array points into
        ctypes.memmove(ctypes.addressof(arr) + r * ctypes.sizeof(base), base, ctypes.sizeof(base))
        for i in range(nl):
            kind = c.layer_types[i]
            keys, values, mask = kvs[r][kind]
            cos, sin = tables[kind]
            ly = arr[r * nl + i]
            ly.k, ly.v, ly.L = keys.data_ptr(), values.data_ptr(), keys.shape[0]
            ly.mask = None if mask is None else mask.data_ptr()
            ly.cos, ly.sin = cos.data_ptr(), sin.data_ptr()
    return Rows(arr, n, nl, keep, q8)


def run_steps(assistant, x_embed: torch.Tensor, h: torch.Tensor, kvs: list | None, ropes: list | None,
              rows: list[int] | None = None, prepared: Rows | None = None):
    """One draft step for B sequences in one call of ``gs_assistant_steps``: ``(hidden float32 [B, H],
    next h float32 [B, Hb], tokens [B], probabilities [B])``, row b's bits those of :func:`run_step`
    on row b alone (tokens and probabilities as its reduced head gives them). None where the batched
    C step does not apply (as :func:`run_step`, or a head that is not a reduced block-quantized one);
    the caller then steps each row alone.

    Args:
        x_embed, h: float32 [B, Hb], 1 <= B <= 16.
        kvs: per row, per layer type: (keys [L, Hkv, D], values, mask bool [1, L] or None); None with
            ``prepared``.
        ropes: per row, per layer type: (cos, sin) float32 [1, D] at that row's draft position; None
            with ``prepared``.
        rows, prepared: the round's :func:`prepare_rows` and which of its rows these B are (instead of
            ``kvs`` and ``ropes``: the per-row layer array is not built again for every step).
    """
    if torch.is_grad_enabled() or x_embed.device.type != "cpu" or x_embed.dtype != torch.float32:
        return None
    n = x_embed.shape[0]
    lib = kernels.load_library()
    if lib is None or not hasattr(lib, "gs_assistant_steps") or not 1 <= n <= 16:
        return None
    q8 = kernels.draft_act_quant() == "q8_0"
    static = _static(assistant, lib, q8)
    if static is None or static[3] is None:
        return None
    if prepared is None:
        if kvs is None or len(kvs) != n:
            return None
        prepared, rows = prepare_rows(assistant, kvs, ropes), list(range(n))
        if prepared is None:
            return None
    elif rows is None or len(rows) != n or prepared.q8 != q8:
        return None
    if kernels._bg_ready:
        kernels.sync_layouts([o for w in assistant.weights.values() if isinstance(w, CPUBlockWeight)
                              for o in w._segment_owners()])
    arr = prepared.select(rows)
    _, pre, post, head, _ = static
    c = assistant.config
    inp = torch.cat([x_embed.reshape(n, -1), h.reshape(n, -1)], dim=1).contiguous()
    hb = assistant.backbone_hidden_size
    hidden = torch.empty(n, c.hidden_size, dtype=torch.float32)
    next_h = torch.empty(n, hb, dtype=torch.float32)
    best = torch.full((n,), -1, dtype=torch.int64)
    p_best = torch.zeros(n, dtype=torch.float32)
    rc = lib.gs_assistant_steps(n, c.num_layers, ctypes.addressof(arr), ctypes.addressof(pre), ctypes.addressof(post),
                                assistant.weights["output_norm.weight"].data_ptr(), inp.data_ptr(), hb,
                                c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size, c.rms_norm_eps,
                                hidden.data_ptr(), next_h.data_ptr(), ctypes.addressof(head[0]), head[1].numel(),
                                head[1].data_ptr(), best.data_ptr(), p_best.data_ptr(), kernels.threads(), int(q8))
    if rc != 0:
        return None
    return hidden, next_h, best.tolist(), p_best.tolist()
