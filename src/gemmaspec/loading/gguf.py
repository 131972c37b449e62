"""Reading GGUF files (llama.cpp's format) for every architecture in :mod:`gemmaspec.models.registry`.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. The header (metadata and tensor
table) is parsed by :mod:`.gguf_header` (the default model's in ~0.05 s; ``gguf.GGUFReader`` takes
13-22 s on its 262k-token vocabulary). Weights are used straight from the file, mapped copy-on-write:
F32 tensors and matrices of a type in :data:`gemmaspec.kernels.STORED_TYPES` are views of the mapped
bytes (nothing copied, nothing read until used); other block types are read and converted exactly
into the int8 form; the rest becomes float32. Nothing is written to disk except the tokenizer, which
is slow to build and so cached (:mod:`.tokenizer_cache`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from ..errors import ModelFileError
from ..kernels import STORED_TYPES, QuantizedWeight, StoredWeight
from ..kernels.ggml_blocks import DENSE, SUPPORTED_QUANT, to_int8_blocks
from ..models.registry import Architecture, by_name
from ..tokenizer import GemmaTokenizer
from .gguf_header import GGUF_MAGIC, GGUFHeader, TensorInfo, read_header
from .gguf_header import _check_file as check_file
from .tokenizer_cache import gguf_tokenizer

SUPPORTED_TYPES = tuple(t.name for t in DENSE + SUPPORTED_QUANT)
__all__ = ["GGUF_MAGIC", "GGUFMeta", "LoadedModel", "check_file", "load_gguf", "open_reader", "read_config",
           "tensor_weight"]


@dataclass
class LoadedModel:
    """A loaded checkpoint: the built model and what came with it.

    Attributes:
        path: the GGUF file or checkpoint directory.
        arch: its :class:`~gemmaspec.models.registry.Architecture` (``arch.role``: target or assistant).
        config: the typed config (``arch.config_class``).
        model: the built model object (``arch.build``), on the CPU.
        tokenizer: the tokenizer (None for an assistant, which uses its target's).
    """

    path: Path
    arch: Architecture
    config: object
    model: object
    tokenizer: GemmaTokenizer | None


class GGUFMeta:
    """A GGUF file's metadata and tensor table, as the config readers (``Config.from_gguf``) see it.

    Args:
        header: the file's :class:`~gemmaspec.loading.gguf_header.GGUFHeader`.
        path: the file (for messages).

    Attributes:
        arch: ``general.architecture``.
        tensor_shapes: tensor name -> shape in torch order (``[..., ne1, ne0]``).

    Raises:
        ModelFileError: the file has no ``general.architecture``.
    """

    def __init__(self, header: GGUFHeader, path: Path):
        self.header, self.path = header, path
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{path}: the GGUF has no general.architecture key; it is not a model file")
        self.arch = arch
        self.tensor_shapes = {t.name: t.shape for t in header.tensors}

    def get(self, key: str, default=None):
        """The value of metadata ``key`` (full name), or ``default``."""
        return self.header.get(key, default)

    def arch_get(self, key: str, default=None):
        """The value of ``<arch>.<key>``, or ``default``."""
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str):
        """The value of ``<arch>.<key>``. Raises ModelFileError when it is missing."""
        v = self.arch_get(key)
        if v is None:
            raise ModelFileError(f"{self.path}: required metadata key {self.arch}.{key} is missing")
        return v

    def array_len(self, key: str) -> int | None:
        """Number of elements of an array field (without decoding them), or None when absent."""
        f = self.header.fields.get(key)
        return None if f is None else f.count

    def tensor_array(self, name: str) -> np.ndarray | None:
        """A (small) tensor's values as float32 numpy, or None when absent."""
        t = self.header.tensor(name)
        return None if t is None else np.asarray(_dense(self.header, t), dtype=np.float32)


def open_reader(path: Path) -> GGUFHeader:
    """The header of the GGUF ``path`` (metadata, tensor table), with missing, non-GGUF, truncated and
    corrupt files reported clearly. ``fields`` and ``tensors`` follow ``gguf.GGUFReader``'s names
    (``field.contents()``, ``field.types``); tensor data is not read.

    Raises:
        ModelFileError: missing, not GGUF, an unknown tensor type, truncated or corrupt.
    """
    return read_header(path)


def read_config(path: Path, reader: GGUFHeader | None = None):
    """``(Architecture, typed config)`` of a GGUF file from its metadata.

    Raises:
        UnsupportedArchitectureError: an architecture gemmaspec does not implement.
        ModelFileError: unreadable file or a required key missing.
    """
    meta = GGUFMeta(reader if reader is not None else open_reader(path), path)
    arch = by_name(meta.arch, str(path))
    return arch, arch.config_class.from_gguf(meta)


_INTEGER = {T.I8: np.int8, T.I16: np.int16, T.I32: np.int32, T.I64: np.int64}


def _read(header: GGUFHeader, t: TensorInfo, dtype=np.uint8) -> np.ndarray:
    """The tensor's bytes read into a new array (``pread``: the mapped pages stay untouched, so data
    that is converted does not stay in the process's memory twice)."""
    with open(header.path, "rb") as f:
        data = np.fromfile(f, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
    if data.size != t.n_bytes:
        raise ModelFileError(f"{header.path} is truncated (tensor {t.name} runs past the end of the file); "
                             "download or convert it again")
    return data.view(dtype)


def _dense(header: GGUFHeader, t: TensorInfo) -> torch.Tensor:
    """A tensor as float32 in torch's dim order (dequantized when quantized, through ``gguf.quants``);
    F32 tensors view the mapped file (no copy); integer tensors become int64."""
    qtype, shape = t.tensor_type, list(t.shape)
    if qtype == T.F32 and t.offset % 4 == 0:
        return torch.from_numpy(header.tensor_bytes(t).view(np.float32)).reshape(shape)
    if qtype in _INTEGER:
        return torch.from_numpy(_read(header, t, _INTEGER[qtype]).astype(np.int64)).reshape(shape)
    if qtype == T.BF16:
        bits = _read(header, t, np.int16).astype(np.int32) << 16
        return torch.from_numpy(bits).view(torch.float32).reshape(shape)
    if qtype in (T.F32, T.F16):
        return torch.from_numpy(_read(header, t, np.float32 if qtype == T.F32 else np.float16).astype(np.float32)).reshape(shape)
    data = _read(header, t).reshape(*shape[:-1], -1)
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32)).reshape(shape)


