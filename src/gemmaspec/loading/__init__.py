"""Checkpoint loading: GGUF files (llama.cpp), Hugging Face checkpoint directories, the default model.

:func:`load_checkpoint` is the one entry point: any path, any architecture of
:mod:`gemmaspec.models.registry`, a built model back, with its role checked.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import InputError, ModelFileError
from ..manage.default_model import default_model_path
from .gguf import LoadedModel, load_gguf
from .safetensors import load_hf_dir

_ROLE_HINT = {  # by the role the checkpoint has, when the other one was asked for
    "assistant": "pass it as -md with --spec-type draft-mtp, and its target model as -m",
    "target": "-md for --spec-type draft-mtp takes the assistant (drafter) released with the target",
}


def load_checkpoint(path: str | os.PathLike | None, device: torch.device | str = "cpu", role: str | None = None,
                    use_cache: bool = True) -> LoadedModel:
    """Load a model: a GGUF file (the default model when ``path`` is None) or a Hugging Face
    checkpoint directory, built and moved to ``device``.

    Args:
        path: GGUF file or checkpoint directory; None = the embedded default model.
        device: where the weights go.
        role: ``"target"`` or ``"assistant"`` to refuse a checkpoint of the other role; None = either.
        use_cache: take a GGUF's tokenizer from the tokenizer cache (building and saving it on first
            use); False builds it and writes nothing. Weights are never cached: they are used
            straight from the mapped file.

    Raises:
        ModelFileError / UnsupportedArchitectureError: unreadable or unsupported checkpoint.
        InputError: a checkpoint of the wrong role (an assistant given as the model to generate with,
            or a target given as the assistant).
    """
    p = Path(path) if path else default_model_path()
    loaded = load_hf_dir(p) if p.is_dir() else load_gguf(p, use_cache=use_cache)
    if role is not None and loaded.arch.role != role:
        what = "an assistant (a drafter" if loaded.arch.role == "assistant" else "a target model ("
        sep = ", " if loaded.arch.role == "assistant" else ""
        raise InputError(f"{p} is {what}{sep}{loaded.arch.name}), not {'a target model' if role == 'target' else 'an assistant'}; "
                         f"{_ROLE_HINT[loaded.arch.role]}")
    if loaded.arch.role == "target" and role == "target" and loaded.tokenizer is None:
        raise ModelFileError(f"{p} has no tokenizer.json; gemmaspec needs the checkpoint's tokenizer to generate text")
    device = torch.device(device)
    if device.type != "cpu":
        loaded.model = loaded.model.to(device)
    else:
        from .. import kernels

        if loaded.arch.role == "target":  # a mid-sized model's head and layers: int8 activations under auto
            head, nbytes = getattr(loaded.model, "head", None), step_bytes(loaded.model)
            kernels.auto_q8_head(nbytes, head)
            kernels.auto_q8_layers(nbytes, [w for w in product_weights(loaded.model) if w is not head])
        kernels.regroup_in_background(product_weights(loaded.model))
    return loaded


def step_bytes(model) -> int:
    """Bytes of weights one decode step of ``model`` reads: every entry of ``model.weights`` (its
    memory held, ``nbytes``) except the token-embedding tables a token only looks up a row of
    (``token_embd`` unless it is also the head, Gemma 4's ``per_layer_token_embd``). What
    :func:`~gemmaspec.kernels.resolve_act_quant`, :func:`~gemmaspec.kernels.auto_q8_head` and
    :func:`~gemmaspec.kernels.auto_q8_layers` decide ``--act-quant auto`` by."""
    head = getattr(model, "head", None)
    total = 0
    for name, t in getattr(model, "weights", {}).items():
        if name.endswith("token_embd.weight") and t is not head:
            continue
        total += int(getattr(t, "nbytes", 0))
    return total


def product_weights(model) -> list:
    """The weights of ``model`` that products run on, in the order a forward reaches them, the head
    last: every entry of ``model.weights`` but token-embedding tables that are only looked up by row
    (``token_embd``, Gemma 4's ``per_layer_token_embd``), a tied head counted once, as the head."""
    head = getattr(model, "head", None)
    ws = [w for name, w in getattr(model, "weights", {}).items()
          if w is not head and not name.endswith("token_embd.weight")]
    return ws + ([head] if head is not None else [])


__all__ = ["LoadedModel", "load_checkpoint", "default_model_path", "product_weights"]
