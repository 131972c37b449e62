"""Telling quantization-aware-trained (QAT) weights from ordinary ones, from the values themselves.

Google's QAT checkpoints (``*-qat-q4_0-unquantized``) store bf16 weights whose every 32-value block
along the input dimension lies on a 4-bit grid: at most 16 distinct values. Ordinary bf16 weights
almost never do (a random 32-value block has ~32 distinct values). The check samples blocks of one
weight matrix; it never looks at names.
"""

from __future__ import annotations

import torch

from ..kernels import QuantizedWeight, StoredWeight


def on_4bit_grid_fraction(w, max_blocks: int = 512) -> float:
    """Fraction of sampled 32-value blocks of ``w`` (float [N, K], QuantizedWeight or StoredWeight) with at most
    16 distinct values. Blocks run along K (the input dimension)."""
    if isinstance(w, StoredWeight):
        if w.qtype == "Q4_0":
            return 1.0  # 4-bit levels as stored
        w = w.to_int8()
    if isinstance(w, QuantizedWeight):
        if w.group == 32 and w.offset is None and int(w.q.max()) <= 7 and int(w.q.min()) >= -8:
            return 1.0  # stored as 4-bit levels already
        w = w.dequantize()
    if w.dim() != 2 or w.shape[1] % 32:
        return 0.0
    blocks = w.reshape(-1, 32)
    n = blocks.shape[0]
    idx = torch.linspace(0, n - 1, min(n, max_blocks)).long()
    sample = blocks[idx]
    distinct = torch.tensor([torch.unique(b).numel() for b in sample])
    return float((distinct <= 16).float().mean())


def looks_qat(w) -> bool:
    """True when nearly every sampled block of ``w`` sits on a 4-bit grid (≥ 95 %)."""
    return on_4bit_grid_fraction(w) >= 0.95
