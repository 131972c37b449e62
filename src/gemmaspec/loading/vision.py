"""Vision towers (``--mmproj``): loaded from llama.cpp's mmproj GGUF files and from Hugging Face
multimodal checkpoint directories, and written as mmproj GGUF files.

An mmproj GGUF has ``general.architecture = "clip"``, ``clip.projector_type`` (``gemma3``) or
``clip.vision.projector_type`` (``gemma4v``, whose files may also hold an audio encoder, unused here)
and the ``clip.vision.*`` keys of ``gguf.Keys.ClipVision``; tensors ``v.*`` (encoder) and ``mm.*``
(projector), as llama.cpp's ``convert_hf_to_gguf.py --mmproj`` writes them. A multimodal checkpoint
directory has ``config.json`` with ``vision_config`` and ``preprocessor_config.json`` (mean, std).
The tower's entry in :data:`gemmaspec.models.registry.VISION_TOWERS` gives its config class, its
builder and its tensor-name map.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from ..errors import InputError, ModelFileError
from ..models.registry import Architecture, vision_by_hf_model_type, vision_by_projector, vision_for
from .gguf import GGUFMeta, build_model, open_reader, tensor_weight
from .safetensors import gguf_named, hf_checkpoint, read_config


@dataclass
class LoadedVision:
    """A loaded vision tower: ``path``, ``arch`` (its registry entry), ``config``, ``model`` (with
    ``embed(images)``, ``image_tokens(image)``, ``image_text(n)``, ``placeholders()``,
    ``tokens_per_image``: the most an image gets)."""

    path: Path
    arch: Architecture
    config: object
    model: object


def _preprocessor(path: Path) -> dict:
    f = path / "preprocessor_config.json"
    if not f.exists():
        return {}
    try:
        return json.loads(f.read_text())
    except (ValueError, OSError) as exc:
        raise ModelFileError(f"{f} is not valid JSON ({exc})") from None


def _hf_vision(path: Path):
    """``(arch, config, GGUF name → StoredTensor)`` of a multimodal checkpoint's vision tower."""
    cfg = read_config(path)
    arch = vision_by_hf_model_type(cfg.get("model_type"), str(path))
    try:
        config = arch.config_class.from_hf(cfg, _preprocessor(path))
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(f"{path}/config.json: {exc}") from None
    return arch, config, gguf_named(path, arch, config)


