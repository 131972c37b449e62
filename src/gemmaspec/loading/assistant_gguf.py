"""Trainable assistants for a target, and their GGUF: what ``gemmaspec train-drafter`` builds and writes.

:func:`new_trainable_assistant` makes the assistant architecture drafter training uses (today the
Gemma 4 assistant, :mod:`gemmaspec.models.gemma4_assistant_train`) sized for a target;
:func:`export_gguf` writes one as a ``gemma4-assistant`` GGUF that gemmaspec loads as a ``draft-mtp``
drafter.

Metadata as llama.cpp's converter writes for Google's assistants (the text keys of
:func:`gemmaspec.loading.convert._add_text_params`, ``embedding_length_out``, ``nextn_predict_layers``,
a ``rope_freqs`` tensor marking the rotated frequencies), plus what a reduced head needs and llama.cpp
does not know: the ``draft_token_map`` tensor (I32 [N], the target id of each head row) and the key
``gemma4-assistant.target_vocab_size``. No tokenizer: the assistant drafts in its target's vocabulary
and gemmaspec takes the tokenizer from the target.

Types: norms and the map as stored (F32, I32); matrices ``q4_0`` (the weights must already lie on the
Q4_0 grid: QAT; every block is checked to round-trip bit-exactly, else the export fails), ``q8_0``,
``f16`` or ``f32``.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from ..errors import InputError
from ..models.config import Gemma4AssistantConfig
from ..models.gemma4_assistant_train import TrainableAssistant, assistant_config
from .convert import ARCH_ASSISTANT, _add_text_params, _rope_freqs
from .gguf_out import StreamingGGUF, encode_rows

T = gguf.GGMLQuantizationType
TYPES = {"q4_0": T.Q4_0, "q8_0": T.Q8_0, "f16": T.F16, "f32": T.F32}
FILE_TYPES = {T.Q4_0: 2, T.Q8_0: 7, T.F16: 1, T.F32: 0}


def new_trainable_assistant(target_config, token_map: torch.Tensor, width: int = 256, layers: int = 4,
                            heads: int = 4, ffn: int = 1024, seed: int = 0) -> TrainableAssistant:
    """A freshly initialised trainable assistant for a target with config ``target_config`` (Gemma 3
    or Gemma 4), its head covering the target ids ``token_map`` (int64 [N]).

    Raises:
        ValueError: the target lacks the attention layer types an assistant reads.
    """
    cfg = assistant_config(target_config, width, layers, heads, ffn, int(token_map.numel()))
    return TrainableAssistant(cfg, token_map, seed=seed)


def export_gguf(config: Gemma4AssistantConfig, weights: dict[str, torch.Tensor], out: str | Path,
                outtype: str = "q8_0", name: str = "gemmaspec assistant", force: bool = True) -> dict:
    """Write ``weights`` (GGUF names → float32 tensors; ``draft_token_map`` int) to ``out``.

    Returns:
        ``{"bytes": file size, "types": {type name: tensor count}}``.

    Raises:
        InputError: unknown ``outtype``; ``q4_0`` for weights that are not on the Q4_0 grid.
    """
    if outtype not in TYPES:
        raise InputError(f"drafter export type must be one of {', '.join(TYPES)} (got {outtype})")
    qtype = TYPES[outtype]
    c = config.text
    types: dict[str, int] = {}
    with StreamingGGUF(out, "gemma4-assistant", force) as s:
        tensors = [("rope_freqs.weight", torch.from_numpy(_rope_freqs(c)))] + sorted(weights.items())
        for tname, t in tensors:
            if tname == "draft_token_map":
                kind, data = T.I32, t.to(torch.int32).numpy()
            elif t.dim() == 2 and t.shape[1] % 32 == 0:
                kind = qtype
                arr = t.detach().float().numpy()
                data = encode_rows(arr, kind)
                if kind == T.Q4_0:
                    back = gguf.quants.dequantize(data, kind).reshape(arr.shape)
                    if not np.array_equal(back, arr):
                        bad = int((back != arr).sum())
                        raise InputError(f"{tname}: {bad} of {arr.size} values are not on the Q4_0 grid; train with "
                                         "--qat q4_0 to export q4_0, or export q8_0")
            else:
                kind, data = T.F32, t.detach().float().numpy()
            s.begin(tname, tuple(t.shape), kind)
            s.write(data)
            s.end()
            types[kind.name] = types.get(kind.name, 0) + 1
        n_ff = [c.intermediate_size] * c.num_layers

        def meta(w: gguf.GGUFWriter) -> None:
            w.add_name(name)
            w.add_file_type(FILE_TYPES[qtype])
            _add_text_params(w, c, n_ff)
            w.add_embedding_length_out(config.backbone_hidden_size)
            w.add_nextn_predict_layers(c.num_layers)
            w.add_uint32("gemma4-assistant.target_vocab_size", c.vocab_size)
            w.add_bool("tokenizer.ggml.add_bos_token", True)

        size = s.finish(meta)
    return {"bytes": size, "types": types}


def trainable_state_from_gguf(path: str | Path) -> dict:
    """A reduced-head assistant GGUF (as :func:`export_gguf` writes) as a trainable assistant's start
    (``train-drafter --init``): ``{"model": state dict of float32 tensors, "token_map": int64 [N],
    "settings": {"width", "layers", "heads", "ffn"}}`` (Q4_0 / Q8_0 / F16 matrices dequantized).

    Raises:
        ValueError: not a ``gemma4-assistant`` GGUF with a reduced head (``draft_token_map``).
    """
    path = Path(path)
    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims fastest first
        arr = gguf.quants.dequantize(t.data, t.tensor_type) if t.tensor_type not in (
            gguf.GGMLQuantizationType.I32,) else np.asarray(t.data)
        tensors[t.name] = torch.from_numpy(np.array(arr).reshape(shape))
    if arch != ARCH_ASSISTANT or "draft_token_map" not in tensors:
        raise ValueError(f"{path}: --init needs an assistant GGUF with a reduced head (draft_token_map), as "
                         f"train-drafter writes; this file is {arch!r}"
                         + ("" if arch != ARCH_ASSISTANT else " with a full or clustered head"))
    layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
    head_dim = tensors["blk.0.attn_q_norm.weight"].shape[0]
    settings = {"width": tensors["output_norm.weight"].shape[0], "layers": layers,
                "heads": tensors["blk.0.attn_q.weight"].shape[0] // head_dim,
                "ffn": tensors["blk.0.ffn_gate.weight"].shape[0]}
    state = {"params." + n.replace(".", "__"): v.float() for n, v in tensors.items()
             if n not in ("draft_token_map", "rope_freqs.weight")}
    return {"model": state, "token_map": tensors["draft_token_map"].long(), "settings": settings}
