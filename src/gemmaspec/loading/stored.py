"""Tensors read from disk a block of rows at a time, in bounded memory.

Converters (``gemmaspec convert``, ``gemmaspec quantize``, ``gemmaspec verify``) stream tensors of checkpoints larger than
memory. A :class:`StoredTensor` knows where a tensor's bytes lie in a file and reads rows with
``os.pread``, so memory holds only the rows being worked on (a memory map would count every page it
touched in the process's RSS until the whole file is unmapped).

Locations come from the files' own headers: GGUF through :mod:`.gguf_header` (tensor data offsets),
safetensors from its header (an 8-byte little-endian length, then a JSON table of ``dtype``,
``shape``, ``data_offsets`` relative to the end of the header; the ``safetensors`` package's reader
only offers a memory map).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelFileError
from .gguf_header import GGUFHeader

# source element types that are widened to float32, with their explicit mantissa bits
FLOAT_MANTISSA = {"BF16": 7, "F16": 10, "F32": 23}
_NP = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
       "I64": np.int64, "U8": np.uint8, "BOOL": np.bool_, "BF16": np.uint16}


@dataclass
class StoredTensor:
    """A tensor of ``shape`` (numpy order; the last axis is GGUF's ne0) and element type ``dtype``
    (``"BF16"``, ``"F16"``, ``"F32"``, integer types, or a GGML block type name for already
    quantized GGUF tensors) stored at ``offset`` in ``path`` over ``nbytes`` bytes."""

    path: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        """Rows of the tensor seen as 2-D [rows, shape[-1]]."""
        return math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1

    @property
    def row_len(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_MANTISSA

    def read_bytes(self, start: int, length: int) -> bytes:
        """``length`` raw bytes from ``start`` (relative to the tensor).

        Raises:
            ModelFileError: the file ends early (truncated download).
        """
        with open(self.path, "rb") as f:
            data = os.pread(f.fileno(), length, self.offset + start)
        if len(data) != length:
            raise ModelFileError(f"{self.path} is truncated (a tensor runs past the end of the file); download it again")
        return data

    def read_rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows r0..r1 of a float tensor widened to float32 [r1-r0, row_len] (bit-exact)."""
        if not self.is_float:
            raise TypeError(f"{self.dtype} tensor cannot be read as float rows")
        size = np.dtype(_NP[self.dtype]).itemsize
        raw = np.frombuffer(self.read_bytes(r0 * self.row_len * size, (r1 - r0) * self.row_len * size),
                            dtype=_NP[self.dtype]).reshape(r1 - r0, self.row_len)
        if self.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32)

    def load(self) -> torch.Tensor:
        """The whole tensor: float types as float32, integer types as stored."""
        if self.is_float:
            return torch.from_numpy(self.read_rows(0, self.rows).reshape(self.shape).copy())
        arr = np.frombuffer(self.read_bytes(0, self.nbytes), dtype=_NP[self.dtype]).reshape(self.shape)
        return torch.from_numpy(arr.copy())


def safetensors_index(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of one ``.safetensors`` file by name.

    Raises:
        ModelFileError: not a safetensors file, or truncated.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > min(size - 8, 100 << 20):
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path} is not a readable safetensors file ({exc}); download it again") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            a, b = info["data_offsets"]
            dtype, shape = info["dtype"], tuple(int(x) for x in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{path}: tensor {name} has a malformed header entry") from None
        if dtype not in _NP:
            raise ModelFileError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        if 8 + n + b > size:
            raise ModelFileError(f"{path} is truncated (tensor {name} runs past the end of the file); download it again")
        out[name] = StoredTensor(path, 8 + n + a, b - a, dtype, shape)
    return out


def gguf_index(path: Path, header: GGUFHeader) -> dict[str, StoredTensor]:
    """Every tensor of the GGUF file ``path`` (its parsed ``header``, which has already checked that
    every tensor lies within the file) by name, in file order."""
    return {t.name: StoredTensor(path, t.offset, t.n_bytes, t.tensor_type.name, t.shape) for t in header.tensors}
