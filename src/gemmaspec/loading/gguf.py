"""Reading GGUF files (llama.cpp's format) through the ``gguf`` package, for every architecture in
:mod:`gemmaspec.models.registry`.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. The first load of a file reads
it with ``gguf.GGUFReader`` (about 15-25 s for a 262k-token vocabulary), converts every weight into
the engine's form (:mod:`gemmaspec.kernels`) and builds the tokenizer; both are saved in the cache
(``<cache>/prepared/<key>/``, key = path, size and modification time), so later starts read one
safetensors file and one ``tokenizer.json`` (about 2 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from ..errors import ModelFileError
from ..kernels import STORED_TYPES, QuantizedWeight, StoredWeight
from ..models.registry import Architecture, by_name
from ..paths import cache_home
from ..tokenizer import GemmaTokenizer
from ..kernels.ggml_blocks import DENSE, SUPPORTED_QUANT, to_int8_blocks

SUPPORTED_TYPES = tuple(t.name for t in DENSE + SUPPORTED_QUANT)
FORMAT_VERSION = 4  # 4: Q4_0, Q8_0, Q5_0, Q4_K, Q6_K matrices kept as stored (layout kind "stored")
GGUF_MAGIC = b"GGUF"


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
        reader: an open ``gguf.GGUFReader``.
        path: the file (for messages).

    Attributes:
        arch: ``general.architecture``.
        tensor_shapes: tensor name -> shape in torch order (``[..., ne1, ne0]``).

    Raises:
        ModelFileError: the file has no ``general.architecture``.
    """

    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{path}: the GGUF has no general.architecture key; it is not a model file")
        self.arch = arch
        self.tensor_shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in reader.tensors}

    def get(self, key: str, default=None):
        """The value of metadata ``key`` (full name), or ``default``."""
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

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
        f = self.reader.fields.get(key)
        return None if f is None else len(f.data)

    def tensor_array(self, name: str) -> np.ndarray | None:
        """A (small) tensor's values as float32 numpy, or None when absent."""
        t = next((t for t in self.reader.tensors if t.name == name), None)
        return None if t is None else np.asarray(_dense(t), dtype=np.float32)


def check_file(path: Path) -> None:
    """Raise :class:`ModelFileError` unless ``path`` is a readable file that starts like a GGUF."""
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelFileError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror}") from None
    if head != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a .gguf model")


def open_reader(path: Path):
    """``gguf.GGUFReader`` over ``path``, with corrupt and truncated files reported clearly.

    Raises:
        ModelFileError: missing, not GGUF, an unknown tensor type, truncated or corrupt.
    """
    check_file(path)
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
    except ValueError as exc:
        msg = str(exc)
        if "GGMLQuantizationType" in msg:
            raise ModelFileError(
                f"{path} holds a tensor of an unknown type ({msg}); supported types: {', '.join(SUPPORTED_TYPES)}"
            ) from None
        raise ModelFileError(f"{path} is a truncated or corrupt GGUF file ({msg}); download or convert it again") from None
    except (IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError, MemoryError) as exc:
        raise ModelFileError(f"{path} is a truncated or corrupt GGUF file ({type(exc).__name__}: {exc}); "
                             "download or convert it again") from None
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size or t.data.nbytes < int(t.n_bytes):
            raise ModelFileError(
                f"{path} is truncated: tensor {t.name} needs bytes up to {t.data_offset + int(t.n_bytes)}, "
                f"the file has {size}; download or convert it again")
    return reader


def read_config(path: Path, reader=None):
    """``(Architecture, typed config)`` of a GGUF file from its metadata.

    Raises:
        UnsupportedArchitectureError: an architecture gemmaspec does not implement.
        ModelFileError: unreadable file or a required key missing.
    """
    meta = GGUFMeta(reader if reader is not None else open_reader(path), path)
    arch = by_name(meta.arch, str(path))
    return arch, arch.config_class.from_gguf(meta)


def _dense(t) -> torch.Tensor:
    """A ReaderTensor as float32 (dequantized when quantized, through ``gguf.quants``) in torch's dim
    order; integer tensors become int64."""
    qtype = T(t.tensor_type)
    shape = [int(x) for x in reversed(t.shape.tolist())]
    data = np.asarray(t.data)
    if qtype in _INTEGER:
        return torch.from_numpy(np.array(data, dtype=np.int64)).reshape(shape)
    if qtype == T.BF16:
        bits = np.ascontiguousarray(data).view(np.int16).astype(np.int32) << 16
        return torch.from_numpy(bits).view(torch.float32).reshape(shape)
    if qtype in (T.F32, T.F16):
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32)).reshape(shape)


_INTEGER = (T.I8, T.I16, T.I32, T.I64)


def _check_type(t) -> T:
    """The tensor's GGML type. Raises ModelFileError for one gemmaspec cannot use."""
    qtype = T(t.tensor_type)
    if qtype not in DENSE and qtype not in SUPPORTED_QUANT and qtype not in _INTEGER:
        raise ModelFileError(
            f"tensor {t.name} has type {qtype.name}, which gemmaspec does not support; "
            f"supported: {', '.join(SUPPORTED_TYPES)}; re-quantize the model with one of them")
    return qtype


