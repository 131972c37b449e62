"""The interface of every block-quantized weight matrix, with no dependencies, so that the CPU
formats (``kernels/weights.py``), the background regroup (``kernels/regroup.py``) and the device
layout (``kernels/cuda.py``) all build on it without importing each other."""

from __future__ import annotations

import torch


class BlockWeight:
    """A block-quantized weight matrix W [N, K]: ``shape``, ``nbytes`` (memory held),
    ``dequantize()`` (float32 [N, K]), ``rows(ids)`` (embedding lookup, float32 [*ids.shape, K]),
    ``to(device)`` and ``w(x)`` = x @ W.T (x float32 [..., K] → float32 [..., N]). Test
    ``isinstance(w, BlockWeight)`` to tell a quantized weight from a dense tensor."""

    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def to(self, device) -> "BlockWeight":
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _segment_owners(self) -> list:
        """The CPU :class:`~gemmaspec.kernels.weights.StoredWeight` objects behind this weight's kernel
        segments, in segment order (None for a segment of another kind); a weight with no CPU kernel
        segments (a device layout) has none."""
        return []
