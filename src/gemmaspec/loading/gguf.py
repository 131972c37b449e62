"""Loading Gemma models from GGUF files (llama.cpp's format), through the ``gguf`` package.

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

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from ..config import Gemma3Config
from ..errors import ModelFileError, UnsupportedArchitectureError
from ..kernels import QuantizedWeight
from ..paths import cache_home
from ..tokenizer import GemmaTokenizer
from .ggml_blocks import DENSE, SUPPORTED_QUANT, to_int8_blocks

SUPPORTED_ARCHITECTURES = ("gemma3", "gemma4", "gemma4-assistant")
SUPPORTED_TYPES = tuple(t.name for t in DENSE + SUPPORTED_QUANT)
FORMAT_VERSION = 1
GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedModel:
    """A model ready to build: config, weights (name → tensor or QuantizedWeight) and tokenizer."""

    path: Path
    config: Gemma3Config
    weights: dict
    tokenizer: GemmaTokenizer | None
    tensor_types: dict  # name -> GGML type name, as stored in the file
    model: object = None  # a built model (Gemma 4 paths build it while loading)


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
    """``gguf.GGUFReader`` over ``path``, with corrupt and truncated files reported clearly."""
    from gguf import GGUFReader

    check_file(path)
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
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


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def architecture_of(reader) -> str:
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError("the GGUF has no general.architecture key; it is not a model file")
    return arch


def config_from_reader(reader, path: Path):
    """The typed config from the file's metadata: :class:`Gemma3Config` (with Gemma 3 defaults for
    keys it omits) or, for ``gemma4`` / ``gemma4-assistant``, :class:`Gemma4Config`.

    Raises:
        UnsupportedArchitectureError: the file is not a Gemma 3 text model.
        ModelFileError: a required key is missing.
    """
    arch = architecture_of(reader)
    if arch in ("gemma4", "gemma4-assistant"):
        from .gemma4_gguf import config_from_gguf

        return config_from_gguf(reader, path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: architecture '{arch}' is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def req(key):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelFileError(f"{path}: required metadata key {arch}.{key} is missing")
        return v

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelFileError(f"{path}: the file has no tokenizer (tokenizer.ggml.tokens); it cannot generate text")
    head_dim = int(req("attention.key_length"))
    scaling = _field(reader, f"{arch}.rope.scaling.factor")
    return Gemma3Config(
        vocab_size=len(tokens.data),
        hidden_size=int(req("embedding_length")),
        num_layers=int(req("block_count")),
        intermediate_size=int(req("feed_forward_length")),
        num_heads=int(req("attention.head_count")),
        num_kv_heads=int(req("attention.head_count_kv")),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        context_length=int(_field(reader, f"{arch}.context_length", 32768)),
        sliding_window=int(_field(reader, f"{arch}.attention.sliding_window", 512)),
        rope_theta_global=float(_field(reader, f"{arch}.rope.freq_base", 1_000_000.0)),
        rope_scaling_factor=float(scaling) if scaling else 1.0,
        query_pre_attn_scalar=float(head_dim),
        final_logit_softcapping=_field(reader, f"{arch}.final_logit_softcapping"),
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 2)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 1)),
        architecture=arch,
    )


def convert_tensor(t):
    """One ``ReaderTensor`` → float32 tensor (F32/F16/BF16) or :class:`QuantizedWeight`.

    Raises:
        ModelFileError: a tensor type gemmaspec cannot use.
    """
    qtype = T(t.tensor_type)
    shape = [int(x) for x in reversed(t.shape.tolist())]  # torch order: [..., ne1, ne0]
    if qtype in DENSE:
        data = np.asarray(t.data)
        if qtype == T.BF16:
            arr = torch.from_numpy(np.ascontiguousarray(data).view(np.int16).astype(np.int32) << 16).view(torch.float32)
        else:
            arr = torch.from_numpy(np.array(data, dtype=np.float32))
        return arr.reshape(shape)
    if qtype not in SUPPORTED_QUANT:
        raise ModelFileError(
            f"tensor {t.name} has type {qtype.name}, which gemmaspec does not support; "
            f"supported: {', '.join(SUPPORTED_TYPES)}; re-quantize the model with one of them")
    k = shape[-1]
    n = int(np.prod(shape[:-1]))
    q, s, o, g = to_int8_blocks(np.asarray(t.data), qtype, n, k)
    return QuantizedWeight(torch.from_numpy(q), torch.from_numpy(s), None if o is None else torch.from_numpy(o), g)


def _prepared_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{FORMAT_VERSION}".encode()).hexdigest()[:20]
    return cache_home() / "prepared" / key


def _save_prepared(dest: Path, path: Path, config, weights, tokenizer, types) -> None:
    from safetensors.torch import save_file

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
    try:
        flat, layout = {}, {}
        for name, w in weights.items():
            if isinstance(w, QuantizedWeight):
                flat[name + ".q"], flat[name + ".scale"] = w.q, w.scale
                if w.offset is not None:
                    flat[name + ".offset"] = w.offset
                layout[name] = {"kind": "quant", "group": w.group, "offset": w.offset is not None}
            else:
                flat[name] = w.contiguous()
                layout[name] = {"kind": "dense"}
        save_file(flat, str(tmp / "weights.safetensors"))
        tokenizer.save(tmp)
        meta = {"format_version": FORMAT_VERSION, "source": str(path), "config": json.loads(config.to_json()),
                "layout": layout, "tensor_types": types}
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
        flat = load_file(str(dest / "weights.safetensors"))
        weights = {}
        for name, info in meta["layout"].items():
            if info["kind"] == "quant":
                weights[name] = QuantizedWeight(flat[name + ".q"], flat[name + ".scale"],
                                                flat.get(name + ".offset"), info["group"])
            else:
                weights[name] = flat[name]
        tok = GemmaTokenizer.load(dest)
        cfg = Gemma3Config.from_json(json.dumps(meta["config"]))
    except Exception:  # a damaged cache entry is rebuilt, never trusted
        shutil.rmtree(dest, ignore_errors=True)
        return None
    return LoadedModel(path, cfg, weights, tok, meta["tensor_types"])


def load_gguf(path: str | os.PathLike, use_cache: bool = True) -> LoadedModel:
    """Read a Gemma GGUF: config, weights in engine form, tokenizer.

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
    interactive = sys.stderr.isatty()
    if interactive:
        print(f"gemmaspec: preparing {path.name} for first use (reading the GGUF, converting weights, building the "
              "tokenizer); later starts reuse the result", file=sys.stderr)
    reader = open_reader(path)
    arch = architecture_of(reader)
    if arch in ("gemma4", "gemma4-assistant"):
        from .gemma4_gguf import load_gemma4_gguf

        config, model = load_gemma4_gguf(path, reader)
        tok = GemmaTokenizer.from_gguf(path, reader) if arch == "gemma4" else None
        types = {t.name: T(t.tensor_type).name for t in reader.tensors}
        return LoadedModel(path, config, getattr(model, "w", {}), tok, types, model)
    config = config_from_reader(reader, path)
    weights, types = {}, {}
    from tqdm import tqdm

    for t in tqdm(reader.tensors, desc="converting tensors", unit="tensor", disable=not interactive, leave=False):
        types[t.name] = T(t.tensor_type).name
        weights[t.name] = convert_tensor(t)
    _check_tensors(config, weights, path)
    tokenizer = GemmaTokenizer.from_gguf(path, reader)
    if use_cache:
        _save_prepared(dest, path, config, weights, tokenizer, types)
    return LoadedModel(path, config, weights, tokenizer, types)


def _check_tensors(cfg: Gemma3Config, w: dict, path: Path) -> None:
    need = ["token_embd.weight", "output_norm.weight"]
    for i in range(cfg.num_layers):
        need += [f"blk.{i}.{n}.weight" for n in (
            "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
            "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")]
    missing = [n for n in need if n not in w]
    if missing:
        raise ModelFileError(f"{path}: {len(missing)} tensor(s) the {cfg.architecture} architecture needs are "
                             f"missing (first: {missing[0]}); the file is incomplete")
    emb = w["token_embd.weight"]
    if tuple(emb.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ModelFileError(f"{path}: token_embd has shape {tuple(emb.shape)}, expected "
                             f"({cfg.vocab_size}, {cfg.hidden_size}) from the metadata")
