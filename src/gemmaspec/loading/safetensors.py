"""Loading Hugging Face checkpoints: a directory with ``config.json`` and ``model.safetensors``
(or shards listed in ``model.safetensors.index.json``).

Text weights of multimodal checkpoints (``model.language_model.*``) and of text-only ones
(``model.*``) load under the text model's names; vision and audio towers are skipped. Tensors are
located from each file's safetensors header and read one at a time (or a block of rows at a time,
for converters) by :class:`~gemmaspec.loading.stored.StoredTensor`, then widened to float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import Gemma4Config
from ..errors import ModelFileError, UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
ASSISTANT_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_SKIP = ("vision_tower", "audio_tower", "embed_vision", "embed_audio", "multi_modal_projector")


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


def _text_name(name: str) -> str | None:
    if any(s in name for s in _SKIP):
        return None
    if name == "lm_head.weight":
        return name
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def load_tensors(path: Path, strip_prefix: bool = True) -> dict:
    """Text-model tensors of a checkpoint directory: floating point ones as float32, integer ones
    (index buffers) as stored. Names lose the text prefix unless ``strip_prefix`` is False.

    Raises:
        ModelFileError: a shard is missing, truncated or not safetensors.
    """
    return {name: t.load() for name, t in lazy_tensors(path, strip_prefix).items()}


def lazy_tensors(path: Path, strip_prefix: bool = True) -> dict:
    """Like :func:`load_tensors`, but nothing is read yet: name → :class:`~gemmaspec.loading.stored.StoredTensor`
    (read rows on demand, in bounded memory).

    Raises:
        ModelFileError: a shard is missing, truncated or not safetensors.
    """
    from .stored import safetensors_index

    out = {}
    for shard in _shards(path):
        if not shard.exists():
            raise ModelFileError(f"{shard} is listed in the index but missing")
        for name, t in safetensors_index(shard).items():
            text = _text_name(name) if strip_prefix else name
            if text is not None:
                out[text] = t
    return out


def load_gemma4_dir(path: str | Path):
    """``(config, Gemma4Model)`` of a Gemma 4 text (or multimodal) checkpoint directory, float32.

    Raises:
        UnsupportedArchitectureError: the checkpoint is not a Gemma 4 model.
        ModelFileError: unreadable files, bad config, or a tensor the architecture needs is missing.
    """
    from ..models.gemma4 import Gemma4Model

    path = Path(path)
    cfg = read_config(path)
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{path}: model_type '{mtype}' is not supported here; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        config = Gemma4Config.from_hf(cfg)
        config.kv_source()
    except ValueError as exc:
        raise ModelFileError(f"{path}/config.json: {exc}") from None
    weights = load_tensors(path)
    try:
        model = Gemma4Model(config, weights)
    except KeyError as exc:
        raise ModelFileError(f"{path}: tensor {exc.args[0]} is missing; the checkpoint is incomplete") from None
    return config, model


def load_gemma4_assistant_dir(path: str | Path):
    """A Gemma 4 assistant (MTP drafter) checkpoint directory as a
    :class:`~gemmaspec.models.gemma4_assistant.Gemma4Assistant`.

    Raises:
        UnsupportedArchitectureError: not a ``gemma4_assistant`` checkpoint.
        ModelFileError: unreadable files, bad config, a missing tensor.
    """
    from ..models.gemma4_assistant import Gemma4Assistant

    path = Path(path)
    cfg = read_config(path)
    if cfg.get("model_type") not in ASSISTANT_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{path}: model_type '{cfg.get('model_type')}' is not a Gemma 4 assistant ({', '.join(ASSISTANT_MODEL_TYPES)}); "
            "-md for --spec-type draft-mtp takes the assistant checkpoint that ships with the target")
    try:
        text = Gemma4Config.from_hf(cfg.get("text_config") or {})
        backbone = int(cfg["backbone_hidden_size"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(f"{path}/config.json: {exc}") from None
    clustered = None
    if cfg.get("use_ordered_embeddings"):
        clustered = (int(cfg.get("num_centroids", 2048)), int(cfg.get("centroid_intermediate_top_k", 32)))
    weights = load_tensors(path, strip_prefix=False)
    try:
        return Gemma4Assistant(text, backbone, weights, clustered)
    except KeyError as exc:
        raise ModelFileError(f"{path}: tensor {exc.args[0]} is missing; the checkpoint is incomplete") from None