def convert_tensor(t):
    """One ``ReaderTensor`` in the engine's form: a block-quantized matrix stays quantized (a Q4_0
    of a type in ``STORED_TYPES`` as stored, :class:`StoredWeight`; other types as :class:`QuantizedWeight`, exact int8 levels +
    fp32 scales; embeddings included, rows are dequantized on lookup); everything else (F32/F16/BF16, 1-D, quantized tensors of more than two
    dims such as MoE experts) becomes float32, integer tensors int64.

    Raises:
        ModelFileError: a tensor type gemmaspec cannot use.
    """
    qtype = _check_type(t)
    shape = [int(x) for x in reversed(t.shape.tolist())]  # torch order: [..., ne1, ne0]
    if qtype in DENSE or qtype in _INTEGER:
        return _dense(t)
    if len(shape) != 2:
        return _dense(t)
    n, k = shape
    if qtype.name in STORED_TYPES:
        raw = np.ascontiguousarray(np.asarray(t.data, dtype=np.uint8)).reshape(n, -1)
        return StoredWeight(torch.from_numpy(raw.copy()), qtype.name, k)
    q, s, o, g = to_int8_blocks(np.asarray(t.data), qtype, n, k)
    return QuantizedWeight(torch.from_numpy(q), torch.from_numpy(s), None if o is None else torch.from_numpy(o), g)


def _prepared_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{FORMAT_VERSION}".encode()).hexdigest()[:20]
    return cache_home() / "prepared" / key


def _save_prepared(dest: Path, loaded: LoadedModel) -> None:
    from safetensors.torch import save_file

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
    try:
        flat, layout = {}, {}
        for name, w in loaded.model.weights.items():
            if isinstance(w, StoredWeight):
                flat[name + ".raw"] = w.raw
                layout[name] = {"kind": "stored", "qtype": w.qtype, "k": w.k}
            elif isinstance(w, QuantizedWeight):
                flat[name + ".q"], flat[name + ".scale"] = w.q, w.scale
                if w.offset is not None:
                    flat[name + ".offset"] = w.offset
                layout[name] = {"kind": "quant", "group": w.group, "offset": w.offset is not None}
            else:
                flat[name] = w.contiguous()
                layout[name] = {"kind": "dense"}
        save_file(flat, str(tmp / "weights.safetensors"))
        if loaded.tokenizer is not None:
            loaded.tokenizer.save(tmp)
        meta = {"format_version": FORMAT_VERSION, "source": str(loaded.path), "arch": loaded.arch.name,
                "config": json.loads(loaded.config.to_json()), "layout": layout,
                "tokenizer": loaded.tokenizer is not None}
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.replace(tmp, dest)
        except OSError:  # another process prepared it first
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _load_prepared(dest: Path, path: Path) -> LoadedModel | None:
    from safetensors.torch import load_file

    try:
        meta = json.loads((dest / "meta.json").read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            return None
        arch = by_name(meta["arch"], str(path))
        flat = load_file(str(dest / "weights.safetensors"))
        weights = {}
        for name, info in meta["layout"].items():
            if info["kind"] == "stored":
                weights[name] = StoredWeight(flat[name + ".raw"], info["qtype"], info["k"])
            elif info["kind"] == "quant":
                weights[name] = QuantizedWeight(flat[name + ".q"], flat[name + ".scale"],
                                                flat.get(name + ".offset"), info["group"])
            else:
                weights[name] = flat[name]
        tok = GemmaTokenizer.load(dest) if meta["tokenizer"] else None
        cfg = arch.config_class.from_json(json.dumps(meta["config"]))
        model = arch.build(cfg, weights)
    except Exception:  # a damaged or outdated cache entry is rebuilt, never trusted
        shutil.rmtree(dest, ignore_errors=True)
        return None
    return LoadedModel(path, arch, cfg, model, tok)


def load_gguf(path: str | os.PathLike, use_cache: bool = True) -> LoadedModel:
    """Read a GGUF of any architecture in :mod:`~gemmaspec.models.registry`: typed config from the
    metadata, weights in engine form (:func:`convert_tensor`), the built model, the tokenizer
    (targets only). With ``use_cache`` the result is kept in the prepared-model cache.

    Raises:
        ModelFileError: missing, unreadable, non-GGUF, truncated or corrupt file, unsupported
            tensor type, missing tensors or metadata.
        UnsupportedArchitectureError: not a supported architecture.
    """
    path = Path(path)
    check_file(path)
    dest = _prepared_dir(path)
    if use_cache and dest.exists():
        loaded = _load_prepared(dest, path)
        if loaded is not None:
            return loaded
    reader = open_reader(path)
    arch, config = read_config(path, reader)
    for t in reader.tensors:  # refuse an unusable file before announcing the conversion
        _check_type(t)
    if use_cache:
        print(f"gemmaspec: preparing {path.name} for first use (converting {len(reader.tensors)} tensors"
              f"{', building the tokenizer' if arch.role == 'target' else ''}); later starts reuse the result",
              file=sys.stderr)
    weights = {}
    from tqdm import tqdm

    for t in tqdm(reader.tensors, desc="converting tensors", unit="tensor", disable=not sys.stderr.isatty(),
                  leave=False):
        weights[t.name] = convert_tensor(t)
    model = build_model(arch, config, weights, path)
    tokenizer = GemmaTokenizer.from_gguf(path, reader) if arch.role == "target" else None
    loaded = LoadedModel(path, arch, config, model, tokenizer)
    if use_cache:
        _save_prepared(dest, loaded)
    return loaded


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
