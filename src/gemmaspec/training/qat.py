"""Fake quantization on the Q4_0 grid for quantization-aware training (``train-drafter --qat q4_0``).

Q4_0 (ggml ``block_q4_0``) stores 32 consecutive values of a row (along the last dimension, GGUF's
ne0, the input dimension of a matrix) as an fp16 step d and 4-bit levels: value = d·level, level in
[-8, 7]. :func:`fake_quant_q4_0` replaces a float32 master weight by those values in the forward pass
and lets the gradient through unchanged (straight-through estimator, Bengio et al. 2013), so training
sees exactly the weights the exported Q4_0 file will hold.

The rule per block is llama.cpp's Q4_0 quantizer (``quantize_row_q4_0_ref`` in ggml-quants.c; the same
in gguf-py's ``gguf.quants.Q4_0``): max = the value of largest magnitude (sign kept, first one on a
tie), d = max / -8 in float32, level = min(15, trunc(w·(1/d) + 8.5)) − 8, stored step fp16(d). So for
the default ``export_dtype=torch.float32``, ``fake_quant_q4_0(w)`` equals
``dequantize(quantize(w, Q4_0))`` of gguf-py bit for bit (a test checks it). Every block's largest
magnitude lands on level -8.

Representability. d·level is exact in float32 (fp16's 11 significant bits times at most 4), so a
float32 export holds the values exactly, and both ggml's quantizer and ``gemmaspec quantize --exact``
give them back bit for bit. It is **not** in general a bf16 (8 significant bits) or fp16 number:
an 11-bit step times level 3, 5, 6 or 7 needs up to 14 bits. For a bf16 (or fp16) export pass
``export_dtype``: the step is then rounded to 5 (fp16: 8) significant bits, still an fp16 number, so
every d·level fits that format and ``quantize --exact`` reproduces every value of the export
bit-exactly (the levels stay ggml's levels for the block; only the stored step is coarser, by at most
2^-6 relative).

Gradient. The step is a function of the block's peak but is treated as a constant (no gradient flows
through d). ``ste="identity"`` (default) passes the gradient to every weight unchanged.
``ste="clipped"`` zeroes it where the level was clamped (ggml's min(15, ·): only values within the top
1/16 of the block's range on the side opposite its peak); since the step follows the block's own peak,
clamping is rare and a zeroed weight there could never move back inside, so identity is the default.
"""

from __future__ import annotations

import torch

QK = 32  # values per Q4_0 block
_STEP_BITS = {torch.float32: 11, torch.bfloat16: 5, torch.float16: 8}  # significant bits of the stored step


def _check(w: torch.Tensor, export_dtype: torch.dtype, ste: str = "identity") -> None:
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32:
        raise TypeError(f"fake_quant_q4_0 needs a float32 tensor (got {getattr(w, 'dtype', type(w))}); keep "
                        "float32 master weights and fake-quantize them")
    if w.dim() < 1 or w.shape[-1] % QK:
        raise ValueError(f"Q4_0 blocks run along the last dimension, which must be a multiple of {QK} "
                         f"(got shape {tuple(w.shape)})")
    if export_dtype not in _STEP_BITS:
        raise ValueError(f"export_dtype must be torch.float32, torch.bfloat16 or torch.float16 (got {export_dtype})")
    if ste not in ("identity", "clipped"):
        raise ValueError(f"ste must be 'identity' or 'clipped' (got {ste!r})")


def _round_step(d: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 steps rounded (to nearest, ties to even) to ``bits`` significant bits on fp16's grid
    (multiples of 2^-24 below 2^-14), clamped to the largest such number fp16 holds."""
    if bits == 11:
        top = 65504.0
        r = d.to(torch.float16).float()
    else:
        top = float((2**bits - 1) * 2 ** (16 - bits))
        _, e = torch.frexp(d)  # d = m·2^e, 0.5 <= |m| < 1: the bit of weight 2^(e-bits) is the last kept
        q = torch.clamp(e - bits, min=-24)
        r = torch.ldexp(torch.round(torch.ldexp(d, -q)), q)
    return torch.clamp(r, -top, top)  # an fp16 overflow (inf) becomes the largest step; NaN stays NaN


def _quantize(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32 like ``w``, clamped bool like ``w``): the block rule of the module docstring."""
    blocks = w.reshape(-1, QK)
    imax = blocks.abs().argmax(dim=1, keepdim=True)  # first of equal magnitudes, as numpy's argmax
    d = blocks.gather(1, imax) / -8.0
    inv = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)
    x = torch.trunc(blocks * inv + 8.5)
    clamped = (x > 15) | (x < 0)
    levels = x.clamp(0, 15) - 8
    return (_round_step(d, bits) * levels).reshape(w.shape), clamped.reshape(w.shape)


class _FakeQuantQ4_0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, bits, clipped):
        q, clamped = _quantize(w.detach(), bits)
        if clipped:
            ctx.save_for_backward(clamped)
        ctx.clipped = clipped
        return q

    @staticmethod
    def backward(ctx, grad):
        if ctx.clipped:
            (clamped,) = ctx.saved_tensors
            grad = grad.masked_fill(clamped, 0.0)
        return grad, None, None


def fake_quant_q4_0(w: torch.Tensor, export_dtype: torch.dtype = torch.float32, ste: str = "identity") -> torch.Tensor:
    """``w`` with every 32-value block along the last dimension replaced by its Q4_0 values.

    Args:
        w: float32 [..., K] (a matrix [N, K]: N output rows, K inputs), K a multiple of 32; any device.
        export_dtype: the dtype the trained weight will be written in before packing: ``torch.float32``
            (default; ggml's fp16 step, bit-identical to llama.cpp's Q4_0), ``torch.bfloat16`` or
            ``torch.float16`` (step rounded to 5 or 8 significant bits so that every value is a number
            of that format).
        ste: ``"identity"`` (gradient passed unchanged) or ``"clipped"`` (zero where the level was
            clamped to 7); the step gets no gradient. See the module docstring.

    Returns:
        float32, shape of ``w``: d·level per value, exactly representable in ``export_dtype``; NaN/Inf
        in a block spoil that block only.

    Raises:
        TypeError: ``w`` is not a float32 tensor.
        ValueError: the last dimension is not a multiple of 32; unknown ``export_dtype`` or ``ste``.
    """
    _check(w, export_dtype, ste)
    return _FakeQuantQ4_0.apply(w, _STEP_BITS[export_dtype], ste == "clipped")


def q4_0_grid_report(w: torch.Tensor, export_dtype: torch.dtype = torch.float32) -> float:
    """Fraction of 32-value blocks of ``w`` (float32 [..., K], K a multiple of 32) that lie on the
    grid :func:`fake_quant_q4_0` trains on: blocks it leaves bit-identical (for the default
    ``export_dtype``, exactly the blocks llama.cpp's Q4_0 quantizer reproduces bit for bit). A weight
    exported from a QAT run is 1.0; an ordinary float weight is about 0.0. Blocks on some other Q4_0
    grid (a step not equal to ggml's amax/8 rule) count as off; ``gemmaspec quantize --exact`` finds
    those. Returns 1.0 for an empty tensor.

    Raises:
        TypeError, ValueError: as :func:`fake_quant_q4_0`.
    """
    _check(w, export_dtype)
    if w.numel() == 0:
        return 1.0
    with torch.no_grad():
        q, _ = _quantize(w.detach(), _STEP_BITS[export_dtype])
        same = (q == w.detach()).reshape(-1, QK).all(dim=1)
    return float(same.float().mean())