def load_vision(path: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedVision:
    """A vision tower from an mmproj GGUF file or a multimodal checkpoint directory.

    Raises:
        ModelFileError: missing, unreadable or incomplete file; a GGUF that is not an mmproj
            (``general.architecture`` other than ``clip``) or has no vision encoder.
        UnsupportedArchitectureError: a projector type or ``model_type`` without a vision tower here.
    """
    p = Path(path)
    if p.is_dir():
        arch, config, stored = _hf_vision(p)
        weights = {}
        for name, t in stored.items():
            v = t.load()
            weights[name] = arch.hf_value(name, v) if arch.hf_value else v
    else:
        header = open_reader(p)
        meta = GGUFMeta(header, p)
        if meta.arch != "clip":
            raise ModelFileError(f"{p} is a {meta.arch} model, not an mmproj (vision projector) file; "
                                 "--mmproj takes the mmproj-*.gguf released with the model")
        if meta.get(gguf.Keys.Clip.HAS_VISION_ENCODER) is False:
            raise ModelFileError(f"{p} has no vision encoder (an audio-only projector); audio input is not supported")
        projector = meta.get(gguf.Keys.Clip.PROJECTOR_TYPE) or meta.get(gguf.Keys.ClipVision.PROJECTOR_TYPE)
        arch = vision_by_projector(str(projector), str(p))
        config = arch.config_class.from_gguf(meta)
        weights = {t.name: tensor_weight(header, t) for t in header.tensors
                   if t.name.startswith(("v.", "mm.")) and not t.name.startswith("mm.a.")}
    model = build_model(arch, config, weights, p)
    if torch.device(device).type != "cpu":
        model = model.to(device)
    return LoadedVision(p, arch, config, model)


def check_pair(vision: LoadedVision, target_config) -> None:
    """Refuse a tower made for another architecture, or whose output width is not the target's.

    Raises:
        InputError: the tower serves other models (says which projector this model needs), or the
            widths differ (names both).
    """
    target = getattr(target_config, "architecture", None)
    if target is not None and vision.arch.pairs and target not in vision.arch.pairs:
        wanted = vision_for(target)
        use = (f"pass the model's own mmproj file (projector type {' or '.join(wanted)})" if wanted
               else "this model takes no images in gemmaspec")
        raise InputError(f"{vision.path} is a {vision.arch.name} vision projector, made for "
                         f"{'/'.join(vision.arch.pairs)} models, but the model is {target}: {use}")
    width = getattr(target_config, "hidden_size", None)
    if width is not None and vision.config.text_hidden_size != width:
        raise InputError(f"{vision.path} projects images to width {vision.config.text_hidden_size}, but the model's "
                         f"width is {width}: pass the mmproj file released with this model")


def write_mmproj(checkpoint: str | os.PathLike, out: str | os.PathLike, force: bool = False,
                 outtype: str = "f16") -> Path:
    """Write a multimodal checkpoint directory's vision tower as an mmproj GGUF in llama.cpp's layout:
    ``clip`` metadata as its converter writes it, F32 embeddings and norms, F16 matrices and the
    projection (as its converter forces), nothing else (the text model converts separately).
    ``outtype`` ``f32`` keeps the matrices float32 too.

    Raises:
        InputError: OUT exists (without ``force``) or its folder does not.
        ModelFileError / UnsupportedArchitectureError: not a supported multimodal checkpoint.
    """
    src, out = Path(checkpoint), Path(out)
    if outtype not in ("f16", "f32"):
        raise InputError(f"mmproj output type {outtype!r}: use f16 (llama.cpp's) or f32")
    if out.exists() and not force:
        raise InputError(f"{out} exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise InputError(f"the folder {out.parent} does not exist; create it or write OUT elsewhere")
    arch, c, stored = _hf_vision(src)
    tmp = out.with_name(f".{out.name}.partial")
    w = gguf.GGUFWriter(tmp, "clip")
    try:
        add_mmproj_metadata(w, arch.name, c)
        for name in sorted(stored):
            v = stored[name].load()
            v = arch.hf_value(name, v) if arch.hf_value else v
            keep32 = outtype == "f32" or v.dim() == 1 or name.startswith(("v.patch_embd", "v.position_embd"))
            w.add_tensor(name, v.numpy().astype(np.float32 if keep32 else np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def add_mmproj_metadata(w: gguf.GGUFWriter, projector: str, c) -> None:
    """The ``clip`` metadata of an mmproj GGUF as llama.cpp's converter writes it, for tower config
    ``c`` (:class:`~gemmaspec.models.gemma3_vision.Gemma3VisionConfig` or its Gemma 4 peer) of
    projector type ``projector`` (``gemma3``, ``gemma4v``): what :func:`write_mmproj` and the
    synthetic towers of ``benchmarks/vision_encode.py`` write."""
    k = gguf.Keys.ClipVision
    w.add_type(gguf.GGUFType.MODEL)
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    extra = c.gguf_extra()
    if k.PROJECTOR_TYPE not in extra:  # gemma4v: the per-modality key, as llama.cpp's converter writes it
        w.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, projector)
    # a variable-resolution tower has no image size: llama.cpp's converter writes 224 (unused)
    for key, v in ((k.IMAGE_SIZE, getattr(c, "image_size", 224)), (k.PATCH_SIZE, c.patch_size),
                   (k.EMBEDDING_LENGTH, c.hidden_size),
                   (k.FEED_FORWARD_LENGTH, c.intermediate_size), (k.PROJECTION_DIM, c.text_hidden_size),
                   (k.BLOCK_COUNT, c.num_layers), (k.Attention.HEAD_COUNT, c.num_heads)):
        w.add_uint32(key, int(v))
    w.add_array(k.IMAGE_MEAN, [float(x) for x in c.image_mean])
    w.add_array(k.IMAGE_STD, [float(x) for x in c.image_std])
    w.add_float32(k.Attention.LAYERNORM_EPS, float(getattr(c, "layer_norm_eps", getattr(c, "rms_norm_eps", 1e-6))))
    w.add_bool(k.USE_GELU, True)
    for key, (kind, v) in extra.items():
        getattr(w, f"add_{kind}")(key, v)


__all__ = ["LoadedVision", "add_mmproj_metadata", "check_pair", "load_vision", "write_mmproj", "hf_checkpoint"]
