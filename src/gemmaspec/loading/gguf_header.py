"""A GGUF file's header (metadata and tensor table) read without touching its tensor data.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, little-endian):
magic ``GGUF``, u32 version, u64 tensor count, u64 key/value count; each key/value is a string key
(u64 length + UTF-8 bytes), a u32 value type and the value (fixed-size scalars, a string, or an
array: u32 element type, u64 count, elements); each tensor info is a string name, u32 n_dims,
n_dims u64 dimensions (ne0 first), u32 GGML type and a u64 offset from the start of the data
section, which begins at the first multiple of ``general.alignment`` (default 32) after the table.

Why not ``gguf.GGUFReader``: it builds a numpy view per array element (two per string), about a
million objects for a 262k-token vocabulary, so opening the default model takes 13-22 s. Here
numeric arrays stay one numpy view over the mapped bytes and string arrays are only walked (their
lengths) until a caller asks for their values, so the default model's header reads in well under
a second. The file is mapped once, copy-on-write (``mmap.ACCESS_COPY``): :meth:`GGUFHeader.tensor_bytes`
hands out writable views of tensor data that copy nothing and write nothing back to the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import ModelFileError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS

_V = GGUFValueType
# fixed-size value types: struct format, numpy dtype
_SCALAR = {
    _V.UINT8: ("<B", np.uint8), _V.INT8: ("<b", np.int8), _V.UINT16: ("<H", np.uint16), _V.INT16: ("<h", np.int16),
    _V.UINT32: ("<I", np.uint32), _V.INT32: ("<i", np.int32), _V.FLOAT32: ("<f", np.float32),
    _V.UINT64: ("<Q", np.uint64), _V.INT64: ("<q", np.int64), _V.FLOAT64: ("<d", np.float64),
    _V.BOOL: ("<?", np.bool_),
}
_SIZE = {t: struct.calcsize(f) for t, (f, _) in _SCALAR.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class _Truncated(Exception):
    """A read past the end of the file (raised inside the parser, reported as ModelFileError)."""


@dataclass
class Field:
    """One metadata key/value.

    Attributes:
        name: the key (``general.architecture``).
        types: the value type, then for arrays the element type (``[ARRAY, STRING]``), as
            ``gguf.ReaderField.types`` gives them.
        start, end: byte range of the whole entry (key, type, value) in the file.
        count: number of elements of an array value (None for a scalar or string).
    """

    name: str
    types: list
    start: int
    end: int
    count: int | None
    _header: GGUFHeader
    _value_at: int  # where the value (for arrays: the first element) starts
    _value: object = None  # decoded scalar / string / nested list

    def contents(self):
        """The value as Python: int/float/bool/str, or a list of them for an array (what
        ``gguf.ReaderField.contents()`` returns for the same field; an array of arrays comes back
        nested, where ``gguf`` flattens it).

        Raises:
            ModelFileError: a string array holds text that is not UTF-8 (decoded only now).
        """
        if self.types[0] != _V.ARRAY:
            return self._value
        if self._value is not None:  # nested arrays, decoded while parsing
            return self._value
        if self.types[-1] == _V.STRING:
            try:
                return self._header._strings(self._value_at, self.count)
            except UnicodeDecodeError as exc:
                raise ModelFileError(f"{self._header.path} is a corrupt GGUF file (metadata {self.name} holds text that "
                                     f"is not UTF-8: {exc.reason}); download or convert it again") from None
        return self.array().tolist()

    def array(self) -> np.ndarray:
        """A numeric array's values as a read-only numpy array (a view of the file's bytes: no copy).

        Raises:
            TypeError: the field is not an array of numbers.
        """
        sub = self.types[-1]
        if self.types[0] != _V.ARRAY or len(self.types) != 2 or sub not in _SCALAR:
            raise TypeError(f"metadata {self.name} is not an array of numbers")
        a = np.frombuffer(self._header._mm, dtype=np.dtype(_SCALAR[sub][1]).newbyteorder("<"), count=self.count,
                          offset=self._value_at)
        a.flags.writeable = False
        return a


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table.

    Attributes:
        name: GGUF tensor name (``blk.0.attn_q.weight``).
        tensor_type: its ``gguf.GGMLQuantizationType``.
        dims: dimensions in GGUF order (ne0, the contiguous one, first).
        offset: absolute byte offset of its data in the file.
        n_bytes: bytes of data.
    """

    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Dimensions in torch order (``[..., ne1, ne0]``)."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


