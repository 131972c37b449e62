"""Putting the pieces together: a ready engine from a model path (or the default model) and a device,
and the drafter that ``--spec-type`` asks for."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from .engine import Engine
from .errors import GemmaspecError, InputError
from .kernels import load_library
from .loading import load_checkpoint
from .quant.qat import looks_qat
from .speculative.options import SPEC_TYPES, check_spec_flags, parse_spec_type, spec_model_type, spec_parts


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` → CUDA when available, else CPU. Raises InputError for an unavailable device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for, but this PyTorch sees no CUDA GPU; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise InputError(f"--device must be auto, cpu or cuda (got {device})")
    return torch.device(device)


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads of one core counted once), from Linux's
    CPU topology; the number of usable CPUs where the topology cannot be read."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list").read_text().strip())
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def set_threads(threads: int | None) -> None:
    """Use ``threads`` CPU threads (``-t``; default: the physical cores this process may run on, since
    a second hyper-thread of a core adds no memory bandwidth to a memory-bound decode).

    Raises:
        InputError: threads < 1.
    """
    if threads is not None and threads < 1:
        raise InputError(f"threads must be >= 1 (got {threads})")
    torch.set_num_threads(threads if threads is not None else physical_cores())


def load_engine(path=None, ctx_size: int | None = None, device: str = "auto", threads: int | None = None) -> Engine:
    """A ready :class:`Engine`.

    Args:
        path: GGUF file or Hugging Face checkpoint directory (None: the default model).
        ctx_size: context size in tokens; None = min(4096, the model's), 0 = the model's.

    Raises:
        GemmaspecError: bad file, unsupported model, bad device or context size.
    """
    from .heap import startup_heap

    with startup_heap():  # no full garbage collection while loading; what is loaded is frozen
        return _load_engine(path, ctx_size, device, threads)


def _load_engine(path, ctx_size, device, threads) -> Engine:
    set_threads(threads)
    loaded = load_checkpoint(path, resolve_device(device), role="target")
    if loaded.model.device.type == "cpu":
        load_library()  # a first start compiles the kernel here, so it counts as loading, not as prefill
    if ctx_size is None:  # default: 4096, or the model's context when that is smaller
        ctx_size = min(4096, loaded.config.context_length)
    ctx = ctx_size if ctx_size > 0 else loaded.config.context_length
    if ctx > loaded.config.context_length:
        raise InputError(f"-c {ctx} exceeds the model's context of {loaded.config.context_length} tokens")
    if ctx < 2:
        raise InputError(f"-c must be at least 2 (got {ctx})")
    return Engine(loaded.model, loaded.tokenizer, ctx, model_path=loaded.path)


def load_drafter(spec_type: str | None, engine: Engine, draft_model: str | None = None, p_min: float | None = None,
                 ngram_max: int = 4, ngram_min: int = 1):
    """The drafter for ``--spec-type``, for requests run in the engine's own cache.

    Raises:
        InputError: unknown type, missing or incompatible ``-md`` model, bad values.
    """
    return drafter_factory(spec_type, engine, draft_model, p_min, ngram_max, ngram_min)[1](engine.cache)


from .loading.shipped import shipped_assistant, shipped_assistant_entry  # noqa: E402,F401


def drafter_factory(spec_type: str | None, engine: Engine, draft_model: str | None = None, p_min: float | None = None,
                    ngram_max: int = 4, ngram_min: int = 1):
    """Load what ``--spec-type`` needs once (a draft model, an assistant) and return
    ``(spec_type, make)`` with ``make(cache) -> Drafter``: a fresh drafter for requests that run in
    the target KV cache ``cache`` (drafters keep per-request state, so each concurrently served slot
    needs its own; a draft model's weights are shared, each drafter gets its own draft cache).

    ``spec_type`` None picks llama-server's default: ``ngram-simple`` without ``-md``; with ``-md``,
    ``draft-mtp`` when it is an assistant checkpoint and ``draft-simple`` when it is a model. A list
    (``ngram-simple,draft-mtp``, see :func:`~gemmaspec.speculative.options.parse_spec_type`) gives a
    :class:`~gemmaspec.speculative.drafters.ChainDrafter` of each type's drafter; ``default`` may
    resolve to one (the shipped assistant's ``default_spec``). ``p_min`` None: the drafter's default
    (0 for a draft model and an assistant, the ``p_min`` measured for an assistant gemmaspec ships);
    ``make.p_min`` says the value in use.

    Raises:
        InputError: unknown type, missing or incompatible ``-md`` model, bad values.
    """
    from .speculative.drafters import (DraftModelDrafter, MTPDrafter, NgramDrafter, NoDrafter, check_mtp_pair,
                                       check_same_vocabulary)

    spec_type = check_spec_flags(spec_type, draft_model, p_min)
    if spec_type in (None, "default") and not draft_model:
        entry = shipped_assistant_entry(getattr(engine, "model_path", None))
        default = (entry or {}).get("default_spec", "ngram-simple")
        if entry and "draft-mtp" in spec_parts(default):
            spec_type, draft_model = default, entry["path"]
            print(f"speculation: {default} with the assistant shipped for this model ({entry['file']}, "
                  f"p-min {_assistant_p_min(p_min, entry):g}; "
                  f"{entry.get('why', '')})", file=sys.stderr)
        else:
            if entry:
                print(f"speculation: ngram-simple ({entry.get('why', '')})", file=sys.stderr)
            spec_type = "ngram-simple"
    if spec_type is not None and "," in spec_type:  # a list: each type's drafter, first proposal wins
        from .speculative.drafters import ChainDrafter

        model_type = spec_model_type(spec_type)
        parts = [drafter_factory(t, engine, draft_model if t == model_type else None, p_min, ngram_max, ngram_min)
                 for t in spec_parts(spec_type)]
        name = ",".join(real for real, _ in parts)
        make = lambda cache: ChainDrafter([m(cache) for _, m in parts])  # noqa: E731
        make.p_min = max(getattr(m, "p_min", 0.0) for _, m in parts)
        return name, make
    if spec_type == "none":
        return spec_type, lambda cache: NoDrafter()
    if spec_type == "ngram-simple":
        NgramDrafter(ngram_max, ngram_min)  # check the sizes now
        return spec_type, lambda cache: NgramDrafter(ngram_max, ngram_min)
    if not draft_model and spec_type == "draft-mtp":  # the assistant shipped for this target, if any
        entry = shipped_assistant_entry(getattr(engine, "model_path", None))
        draft_model = entry["path"] if entry else None
        if draft_model:
            print(f"draft-mtp: the assistant shipped for this model ({Path(draft_model).name}, "
                  f"p-min {_assistant_p_min(p_min, entry):g})", file=sys.stderr)
    if not draft_model:
        what = "the target's assistant: -md ASSISTANT (directory or .gguf)" if spec_type == "draft-mtp" \
            else "a draft model: -md DRAFT.gguf"
        raise InputError(f"--spec-type {spec_type} needs {what}")
    role = {"draft-mtp": "assistant", "draft-simple": "target", None: None}[spec_type]
    draft = load_checkpoint(draft_model, engine.model.device, role=role)
    if draft.arch.role == "assistant":
        assistant = draft.model
        check_mtp_pair(engine.model, assistant)
        warning = qat_mismatch_warning(engine.model, assistant)
        if warning:
            print(warning, file=sys.stderr)
        if p_min is None:  # an assistant gemmaspec ships: the p-min measured for it
            entry = shipped_assistant_entry(getattr(engine, "model_path", None))
            same = entry is not None and Path(entry["path"]).resolve() == Path(draft_model).resolve()
            p_min = _assistant_p_min(None, entry if same else None)
        make = lambda cache: MTPDrafter(assistant, engine.model, cache, p_min)  # noqa: E731
        make.p_min = p_min
        return "draft-mtp", make
    check_same_vocabulary(engine.tokenizer, draft.tokenizer)
    p_min = 0.0 if p_min is None else p_min
    make = lambda cache: DraftModelDrafter(draft.model, engine.ctx_size, p_min)  # noqa: E731
    make.p_min = p_min
    return "draft-simple", make


def _assistant_p_min(p_min: float | None, entry: dict | None) -> float:
    """The assistant's p-min: ``--spec-draft-p-min`` when given, else the value measured for the
    shipped assistant of ``entry`` (``assistants.json``), else 0."""
    if p_min is not None:
        return p_min
    return float(entry.get("p_min", 0.0)) if entry else 0.0


def resolve_models(args) -> None:
    """Turn known model names in ``-m`` / ``-md`` into their cached paths and, when
    ``--spec-draft-n-max`` is not given, take the catalog's recommended draft length (else 3).

    Raises:
        InputError: an unknown name (close matches listed) or one not downloaded yet.
    """
    from .loading import catalog
    from .loading.hub import resolve

    args.model, target = resolve(args.model)
    draft = None
    if getattr(args, "model_draft", None):
        args.model_draft, draft = resolve(args.model_draft)
    if hasattr(args, "spec_draft_n_max") and args.spec_draft_n_max is None:
        rec = catalog.draft_n_max(target, draft) if (draft is not None or args.spec_type in (None, "ngram-simple")) \
            else None
        args.spec_draft_n_max = str(rec[0]) if rec else "3"


def drafter_file(spec_type: str | None, draft_model: str | None, model: str | None) -> str | None:
    """The file the drafter of ``spec_type`` loads (``-md``, or the assistant shipped for ``model``
    that ``draft-mtp`` and ``default`` take without one; None without ``-md`` is ``default``, as in
    :func:`drafter_factory`), or None when it loads none."""
    spec_type = parse_spec_type(spec_type)
    if draft_model:
        return draft_model if spec_type is None or spec_model_type(spec_type) else None
    if model is None:  # no -m: the default model, as load_engine loads it
        from .loading.default_model import default_model_path

        model = default_model_path()
    if spec_type in (None, "default"):
        entry = shipped_assistant_entry(model)
        return entry["path"] if entry and "draft-mtp" in spec_parts(entry.get("default_spec", "")) else None
    return shipped_assistant(model) if spec_model_type(spec_type) == "draft-mtp" else None


def memory_estimate(args, slots: int = 1, caches: int | None = None):
    """``fit``'s estimate for the model flags of ``args`` on ``args.device``, refused when it does not
    fit; returned for printing once the model is loaded.

    Raises:
        InputError: the setup does not fit (with the numbers), or a bad ``-c``.
        ModelFileError: an unreadable model file (as loading would say).
    """
    from .loading.fit import check_fits, estimate, free_memory, read_model

    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None  # load_engine says so
    target = read_model(args.model)
    if target.role != "target":
        return None  # load_checkpoint refuses it with its own message
    draft_file = drafter_file(args.spec_type, args.model_draft, args.model)
    draft = read_model(draft_file) if draft_file else None
    est = estimate(target, draft, args.ctx_size, caches or slots, device, free_memory(device))
    check_fits(est)
    return est


def qat_mismatch_warning(target, assistant) -> str | None:
    """A warning when one of a target/assistant pair is QAT (4-bit grid weights) and the other is not:
    Google's model card pairs QAT targets with QAT assistants only. None when they match."""
    if getattr(assistant, "token_map", None) is not None:
        return None  # trained by gemmaspec train-drafter against its target: --qat there is about its own export
    name = "blk.0.attn_q.weight"  # every architecture's first query projection (GGUF naming)
    t, a = looks_qat(target.weights[name]), looks_qat(assistant.weights[name])
    if t == a:
        return None
    kind = lambda q: "QAT (4-bit grid)" if q else "non-QAT"  # noqa: E731
    return (f"warning: the target's weights are {kind(t)} but the assistant's are {kind(a)}; Google pairs QAT "
            "targets with QAT assistants (*-qat-q4_0-unquantized-assistant) and acceptance may drop")


__all__ = ["load_engine", "load_drafter", "drafter_factory", "drafter_file", "resolve_device", "resolve_models", "memory_estimate",
           "GemmaspecError", "SPEC_TYPES"]
