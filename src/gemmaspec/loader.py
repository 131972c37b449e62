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


def load_model(path: str | os.PathLike | None, device: torch.device):
    """Load a model onto ``device``: a GGUF file (the default model when ``path`` is None) or a
    Hugging Face checkpoint directory (Gemma 4). Returns ``(model, LoadedModel)``."""
    p = Path(path) if path else default_model_path()
    if p.is_dir():
        return _load_hf_target(p, device)
    loaded = load_gguf(p)
    if loaded.model is not None:  # Gemma 4 GGUF
        from .models.gemma4 import Gemma4Model

        if not isinstance(loaded.model, Gemma4Model):
            raise InputError(f"{p} is a Gemma 4 assistant (drafter), not a model to generate with; "
                             "pass it as -md with --spec-type draft-mtp")
        model = loaded.model.to(device) if device.type != "cpu" else loaded.model
        return model, loaded
    weights = loaded.weights
    if device.type != "cpu":
        weights = {k: (v.to(device) if isinstance(v, (QuantizedWeight, torch.Tensor)) else v) for k, v in weights.items()}
    return Gemma3Model(loaded.config, weights, device), loaded


def _load_hf_target(path: Path, device: torch.device):
    from .loading.safetensors import load_gemma4_dir, read_config
    from .tokenizer import GemmaTokenizer

    config, model = load_gemma4_dir(path)
    tokenizer = GemmaTokenizer.from_hf_dir(path, read_config(path))
    if device.type != "cpu":
        model = model.to(device)
    return model, LoadedModel(path, config, model.w, tokenizer, {})


def load_engine(path=None, ctx_size: int | None = None, device: str = "auto", threads: int | None = None) -> Engine:
    """A ready :class:`Engine`.

    Args:
        path: GGUF file or Gemma 4 checkpoint directory (None: the default model).
        ctx_size: context size in tokens; None = min(4096, the model's), 0 = the model's.

    Raises:
        GemmaspecError: bad file, unsupported model, bad device or context size.
    """
    set_threads(threads)
    dev = resolve_device(device)
    model, loaded = load_model(path, dev)
    if ctx_size is None:  # default: 4096, or the model's context when that is smaller
        ctx_size = min(4096, loaded.config.context_length)
    ctx = ctx_size if ctx_size > 0 else loaded.config.context_length
    if ctx > loaded.config.context_length:
        raise InputError(f"-c {ctx} exceeds the model's context of {loaded.config.context_length} tokens")
    if ctx < 2:
        raise InputError(f"-c must be at least 2 (got {ctx})")
    return Engine(model, loaded.tokenizer, ctx)


SPEC_TYPES = ("none", "ngram-simple", "draft-simple", "draft-mtp")


def load_assistant(path):
    """A Gemma 4 assistant from a checkpoint directory or a ``gemma4-assistant`` GGUF.

    Raises:
        GemmaspecError: unreadable, or not an assistant.
    """
    from .loading.safetensors import load_gemma4_assistant_dir
    from .models.gemma4_assistant import Gemma4Assistant

    p = Path(path)
    if p.is_dir():
        return load_gemma4_assistant_dir(p)
    loaded = load_gguf(p, use_cache=False)
    if not isinstance(loaded.model, Gemma4Assistant):
        raise InputError(f"{p} is not a Gemma 4 assistant (architecture {loaded.config.architecture}); "
                         "-md for --spec-type draft-mtp takes the assistant released with the target")
    return loaded.model


def load_drafter(spec_type: str, engine: Engine, draft_model: str | None = None, p_min: float = 0.0,
                 ngram_max: int = 4, ngram_min: int = 1):
    """The drafter for ``--spec-type``, for requests run in the engine's own cache.

    Raises:
        InputError: unknown type, missing or incompatible ``-md`` model, bad values.
    """
    return drafter_factory(spec_type, engine, draft_model, p_min, ngram_max, ngram_min)(engine.cache)


def drafter_factory(spec_type: str, engine: Engine, draft_model: str | None = None, p_min: float = 0.0,
                    ngram_max: int = 4, ngram_min: int = 1):
    """Load what ``--spec-type`` needs once (a draft model, an assistant) and return
    ``make(cache) -> Drafter``: a fresh drafter for requests that run in the target KV cache
    ``cache`` (drafters keep per-request state, so each concurrently served slot needs its own; a
    draft model's weights are shared, each drafter gets its own draft cache).

    Raises:
        InputError: unknown type, missing or incompatible ``-md`` model, bad values.
    """
    from .speculative.drafters import DraftModelDrafter, NgramDrafter, NoDrafter, check_same_vocabulary

    if spec_type not in SPEC_TYPES:
        raise InputError(f"--spec-type must be one of {', '.join(SPEC_TYPES)} (got {spec_type})")
    if not 0.0 <= p_min <= 1.0:
        raise InputError(f"--spec-draft-p-min must be in [0, 1] (got {p_min})")
    if spec_type not in ("draft-simple", "draft-mtp") and draft_model:
        raise InputError(f"-md is used by --spec-type draft-simple or draft-mtp, not {spec_type}")
    if spec_type == "none":
        return lambda cache: NoDrafter()
    if spec_type == "ngram-simple":
        NgramDrafter(ngram_max, ngram_min)  # check the sizes now
        return lambda cache: NgramDrafter(ngram_max, ngram_min)
    if spec_type == "draft-mtp":
        from .speculative.drafters import MTPDrafter, check_mtp_pair

        if not draft_model:
            raise InputError("--spec-type draft-mtp needs the target's assistant: -md ASSISTANT (directory or .gguf)")
        assistant = load_assistant(draft_model)
        warning = check_mtp_pair(engine.model, assistant)
        if warning:
            import sys

            print(warning, file=sys.stderr)
        return lambda cache: MTPDrafter(assistant, engine.model, cache)
    if not draft_model:
        raise InputError("--spec-type draft-simple needs a draft model: -md DRAFT.gguf")
    device = engine.model.device
    model, loaded = load_model(draft_model, device)
    check_same_vocabulary(engine.tokenizer, loaded.tokenizer)
    return lambda cache: DraftModelDrafter(model, engine.ctx_size, p_min)


__all__ = ["load_engine", "load_model", "load_drafter", "drafter_factory", "resolve_device", "GemmaspecError", "SPEC_TYPES"]
