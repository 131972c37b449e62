"""Loading Hugging Face checkpoints: a directory with ``config.json`` and ``model.safetensors``
(or shards listed in ``model.safetensors.index.json``), for every architecture in
:mod:`gemmaspec.models.registry` that reads ``config.json``.

The ``model_type`` picks the registry entry; its ``hf_name`` maps each checkpoint tensor name onto
the GGUF name the model uses (text weights of multimodal checkpoints included; vision and audio
towers skipped). Tensors are located from each file's safetensors header and read one at a time (or
a block of rows at a time, for converters) by :class:`~gemmaspec.loading.stored.StoredTensor`, then
widened to float32.
"""

from __future__ import annotations

import json
from pathlib import Path


from ..errors import ModelFileError
from ..models.registry import by_hf_model_type
from .stored import safetensors_index

def read_config(path: Path) -> dict:
    """``config.json`` of a checkpoint directory as a dict.

    Raises:
        ModelFileError: no directory, no config.json, or it is not valid JSON.
    """
    if not path.is_dir():
        raise ModelFileError(f"{path} is not a checkpoint directory (expected config.json and *.safetensors)")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelFileError(f"{path} has no config.json; it is not a Hugging Face checkpoint")
    try:
        return json.loads(cfg_file.read_text())
    except (ValueError, OSError) as exc:
        raise ModelFileError(f"{cfg_file} is not valid JSON ({exc})") from None


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, OSError) as exc:
            raise ModelFileError(f"{index} is not a valid safetensors index ({exc})") from None
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ModelFileError(f"{path} has no *.safetensors weights")
    return found


def lazy_tensors(path: Path) -> dict:
    """Every tensor of a checkpoint directory under its stored name, nothing read yet: name →
    :class:`~gemmaspec.loading.stored.StoredTensor` (read rows on demand, in bounded memory).

    Raises:
        ModelFileError: a shard is missing, truncated or not safetensors.
    """
    out = {}
    for shard in _shards(path):
        if not shard.exists():
            raise ModelFileError(f"{shard} is listed in the index but missing")
        out.update(safetensors_index(shard))
    return out


def hf_checkpoint(path: str | Path):
    """What a checkpoint directory holds, nothing read yet.

    Returns:
        ``(arch, config, raw_config, tensors)``: the registry entry, its typed config, the
        ``config.json`` dict, and GGUF name → StoredTensor for the tensors the model uses.

    Raises:
        UnsupportedArchitectureError: a ``model_type`` no registry entry reads.
        ModelFileError: unreadable files or a bad config.
    """
    path = Path(path)
    cfg = read_config(path)
    arch = by_hf_model_type(cfg.get("model_type"), str(path))
    try:
        config = arch.config_from_hf(cfg)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(f"{path}/config.json: {exc}") from None
    return arch, config, cfg, gguf_named(path, arch, config)


def gguf_named(path: Path, arch, config) -> dict:
    """A checkpoint directory's tensors (lazy :class:`StoredTensor`) under the GGUF names ``arch.hf_name``
    gives them; tensors it maps to None (not this part of the model) are left out."""
    tensors = {}
    for name, t in lazy_tensors(path).items():
        gname = arch.hf_name(name, config)
        if gname is not None:
            tensors[gname] = t
    return tensors


def load_hf_dir(path: str | Path):
    """A Hugging Face checkpoint directory as a built model, float32 (integer buffers as int64).

    Returns:
        :class:`~gemmaspec.loading.gguf.LoadedModel` (tokenizer from ``tokenizer.json`` for targets
        that have one, else None: :func:`gemmaspec.loading.load_checkpoint` refuses a target without
        one).

    Raises:
        UnsupportedArchitectureError: not a supported ``model_type``.
        ModelFileError: unreadable files, bad config, or a tensor the architecture needs is missing.
    """
    from ..tokenizer import GemmaTokenizer
    from .gguf import LoadedModel, build_model

    path = Path(path)
    arch, config, cfg, tensors = hf_checkpoint(path)
    weights = {}
    for name, t in tensors.items():
        v = t.load()
        if not v.is_floating_point():
            v = v.long()
        elif arch.hf_value is not None:
            v = arch.hf_value(name, v)
        weights[name] = v
    model = build_model(arch, config, weights, path)
    has_tok = arch.role == "target" and (path / "tokenizer.json").exists()
    tokenizer = GemmaTokenizer.from_hf_dir(path, cfg) if has_tok else None
    return LoadedModel(path, arch, config, model, tokenizer)
