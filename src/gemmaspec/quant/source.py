"""The checkpoint that ``quantize --exact`` packs and ``verify`` checks against, read in bounded memory.

A GGUF file with BF16/F16/F32 tensors (any architecture: metadata and tensor names are kept), or a
Hugging Face Gemma 4 target or assistant directory (in llama.cpp's naming and metadata, through
:func:`gemmaspec.loading.convert.hf_source`). Tensors are :class:`~gemmaspec.loading.stored.StoredTensor`
read with ``pread`` a block of rows at a time (:func:`row_spans`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np

from ..errors import ModelFileError
from ..loading.convert import hf_source
from ..loading.gguf import open_reader
from ..loading.stored import StoredTensor, gguf_index

CHUNK_VALUES = 4 << 20  # values per block of rows read at once
COPY_BYTES = 64 << 20  # bytes per read when raw data is copied or compared


@dataclass
class Source:
    """A checkpoint to read.

    Attributes:
        path: the GGUF file or Hugging Face directory.
        arch: ``general.architecture`` of the output.
        tensors: (GGUF name, StoredTensor or a small computed float32 ndarray) in write order.
        add_metadata: ``add_metadata(writer, file_type)`` adds every key-value pair of the output.
        nbytes: size on disk.
        alignment: the GGUF data alignment to keep.
        notes: what the report should say about the input.
    """

    path: Path
    arch: str
    tensors: list[tuple[str, StoredTensor | np.ndarray]]
    add_metadata: Callable[[gguf.GGUFWriter, int], None]
    nbytes: int
    alignment: int = gguf.GGUF_DEFAULT_ALIGNMENT
    notes: list[str] = field(default_factory=list)


def row_spans(t: StoredTensor, values: int = CHUNK_VALUES) -> Iterator[tuple[int, int]]:
    """(r0, r1) row ranges of ``t`` covering it in order, about ``values`` values each (at least a row)."""
    step = max(1, values // t.row_len)
    for r0 in range(0, t.rows, step):
        yield r0, min(t.rows, r0 + step)


def open_source(path: str | os.PathLike) -> Source:
    """A GGUF file or a Hugging Face Gemma 4 directory as a :class:`Source`.

    Raises:
        ModelFileError: missing, corrupt, truncated or unsupported input.
    """
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path} does not exist; give a GGUF file or a Hugging Face checkpoint directory")
    if path.is_dir():
        arch, tensors, add_metadata = hf_source(path)
        nbytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        notes = []
        if any(n.startswith("masked_embd_") for n, _ in tensors):
            notes.append("the assistant's clustered-head tensors (masked_embd_centroids, masked_embd_ordering) are "
                         "kept; llama.cpp's converter drops them")
        return Source(path, arch, tensors, add_metadata, nbytes, notes=notes)
    reader = open_reader(path)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if not arch:
        raise ModelFileError(f"{path} has no general.architecture; it is not a model GGUF")
    tensors = list(gguf_index(path, reader).items())
    # written again by the output's writer: the architecture, the new file type, the alignment kept
    fields = [f for name, f in reader.fields.items()
              if not name.startswith("GGUF.") and name not in ("general.architecture", "general.file_type", "general.alignment")]

    def add_metadata(w: gguf.GGUFWriter, file_type: int) -> None:
        for f in fields:
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
            w.add_key_value(f.name, f.contents(), vtype, sub)
        w.add_file_type(file_type)

    return Source(path, arch, tensors, add_metadata, path.stat().st_size, int(reader.alignment))
