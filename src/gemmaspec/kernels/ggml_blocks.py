"""Exact conversion of GGML quantized blocks into int8 blocks with fp32 scales and offsets.

Block layouts follow ggml's ``ggml-common.h`` (``block_q4_0`` … ``block_q6_K``) as documented by the
``gguf`` package (``gguf/quants.py``); :func:`to_int8_blocks` returns the integer levels and per-block
scale (and offset) so that ``scale * q + offset`` equals ``gguf.quants.dequantize`` of the same bytes.
All scales are products of an fp16 super-block scale and a small integer, which fp32 holds exactly.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

# the block types to_int8_blocks converts (their block sizes come from gguf.GGML_QUANT_SIZES)
SUPPORTED_QUANT = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
DENSE = (T.F32, T.F16, T.BF16)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from the last axis of 2 bytes, as float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32] levels: low nibbles first (values 0-15), then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q5_high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes of a little-endian uint32 → [..., 32] bits (bit j for value j)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales_mins(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes of packed 6-bit scales and mins → ([..., 8], [..., 8]) integers."""
    sc = sc.astype(np.uint16)
    scales = np.empty(sc.shape[:-1] + (8,), np.uint16)
    mins = np.empty_like(scales)
    scales[..., :4] = sc[..., 0:4] & 63
    mins[..., :4] = sc[..., 4:8] & 63
    scales[..., 4:] = (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return scales, mins


def to_int8_blocks(raw: np.ndarray, qtype: T, n_rows: int, row_len: int):
    """Integer levels and scales of a quantized tensor.

    Args:
        raw: uint8 array holding the tensor's blocks (any shape; n_rows × bytes-per-row bytes).
        qtype: the GGML type (one of :data:`SUPPORTED_QUANT`).
        n_rows, row_len: the matrix shape [N, K]; K (GGUF ``ne0``) runs along the blocks.

    Returns:
        ``(q, scale, offset, group)``: q int8 [N, K], scale float32 [N, K/group], offset float32
        [N, K/group] or None, group 16 or 32.

    Raises:
        ValueError: unsupported type, or a byte count that does not fit the shape.
    """
    if qtype not in SUPPORTED_QUANT:
        raise ValueError(f"tensor type {qtype.name} is not supported")
    per_block, nbytes = GGML_QUANT_SIZES[qtype]
    if row_len % per_block:
        raise ValueError(f"row length {row_len} is not a multiple of the {qtype.name} block ({per_block})")
    nb = row_len // per_block
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size != n_rows * nb * nbytes:
        raise ValueError(f"{qtype.name} tensor [{n_rows}, {row_len}] needs {n_rows * nb * nbytes} bytes, has {raw.size}")
    b = raw.reshape(n_rows, nb, nbytes)
    offset = None
    if qtype == T.Q8_0:
        scale = _f16(b[..., 0:2])
        q = b[..., 2:34].view(np.int8)
        group = 32
    elif qtype in (T.Q4_0, T.Q4_1):
        d = _f16(b[..., 0:2])
        if qtype == T.Q4_0:
            q = _nibbles(b[..., 2:18]).astype(np.int8) - 8
        else:
            offset = _f16(b[..., 2:4])
            q = _nibbles(b[..., 4:20]).astype(np.int8)
        scale, group = d, 32
    elif qtype in (T.Q5_0, T.Q5_1):
        d = _f16(b[..., 0:2])
        if qtype == T.Q5_0:
            qh, qs = b[..., 2:6], b[..., 6:22]
        else:
            offset = _f16(b[..., 2:4])
            qh, qs = b[..., 4:8], b[..., 8:24]
        q = (_nibbles(qs) | (_q5_high_bits(qh) << 4)).astype(np.int8)
        if qtype == T.Q5_0:
            q = q - 16
        scale, group = d, 32
    elif qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales_mins(b[..., 4:16])
        if qtype == T.Q4_K:
            qs = b[..., 16:144].reshape(n_rows, nb, 4, 32)
            q = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [N, nb, 4 chunks, 2 sub-blocks, 32]
        else:
            qh = b[..., 16:48]  # [N, nb, 32]: bit 2i / 2i+1 of byte l is the 5th bit of value l
            qs = b[..., 48:176].reshape(n_rows, nb, 4, 32)
            shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
            hi = (qh[:, :, None, None, :] >> shifts) & 1
            q = np.stack([qs & 0x0F, qs >> 4], axis=3) | (hi << 4)
        q = q.reshape(n_rows, nb * 8, 32).astype(np.int8)
        scale = (d[..., None] * sc.astype(np.float32)).reshape(n_rows, nb * 8)
        offset = -(dmin[..., None] * mn.astype(np.float32)).reshape(n_rows, nb * 8)
        group = 32
    elif qtype == T.Q6_K:
        ql = b[..., 0:128].reshape(n_rows, nb, 2, 64)
        qh = b[..., 128:192].reshape(n_rows, nb, 2, 32)
        sc = b[..., 192:208].view(np.int8).reshape(n_rows, nb, 16)
        d = _f16(b[..., 208:210])
        lo = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], -1)
        hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], -1)
        q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n_rows, nb * 16, 16)
        scale = (d[..., None] * sc.astype(np.float32)).reshape(n_rows, nb * 16)
        group = 16
    else:  # pragma: no cover - guarded above
        raise ValueError(qtype)
    q = np.ascontiguousarray(q).reshape(n_rows, row_len).view(np.int8)
    scale = np.ascontiguousarray(scale, dtype=np.float32).reshape(n_rows, row_len // group)
    if offset is not None:
        offset = np.ascontiguousarray(offset, dtype=np.float32).reshape(n_rows, row_len // group)
    return q, scale, offset, group
