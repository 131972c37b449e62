"""``gemmaspec inspect``: what a GGUF file holds (architecture, typed config, tensor types, tokenizer),
read from its header and tensor table only (no tensor data is read)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from .gguf import GGUFMeta, open_reader, read_config


def _config_lines(cfg, indent: str = "  ") -> list[str]:
    lines = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            lines.append(f"{indent}{f.name}:")
            lines += _config_lines(v, indent + "  ")
            continue
        if f.name == "layer_types":
            v = "".join("F" if t == "full" else "s" for t in v) + "  (s = sliding window, F = full attention)"
        lines.append(f"{indent}{f.name}: {v}")
    return lines


def describe_gguf(path: str | Path) -> str:
    """A human-readable summary of a GGUF model file (several lines, no trailing newline).

    Raises:
        ModelFileError: missing, not GGUF, truncated or corrupt; UnsupportedArchitectureError.
    """
    path = Path(path)
    header = open_reader(path)
    meta = GGUFMeta(header, path)
    arch, cfg = read_config(path, header)
    out = [f"file: {path} ({path.stat().st_size / 1e6:.1f} MB)", f"architecture: {arch.name} ({arch.role})"]
    name = meta.get("general.name")
    if name is not None:
        out.append(f"name: {name}")
    out.append("config:")
    out += _config_lines(cfg)
    counts, nbytes = Counter(), Counter()
    for t in header.tensors:
        counts[t.tensor_type.name] += 1
        nbytes[t.tensor_type.name] += t.n_bytes
    out.append(f"tensors: {len(header.tensors)}")
    for ty, n in counts.most_common():
        out.append(f"  {ty:6s} {n:4d} tensors  {nbytes[ty] / 1e6:8.1f} MB")
    if arch.role == "assistant":
        out.append(f"assistant for a target of width {cfg.backbone_hidden_size}; clustered head: "
                   f"{'yes (centroids + token ordering)' if cfg.clustered else 'no (full tied head)'}")
    n_tok = meta.array_len("tokenizer.ggml.tokens") or 0
    template = "yes" if meta.get("tokenizer.chat_template") is not None else "no (built-in Gemma template used)"
    out.append(f"tokenizer: {meta.get('tokenizer.ggml.model', '?')}, {n_tok} tokens, chat template: {template}")
    return "\n".join(out)
