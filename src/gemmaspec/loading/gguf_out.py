"""Writing GGUF files tensor by tensor, in bounded memory, never leaving a partial file.

``gguf.GGUFWriter`` wants every tensor's type and size before the first byte of data, but an
encoder (the exact Q4_0 packer) only knows a tensor's type once it has seen all of its blocks.
:class:`StreamingGGUF` therefore writes tensor data to a scratch file beside OUT as it is produced
(each tensor padded to the file's alignment, exactly as GGUF lays the data section out), then lets
``GGUFWriter`` write the header, metadata and tensor table (:func:`write_header`) and appends the data. A tensor can be
discarded and written again with another type (an off-grid block found halfway through).
Everything goes to ``.OUT.partial`` files that are renamed at the end or removed on failure.

Format: GGUF v3 (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from ..errors import InputError


class StreamingGGUF:
    """A GGUF file under construction at ``out``.

    Use as a context manager; call :meth:`begin`, :meth:`write` (any number of times), :meth:`end`
    (or :meth:`discard`) per tensor, then :meth:`finish`. Leaving the block without ``finish`` (an
    exception) removes every scratch file; OUT is only ever replaced whole.

    Raises:
        InputError: OUT exists and ``force`` is False.
    """

    def __init__(self, out: str | os.PathLike, arch: str, force: bool = False,
                 alignment: int = gguf.GGUF_DEFAULT_ALIGNMENT):
        self.out = Path(out)
        if self.out.exists() and not force:
            raise InputError(f"{self.out} exists; pass --force to overwrite it")
        if self.out.is_dir():
            raise InputError(f"{self.out} is a directory; give a file name for the GGUF output")
        if not self.out.parent.is_dir():
            raise InputError(f"the folder {self.out.parent} does not exist; create it or write OUT elsewhere")
        self.arch, self.alignment = arch, int(alignment)
        self.tmp = self.out.with_name(f".{self.out.name}.partial")
        self.data_path = self.out.with_name(f".{self.out.name}.data.partial")
        self.data = None
        self.tensors: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]] = []
        self._current = None

    def __enter__(self):
        self.data = open(self.data_path, "w+b")
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.data is not None:
            self.data.close()
        for p in (self.data_path, self.tmp):
            if p.exists():
                p.unlink()
        return False

    def begin(self, name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> None:
        """Start tensor ``name`` of element shape ``shape`` (numpy order) stored as ``qtype``."""
        self._current = (name, tuple(int(x) for x in shape), qtype, self.data.tell())

    def write(self, chunk: np.ndarray | bytes) -> None:
        """Append encoded bytes of the current tensor (row order)."""
        if isinstance(chunk, np.ndarray):
            chunk = np.ascontiguousarray(chunk).tobytes()
        self.data.write(chunk)

    def discard(self) -> None:
        """Forget what was written of the current tensor (to write it again with another type)."""
        self.data.seek(self._current[3])
        self.data.truncate()
        self._current = None

    def end(self) -> int:
        """Close the current tensor; returns its size in bytes.

        Raises:
            ValueError: the bytes written do not match the shape and type.
        """
        name, shape, qtype, start = self._current
        nbytes = self.data.tell() - start
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        expected = int(np.prod(shape)) // block * size
        if nbytes != expected:
            raise ValueError(f"{name}: {nbytes} bytes written, {expected} expected for {qtype.name} {shape}")
        pad = -nbytes % self.alignment
        if pad:
            self.data.write(b"\0" * pad)
        self.tensors.append((name, shape, qtype, nbytes))
        self._current = None
        return nbytes

    def finish(self, add_metadata: Callable[[gguf.GGUFWriter], None]) -> int:
        """Write the file: ``add_metadata(writer)`` adds the key-value pairs, then the tensor table
        and the data; OUT is replaced atomically. Returns the file's size in bytes."""
        write_header(self.tmp, self.arch, self.alignment, add_metadata, self.tensors)
        self.data.flush()
        self.data.seek(0)
        with open(self.tmp, "ab") as f:
            f.write(b"\0" * (-f.tell() % self.alignment))  # the data section starts on the alignment
            shutil.copyfileobj(self.data, f, 16 << 20)
        os.replace(self.tmp, self.out)
        return self.out.stat().st_size


def write_header(path: Path, arch: str, alignment: int, add_metadata: Callable[[gguf.GGUFWriter], None],
                 tensors: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]]) -> None:
    """Write a GGUF file's header, metadata and tensor table (no data) to ``path`` with ``gguf.GGUFWriter``.

    ``tensors``: (name, element shape in numpy order, type, bytes) per tensor, in data order; each
    tensor's offset is the sum of the earlier ones' sizes padded to ``alignment`` (a power of two;
    written as ``general.alignment`` when it is not GGUF's default 32). The caller appends the data
    section: zero padding up to the next multiple of ``alignment``, then the tensors.

    Why not ``GGUFWriter`` all the way: it writes tensor data only from arrays it holds
    (``add_tensor``, ``write_tensor_data``), whereas the data here streams from a scratch file whose
    types were decided after the fact. So only GGUFWriter's public steps are used (``add_tensor_info``
    with ``raw_dtype``, then ``write_header/kv_data/ti_data_to_file``; none of its private file
    handles or padding helpers), and the data layout is GGUF's own (see the module docstring).
    ``tests/test_gguf_out.py`` checks that header and data together are byte for byte what
    ``GGUFWriter`` writes itself, so a gguf release that changes any of this fails there; pyproject.toml
    bounds gguf's version to the releases tested.
    """
    w = gguf.GGUFWriter(str(path), arch)
    if alignment != gguf.GGUF_DEFAULT_ALIGNMENT:
        w.add_custom_alignment(alignment)
    add_metadata(w)
    for name, shape, qtype, nbytes in tensors:  # float32: the shape is in elements, not bytes
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def encode_rows(arr: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 rows [R, K] in ``qtype`` (F32, F16, BF16, Q8_0 via ``gguf.quants``) as raw bytes."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return arr.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return arr.astype(np.float16)
    return gguf.quants.quantize(arr, qtype)