class GGUFHeader:
    """A GGUF file's metadata and tensor table, parsed from a copy-on-write map of the file.

    Attributes:
        path: the file.
        size: its size in bytes.
        version: GGUF version (2 or 3).
        fields: metadata key -> :class:`Field`, in file order.
        tensors: :class:`TensorInfo` list in file order.
        alignment: ``general.alignment`` (32 when absent).
        data_offset: where the data section starts.

    Raises:
        ModelFileError: not a GGUF, an unsupported version, a big-endian file, a header that runs past
            the end of the file or does not parse (truncated or corrupt), a tensor of an unknown type,
            a tensor whose data lies past the end of the file (truncated).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        _check_file(self.path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                st = os.fstat(f.fileno())
                self._identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except (OSError, ValueError) as exc:
            raise ModelFileError(f"cannot map model file {self.path}: {exc}") from None
        self.size = len(self._mm)
        self.fields: dict[str, Field] = {}
        self.tensors: list[TensorInfo] = []
        try:
            self._parse()
        except _Truncated as exc:
            raise ModelFileError(f"{self.path} is a truncated or corrupt GGUF file ({exc}); "
                                 "download or convert it again") from None
        except (ValueError, UnicodeDecodeError, OverflowError, struct.error) as exc:
            raise ModelFileError(f"{self.path} is a truncated or corrupt GGUF file ({exc}); "
                                 "download or convert it again") from None
        self._by_name = {t.name: t for t in self.tensors}

    def release_header(self) -> None:
        """Drop the mapped header's pages (metadata, the vocabulary's strings: ~6 MiB for a
        262,144-token vocabulary) from this process's memory once loading has read what it needs
        (Linux ``madvise(MADV_DONTNEED)`` on the clean pages before the data section: they stay in the
        page cache, and a later read of a field maps them in again). A no-op where madvise is missing."""
        end = self.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        if end and hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            try:
                self._mm.madvise(mmap.MADV_DONTNEED, 0, end)
            except (OSError, ValueError):
                pass

    # -- parsing ---------------------------------------------------------------------------------
    def _need(self, pos: int, n: int) -> None:
        if n < 0 or pos + n > self.size:
            raise _Truncated(f"the header needs bytes up to {pos + n}, the file has {self.size}")

    def _u32(self, pos: int) -> int:
        self._need(pos, 4)
        return _U32.unpack_from(self._mm, pos)[0]

    def _u64(self, pos: int) -> int:
        self._need(pos, 8)
        return _U64.unpack_from(self._mm, pos)[0]

    def _str(self, pos: int) -> tuple[str, int]:
        n = self._u64(pos)
        self._need(pos + 8, n)
        return self._mm[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n

    def _vtype(self, raw: int, where: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"{where} has unknown value type {raw}") from None

    def _skip_strings(self, pos: int, count: int) -> int:
        """Offset just past ``count`` strings starting at ``pos`` (only their lengths are read).

        Walking a vocabulary's 262,144 strings takes ~50 ms; a process that reads the same file's
        header again (the memory estimate, then the load) gets the end from :data:`_SKIPPED`, keyed by
        the file's identity (device, inode, size, modification time in ns)."""
        key = (self._identity, pos, count)
        end = _SKIPPED.get(key)
        if end is not None:
            return end
        end = self._walk_strings(pos, count)
        if self._identity is not None:
            _SKIPPED[key] = end
        return end

    def _walk_strings(self, pos: int, count: int) -> int:
        mm, size, unpack = self._mm, self.size, _U64.unpack_from
        try:
            for _ in range(count):
                pos += 8 + unpack(mm, pos)[0]
        except (struct.error, OverflowError):
            pos = size + 1
        if pos > size:
            raise _Truncated(f"a string array runs past the end of the file ({size} bytes)")
        return pos

    def _value(self, pos: int, vtype: GGUFValueType, name: str):
        """``(value or None, types, count, first element offset, end)`` of the value at ``pos``."""
        if vtype in _SCALAR:
            fmt, _ = _SCALAR[vtype]
            self._need(pos, _SIZE[vtype])
            return struct.unpack_from(fmt, self._mm, pos)[0], [vtype], None, pos, pos + _SIZE[vtype]
        if vtype == _V.STRING:
            s, end = self._str(pos)
            return s, [vtype], None, pos, end
        if vtype != _V.ARRAY:
            raise ValueError(f"metadata {name} has unhandled value type {vtype.name}")
        sub = self._vtype(self._u32(pos), f"array {name}")
        count = self._u64(pos + 4)
        start = pos + 12
        if sub in _SCALAR:
            self._need(start, count * _SIZE[sub])
            return None, [vtype, sub], count, start, start + count * _SIZE[sub]
        if sub == _V.STRING:
            self._need(start, count * 8)
            return None, [vtype, sub], count, start, self._skip_strings(start, count)
        # an array of arrays (no model in use has one): decoded now, as nested lists
        self._need(start, count * 12)
        items, types, at = [], [vtype, sub], start
        for i in range(count):
            v, t, n, first, end = self._value(at, sub, name)
            items.append(Field(name, t, at, end, n, self, first, v).contents())
            if i == 0:
                types = [vtype] + t
            at = end
        return items, types, count, start, at

    def _parse(self) -> None:
        mm = self._mm
        self._need(0, 24)
        if mm[:4] != GGUF_MAGIC:
            raise ModelFileError(f"{self.path} is not a GGUF file (it does not start with 'GGUF'); pass a .gguf model")
        version = self._u32(4)
        if version & 0xFFFF == 0 and version:
            raise ModelFileError(f"{self.path} is a big-endian GGUF file; gemmaspec reads little-endian GGUF only "
                                 "(convert the model again on a little-endian machine)")
        if version not in VERSIONS:
            raise ModelFileError(f"{self.path} is GGUF version {version}; gemmaspec reads versions "
                                 f"{', '.join(map(str, VERSIONS))} (convert the model again with a current llama.cpp)")
        self.version = version
        n_tensors, n_kv = self._u64(8), self._u64(16)
        # each entry takes at least 12 (key/value) or 28 (tensor) bytes: refuse absurd counts early
        if n_kv * 12 + n_tensors * 28 > self.size:
            raise _Truncated(f"it declares {n_kv} metadata entries and {n_tensors} tensors, more than "
                             f"{self.size} bytes can hold")
        pos = 24
        for _ in range(n_kv):
            start = pos
            key, pos = self._str(pos)
            vtype = self._vtype(self._u32(pos), f"metadata {key}")
            value, types, count, first, end = self._value(pos + 4, vtype, key)
            if key in self.fields:
                raise ValueError(f"metadata key {key} appears twice")
            self.fields[key] = Field(key, types, start, end, count, self, first, value)
            pos = end
        align = self.fields.get("general.alignment")
        self.alignment = DEFAULT_ALIGNMENT
        if align is not None:
            if align.types != [_V.UINT32] or align.contents() == 0 or align.contents() & (align.contents() - 1):
                raise ValueError("general.alignment must be a power of two stored as uint32")
            self.alignment = align.contents()
        infos = []
        for _ in range(n_tensors):
            name, pos = self._str(pos)
            n_dims = self._u32(pos)
            if n_dims > MAX_DIMS:
                raise ValueError(f"tensor {name} has {n_dims} dimensions (at most {MAX_DIMS})")
            self._need(pos + 4, 8 * n_dims + 12)
            dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
            raw_type, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, raw_type, offset))
        self.data_offset = -(-pos // self.alignment) * self.alignment
        names = set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"tensor {name} appears twice")
            names.add(name)
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                from ..kernels.ggml_blocks import DENSE, SUPPORTED_QUANT

                raise ModelFileError(f"{self.path} holds a tensor of an unknown type ({raw_type} is not a valid "
                                     f"GGMLQuantizationType; tensor {name}); supported types: "
                                     f"{', '.join(t.name for t in DENSE + SUPPORTED_QUANT)}") from None
            if offset % self.alignment:
                raise ValueError(f"tensor {name} data offset {offset} is not a multiple of the alignment "
                                 f"{self.alignment}")
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = 1
            for d in dims:
                n *= d
            if dims and dims[0] % block:
                raise ValueError(f"tensor {name} rows of {dims[0]} values do not fit {qtype.name} blocks of {block}")
            t = TensorInfo(name, qtype, tuple(int(d) for d in dims), self.data_offset + offset, n // block * type_size)
            if t.offset + t.n_bytes > self.size:
                raise ModelFileError(
                    f"{self.path} is truncated: tensor {name} needs bytes up to {t.offset + t.n_bytes}, "
                    f"the file has {self.size}; download or convert it again")
            self.tensors.append(t)

    # -- access ----------------------------------------------------------------------------------
    def _strings(self, pos: int, count: int) -> list[str]:
        mm, unpack, out = self._mm, _U64.unpack_from, []
        for _ in range(count):
            n = unpack(mm, pos)[0]
            out.append(mm[pos + 8:pos + 8 + n].decode("utf-8"))
            pos += 8 + n
        return out

    def get(self, key: str, default=None):
        """The value of metadata ``key`` (:meth:`Field.contents`), or ``default``."""
        f = self.fields.get(key)
        return default if f is None else f.contents()

    def tensor(self, name: str) -> TensorInfo | None:
        """The tensor table entry called ``name``, or None."""
        return self._by_name.get(name)

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """The tensor's data as a writable uint8 numpy array [n_bytes] over the copy-on-write map (no
        copy; writes stay in this process). Pages are read from the file when first touched."""
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.n_bytes, offset=t.offset)

    def entry_bytes(self, keys) -> bytes:
        """The raw bytes of the metadata entries ``keys`` (those present), concatenated in file order."""
        spans = sorted((f.start, f.end) for k, f in self.fields.items() if k in keys)
        return b"".join(self._mm[a:b] for a, b in spans)


def _check_file(path: Path) -> None:
    """Raise :class:`ModelFileError` unless ``path`` is a readable file that starts like a GGUF."""
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelFileError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror}") from None
    if head != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a .gguf model")


# (file identity, offset, count) -> end offset of a string array (see GGUFHeader._skip_strings)
_SKIPPED: dict[tuple, int] = {}


def read_header(path: str | Path) -> GGUFHeader:
    """:class:`GGUFHeader` of ``path`` (see there for errors)."""
    return GGUFHeader(path)