def _check_type(t: TensorInfo) -> T:
    """The tensor's GGML type. Raises ModelFileError for one gemmaspec cannot use."""
    qtype = t.tensor_type
    if qtype not in DENSE and qtype not in SUPPORTED_QUANT and qtype not in _INTEGER:
        raise ModelFileError(
            f"tensor {t.name} has type {qtype.name}, which gemmaspec does not support; "
            f"supported: {', '.join(SUPPORTED_TYPES)}; re-quantize the model with one of them")
    return qtype


def tensor_weight(header: GGUFHeader, t: TensorInfo):
    """One tensor of the file in the engine's form, built from the mapped file.

    - a 2-D matrix of a type in :data:`~gemmaspec.kernels.STORED_TYPES`: :class:`StoredWeight` whose
      ``raw`` (uint8 [N, row bytes]) views the mapped bytes (no copy; embeddings included, rows are
      unpacked on lookup);
    - a 2-D matrix of another block type (Q4_1, Q5_1, Q5_K): read and converted exactly into a
      :class:`QuantizedWeight` (int8 levels + fp32 block scales / offsets);
    - F32: a float32 view of the mapped bytes; F16/BF16 and block-quantized tensors of other ranks
      (MoE experts): float32 copies; integer tensors: int64.

    The mapping is copy-on-write: writing to a view changes this process's copy, never the file.

    Raises:
        ModelFileError: a tensor type gemmaspec cannot use.
    """
    qtype = _check_type(t)
    shape = t.shape
    if qtype in DENSE or qtype in _INTEGER or len(shape) != 2:
        return _dense(header, t)
    n, k = shape
    if qtype.name in STORED_TYPES:
        return StoredWeight(torch.from_numpy(header.tensor_bytes(t)).view(n, -1), qtype.name, k)
    q, s, o, g = to_int8_blocks(_read(header, t), qtype, n, k)
    return QuantizedWeight(torch.from_numpy(q), torch.from_numpy(s), None if o is None else torch.from_numpy(o), g)


def load_gguf(path: str | os.PathLike, use_cache: bool = True) -> LoadedModel:
    """Read a GGUF of any architecture in :mod:`~gemmaspec.models.registry`: typed config from the
    metadata, weights from the mapped file (:func:`tensor_weight`), the built model, the tokenizer
    (targets only). With ``use_cache`` the tokenizer is taken from (or, on first use, saved in) the
    tokenizer cache (:mod:`.tokenizer_cache`); nothing else is written.

    Raises:
        ModelFileError: missing, unreadable, non-GGUF, truncated or corrupt file, unsupported
            tensor type, missing tensors or metadata.
        UnsupportedArchitectureError: not a supported architecture.
    """
    path = Path(path)
    header = open_reader(path)
    arch, config = read_config(path, header)
    for t in header.tensors:  # refuse an unusable file before doing any work
        _check_type(t)
    weights = {t.name: tensor_weight(header, t) for t in header.tensors}
    model = build_model(arch, config, weights, path)
    tokenizer = gguf_tokenizer(header, use_cache) if arch.role == "target" else None
    header.release_header()
    release_freed_memory()
    return LoadedModel(path, arch, config, model, tokenizer)


def release_freed_memory() -> None:
    """Hand heap memory freed during loading back to the system (glibc ``malloc_trim``; a no-op
    elsewhere). Parsing a 262k-token ``tokenizer.json`` leaves ~190 MB of freed heap counted in the
    process's RSS; so can converting tensors."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols, libc's among them
    except (OSError, AttributeError):
        pass


def build_model(arch: Architecture, config, weights: dict, path: Path):
    """``arch.build(config, weights)`` with a missing or misshapen tensor reported as the file's fault.

    Raises:
        ModelFileError: names the first missing tensor, or the shape problem.
    """
    try:
        return arch.build(config, weights)
    except KeyError as exc:
        raise ModelFileError(f"{path}: tensor {exc.args[0]} that the {arch.name} architecture needs is missing; "
                             "the checkpoint is incomplete") from None
    except ValueError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
