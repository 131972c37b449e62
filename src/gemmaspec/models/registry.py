"""The architectures gemmaspec implements, keyed by the checkpoint's own architecture name.

One entry per architecture (in the spirit of mlx-lm's one file per model): how to read its typed
config from GGUF metadata and from a Hugging Face ``config.json``, which class builds it, how a
Hugging Face checkpoint's tensor names map onto the one naming convention every model here uses
(llama.cpp's GGUF names, ``blk.N.attn_q.weight``; plus any value fix, such as Gemma 3's norms), and its role (a ``target`` generates text; an
``assistant`` only drafts for a target, ``--spec-type draft-mtp``).

The loaders (:mod:`gemmaspec.loading`) look architectures up here and hand back built model objects;
no module outside ``models/`` and ``loading/`` asks which architecture it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .config import Gemma3Config, Gemma4AssistantConfig, Gemma4Config
from ..errors import UnsupportedArchitectureError
from .gemma3 import Gemma3Model, hf_to_gguf_value
from .gemma3 import hf_to_gguf_name as gemma3_hf_name
from .gemma4 import Gemma4Model, hf_to_gguf_name
from .gemma4_assistant import Gemma4Assistant
from . import gemma3_vision, gemma4_vision


@dataclass(frozen=True)
class Architecture:
    """What it takes to load one architecture.

    Attributes:
        name: GGUF ``general.architecture`` (``gemma3``, ``gemma4``, ``gemma4-assistant``).
        role: ``"target"`` or ``"assistant"``.
        config_class: typed config with ``from_gguf(meta)``, ``from_json(text)`` and, where Hugging
            Face checkpoints are supported, ``from_hf(config.json dict)``.
        build: ``(config, weights, device) -> model``; raises KeyError naming a missing tensor.
        hf_model_types: ``config.json`` ``model_type`` values this entry reads (empty: GGUF only).
        hf_name: ``(checkpoint tensor name, config) -> GGUF name``, or None for a tensor the model
            does not use (the ``sanitize`` step).
        hf_value: ``(GGUF name, float32 tensor) -> tensor``: a value fix a checkpoint's convention
            needs (Gemma 3 norms: ``1 + weight``); None: values are used as stored.
        pairs: (vision towers) the ``general.architecture`` of the targets whose images it encodes.
    """

    name: str
    role: str
    config_class: type
    build: Callable
    hf_model_types: tuple[str, ...] = ()
    hf_name: Callable | None = None
    hf_value: Callable | None = None
    pairs: tuple[str, ...] = ()

    def config_from_hf(self, cfg: dict):
        """The typed config from a ``config.json`` dict.

        Raises:
            ValueError: a required key is missing or a value is inconsistent.
        """
        return self.config_class.from_hf(cfg)


def _layers(config) -> int:
    return getattr(config, "text", config).num_layers


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("gemma3", "target", Gemma3Config, Gemma3Model, hf_model_types=("gemma3_text", "gemma3"),
                     hf_name=lambda name, config: gemma3_hf_name(name, config.num_layers),
                     hf_value=hf_to_gguf_value),
        Architecture("gemma4", "target", Gemma4Config, Gemma4Model,
                     hf_model_types=("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"),
                     hf_name=lambda name, config: hf_to_gguf_name(name, config.num_layers)),
        Architecture("gemma4-assistant", "assistant", Gemma4AssistantConfig, Gemma4Assistant,
                     hf_model_types=("gemma4_assistant", "gemma4_unified_assistant"),
                     hf_name=lambda name, config: hf_to_gguf_name(name, _layers(config))),
    )
}


VISION_TOWERS: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("gemma3", "vision", gemma3_vision.Gemma3VisionConfig, gemma3_vision.Gemma3Vision,
                     hf_model_types=("gemma3",),
                     hf_name=lambda name, config: gemma3_vision.hf_to_gguf_name(name, config.num_layers),
                     hf_value=gemma3_vision.hf_to_gguf_value, pairs=("gemma3",)),
        Architecture("gemma4v", "vision", gemma4_vision.Gemma4VisionConfig, gemma4_vision.Gemma4Vision,
                     hf_model_types=("gemma4",),
                     hf_name=lambda name, config: gemma4_vision.hf_to_gguf_name(name, config.num_layers),
                     hf_value=gemma4_vision.hf_to_gguf_value, pairs=("gemma4",)),
    )
}
"""Vision towers (``--mmproj``), keyed by llama.cpp's projector type (an mmproj GGUF's
``clip.projector_type``, or ``clip.vision.projector_type`` in a file that also holds an audio
encoder); ``hf_model_types``: the multimodal ``config.json`` ``model_type`` they read; ``pairs``: the
target architectures they serve."""


def vision_by_projector(projector: str, where: str = "") -> Architecture:
    """The vision tower for an mmproj GGUF's ``clip.projector_type``.

    Raises:
        UnsupportedArchitectureError: not implemented (names those that are).
    """
    if projector not in VISION_TOWERS:
        raise UnsupportedArchitectureError(
            f"{where}: vision projector '{projector}' is not supported; supported: {', '.join(VISION_TOWERS)}")
    return VISION_TOWERS[projector]


def vision_by_hf_model_type(model_type, where: str = "") -> Architecture:
    """The vision tower of a multimodal ``config.json`` ``model_type``.

    Raises:
        UnsupportedArchitectureError: no vision tower reads it.
    """
    for arch in VISION_TOWERS.values():
        if model_type in arch.hf_model_types:
            return arch
    raise UnsupportedArchitectureError(
        f"{where}: model_type '{model_type}' has no supported vision tower; supported: "
        f"{', '.join(t for a in VISION_TOWERS.values() for t in a.hf_model_types)}")


def vision_for(target_arch: str) -> list[str]:
    """The vision towers (projector types) that serve a target architecture."""
    return [a.name for a in VISION_TOWERS.values() if target_arch in a.pairs]


def by_name(name: str, where: str = "") -> Architecture:
    """The entry for a GGUF ``general.architecture``.

    Raises:
        UnsupportedArchitectureError: not implemented (names the supported ones).
    """
    if name not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{where}: architecture '{name}' is not supported; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def by_hf_model_type(model_type, where: str = "") -> Architecture:
    """The entry for a Hugging Face ``config.json`` ``model_type``.

    Raises:
        UnsupportedArchitectureError: no entry reads it (names those that do).
    """
    for arch in ARCHITECTURES.values():
        if model_type in arch.hf_model_types:
            return arch
    known = [t for a in ARCHITECTURES.values() for t in a.hf_model_types]
    raise UnsupportedArchitectureError(
        f"{where}: model_type '{model_type}' is not supported; supported: {', '.join(known)}")
