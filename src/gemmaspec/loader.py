"""Building a ready engine from a model path (or the default model) and a device."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .engine import Engine
from .errors import GemmaspecError, InputError
from .kernels import QuantizedWeight
from .loading.default_model import default_model_path
from .loading.gguf import LoadedModel, load_gguf
from .models.gemma3 import Gemma3Model


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` → CUDA when available, else CPU. Raises InputError for an unavailable device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for, but this PyTorch sees no CUDA GPU; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise InputError(f"--device must be auto, cpu or cuda (got {device})")
    return torch.device(device)


def set_threads(threads: int | None) -> None:
    """Use ``threads`` CPU threads (default: all cores this process may run on)."""
    if threads is not None and threads < 1:
        raise InputError(f"threads must be >= 1 (got {threads})")
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(threads)


def load_model(path: str | os.PathLike | None, device: torch.device) -> tuple[Gemma3Model, LoadedModel]:
    """Load a GGUF (the default model when ``path`` is None) onto ``device``."""
    p = Path(path) if path else default_model_path()
    loaded = load_gguf(p)
    weights = loaded.weights
    if device.type != "cpu":
        weights = {k: (v.to(device) if isinstance(v, (QuantizedWeight, torch.Tensor)) else v) for k, v in weights.items()}
    return Gemma3Model(loaded.config, weights, device), loaded


def load_engine(path=None, ctx_size: int = 4096, device: str = "auto", threads: int | None = None) -> Engine:
    """A ready :class:`Engine`.

    Raises:
        GemmaspecError: bad file, unsupported model, bad device or context size.
    """
    set_threads(threads)
    dev = resolve_device(device)
    model, loaded = load_model(path, dev)
    ctx = ctx_size if ctx_size > 0 else loaded.config.context_length
    if ctx > loaded.config.context_length:
        raise InputError(f"-c {ctx} exceeds the model's context of {loaded.config.context_length} tokens")
    if ctx < 2:
        raise InputError(f"-c must be at least 2 (got {ctx})")
    return Engine(model, loaded.tokenizer, ctx)


SPEC_TYPES = ("none", "ngram-simple", "draft-simple", "draft-mtp")


def load_drafter(spec_type: str, engine: Engine, draft_model: str | None = None, p_min: float = 0.0,
                 ngram_max: int = 4, ngram_min: int = 1):
    """The drafter for ``--spec-type``.

    Raises:
        InputError: unknown type, missing or incompatible ``-md`` model, bad values.
    """
    from .speculative.drafters import DraftModelDrafter, NgramDrafter, NoDrafter, check_same_vocabulary

    if spec_type not in SPEC_TYPES:
        raise InputError(f"--spec-type must be one of {', '.join(SPEC_TYPES)} (got {spec_type})")
    if not 0.0 <= p_min <= 1.0:
        raise InputError(f"--spec-draft-p-min must be in [0, 1] (got {p_min})")
    if spec_type != "draft-simple" and draft_model:
        raise InputError(f"-md is used by --spec-type draft-simple, not {spec_type}")
    if spec_type == "none":
        return NoDrafter()
    if spec_type == "ngram-simple":
        return NgramDrafter(ngram_max, ngram_min)
    if spec_type == "draft-mtp":
        raise InputError("--spec-type draft-mtp needs a Gemma 4 target and its MTP assistant; Gemma 4 support "
                         "is not in this release. Use ngram-simple or draft-simple")
    if not draft_model:
        raise InputError("--spec-type draft-simple needs a draft model: -md DRAFT.gguf")
    device = engine.model.device
    model, loaded = load_model(draft_model, device)
    check_same_vocabulary(engine.tokenizer, loaded.tokenizer)
    return DraftModelDrafter(model, engine.ctx_size, p_min)


__all__ = ["load_engine", "load_model", "load_drafter", "resolve_device", "GemmaspecError", "SPEC_TYPES"]
