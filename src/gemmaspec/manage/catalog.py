"""The catalog of known checkpoints (``catalog.json`` beside this module): Gemma 4 targets and their
MTP assistants in bf16, QAT and GGUF form, the exact-Q4_0 QAT drafters, the embedded default
model (a base model) and the Gemma 3 instruction-tuned GGUFs to chat with (:data:`CHAT_MODELS`). Each
entry names its source (a key of the file's ``sources``), its role, its pair and, for drafting, the
draft length used when ``--spec-draft-n-max`` is not given (with that number's source).

Entry fields: ``name`` (what ``-m``/``-md``/``pull`` accept, case-insensitive), ``repo`` (Hugging
Face repo id, None when unknown), ``file`` (one file of the repo; absent for checkpoint
directories) or ``file_glob``/``exclude_glob`` (picked from the repo listing), ``sha256`` (checked
after download), ``role`` (``target``/``assistant``), ``qat``, ``assistant`` / ``target`` (the pair's
name), ``draft_n_max`` + ``draft_n_max_source``, ``hf_equivalent`` (the safetensors checkpoint a GGUF
was made from, for servers that need one), ``placeholder`` (listed, not available), ``note``.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..errors import InputError

CATALOG_FILE = Path(__file__).with_name("catalog.json")


@dataclass(frozen=True)
class Entry:
    """One catalog entry (see the module docstring for the fields)."""

    name: str
    role: str
    source: str
    repo: str | None = None
    file: str | None = None
    file_glob: str | None = None
    exclude_glob: str | None = None
    sha256: str | None = None
    format: str | None = None
    qat: bool = False
    assistant: str | None = None
    target: str | None = None
    draft_n_max: int | None = None
    draft_n_max_source: str | None = None
    spec_type: str | None = None
    hf_equivalent: str | None = None
    package: str | None = None
    default: bool = False
    placeholder: bool = False
    note: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def is_dir(self) -> bool:
        """A checkpoint directory (config.json + safetensors), not one file."""
        return self.file is None and self.file_glob is None and self.package is None


@lru_cache(maxsize=1)
def _load() -> tuple[dict[str, str], tuple[Entry, ...]]:
    data = json.loads(CATALOG_FILE.read_text())
    known = set(Entry.__dataclass_fields__) - {"extra"}
    entries = tuple(Entry(**{k: v for k, v in m.items() if k in known},
                          extra={k: v for k, v in m.items() if k not in known}) for m in data["models"])
    return data["sources"], entries


CHAT_MODELS = ("gemma-3-1b-it", "gemma-3-270m-it", "gemma-3-4b-it")
"""Instruction-tuned Gemma 3 GGUFs of the catalog to chat with, in the order to try them (1B: useful answers
on a small CPU; 270M: the fastest; 4B: the best answers, the slowest)."""


def base_model_note() -> str:
    """What to tell someone about to chat with a base model (one line, no leading ``note:``): that it
    continues text rather than answering, and which catalog models to use instead."""
    first, *others = CHAT_MODELS
    return (f"this is a base (pretrained) model: its file has no chat template, and it continues text rather than "
            f"answering; to chat, use an instruction-tuned model: `gemmaspec pull {first}`, then `-m {first}` "
            f"(also {', '.join(others)})")


def is_base(tokenizer) -> bool:
    """Whether the model behind ``tokenizer`` is a base (pretrained) model, decided from its file: no chat
    template in its metadata (a GGUF's ``tokenizer.chat_template``; a checkpoint's
    ``tokenizer_config.json`` or ``chat_template.jinja``), as for the embedded default model.
    Instruction-tuned Gemma files carry their template."""
    return not getattr(tokenizer, "chat_template_from_file", None)


def entries() -> tuple[Entry, ...]:
    """Every catalog entry, in file order."""
    return _load()[1]


def sources() -> dict[str, str]:
    """Source key → citation (URL and what it says)."""
    return _load()[0]


def find(name: str) -> Entry | None:
    """The entry called ``name`` (case-insensitive), or None."""
    low = name.strip().lower()
    return next((e for e in entries() if e.name == low), None)


def by_file(filename: str) -> Entry | None:
    """The entry whose ``file`` is ``filename`` (its base name), or None: lets a pull of ``REPO:FILE``
    check the catalog's sha256 whatever repository serves the file."""
    base = Path(filename).name
    return next((e for e in entries() if e.file == base and e.sha256), None)


def close_matches(name: str, n: int = 5) -> list[str]:
    """Catalog names that look like ``name`` (``difflib``), best first; the names containing it when
    difflib finds none."""
    names = [e.name for e in entries()]
    low = name.strip().lower()
    found = difflib.get_close_matches(low, names, n=n, cutoff=0.6)
    return found or [m for m in names if low and low in m][:n]


def get(name: str) -> Entry:
    """The entry called ``name``.

    Raises:
        InputError: no such entry (the message lists close matches and ``gemmaspec models``).
    """
    e = find(name)
    if e is None:
        near = close_matches(name)
        hint = f"; close matches: {', '.join(near)}" if near else ""
        raise InputError(f"{name!r} is neither a file nor a known model name{hint} (gemmaspec models lists them)")
    return e


def pair(entry: Entry) -> Entry | None:
    """The entry's partner: a target's assistant (a QAT target gets its QAT assistant), an
    assistant's target; None when it has none."""
    other = entry.assistant if entry.role == "target" else entry.target
    return find(other) if other else None


def draft_n_max(target: Entry | None, assistant: Entry | None) -> tuple[int, str] | None:
    """``(n_max, source)`` to use when ``--spec-draft-n-max`` is not given: the assistant's
    recommendation, else the target's; None when neither entry has one."""
    for e in (assistant, target):
        if e is not None and e.draft_n_max is not None:
            return e.draft_n_max, sources().get(e.draft_n_max_source or "", e.draft_n_max_source or "")
    return None
