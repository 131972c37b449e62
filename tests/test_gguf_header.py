"""The header-only GGUF reader (loading/gguf_header.py): the same metadata and tensor table as
``gguf.GGUFReader`` and transformers' reader, and a clear ModelFileError for every damaged file."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmaspec.errors import ModelFileError
from gemmaspec.loading.gguf_header import read_header

_SCALARS = {
    V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000, V.UINT32: 4_000_000_000, V.INT32: -2_000_000_000,
    V.FLOAT32: 0.1, V.UINT64: 2**63 + 5, V.INT64: -(2**62), V.FLOAT64: 1e-300, V.BOOL: True,
}


def _write(path, alignment=None, n_tokens=300, tensors=None):
    """A GGUF with every metadata value type and a few tensors of different types, ranks and sizes."""
    w = GGUFWriter(str(path), "gemma3")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for vtype, value in _SCALARS.items():
        w.add_key_value(f"test.scalar.{vtype.name.lower()}", value, vtype)
    w.add_key_value("test.string", "héllo ▁ wörld", V.STRING)
    w.add_key_value("test.empty_string", "", V.STRING)
    for vtype in (V.UINT8, V.INT32, V.FLOAT32, V.INT64, V.BOOL):
        vals = [True, False, True] if vtype == V.BOOL else [1, 2, 3, 120]
        w.add_key_value(f"test.array.{vtype.name.lower()}", vals, V.ARRAY, vtype)
    w.add_token_list(["<pad>", "<eos>", "<bos>", "", "▁a"] + [f"tök{i}" for i in range(n_tokens - 5)])
    w.add_token_scores([float(-i) for i in range(n_tokens)])
    w.add_token_types([1] * n_tokens)
    w.add_token_merges(["▁ a", "t ö"])
    rng = np.random.default_rng(0)
    for name, (arr, raw_dtype) in (tensors or {
        "a.weight": (rng.standard_normal((3, 5)).astype(np.float32), None),
        "b.weight": (rng.integers(0, 255, (4, 34), dtype=np.uint8), T.Q8_0),
        "c.weight": (rng.standard_normal(7).astype(np.float16), None),
        "d.weight": (rng.integers(0, 255, (2, 3, 18), dtype=np.uint8), T.Q4_0),
        "e.weight": (np.arange(6, dtype=np.int32), None),
    }).items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_same_as_gguf_reader(path):
    ours, ref = read_header(path), GGUFReader(path)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, f in ref_fields.items():
        assert ours.fields[key].types == f.types, key
        assert ours.fields[key].contents() == f.contents(), key
        if f.types[0] == V.ARRAY:
            assert ours.fields[key].count == len(f.data), key
    assert ours.alignment == ref.alignment and ours.data_offset == ref.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.dims == tuple(b.shape.tolist())
        assert a.offset == b.data_offset and a.n_bytes == b.n_bytes and a.n_elements == b.n_elements
        assert np.array_equal(ours.tensor_bytes(a), np.asarray(b.data).view(np.uint8).reshape(-1))


@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_same_as_gguf_reader_on_every_value_type(tmp_path, alignment):
    _assert_same_as_gguf_reader(_write(tmp_path / "m.gguf", alignment))


def test_numeric_arrays_are_views(tmp_path):
    h = read_header(_write(tmp_path / "m.gguf"))
    scores = h.fields["tokenizer.ggml.scores"].array()
    assert scores.dtype == np.float32 and scores.shape == (300,) and scores[7] == -7.0
    assert not scores.flags.writeable and not scores.flags.owndata
    with pytest.raises(TypeError, match="not an array of numbers"):
        h.fields["tokenizer.ggml.tokens"].array()


def test_default_model_header(model_path):
    """The default model against transformers' independent reader (metadata, with its vocabulary
    and the tensor table). gguf.GGUFReader would take 13-22 s on this file; it is compared on the
    small files above."""
    from transformers.integrations.gguf.reader import _mapped, _read_metadata, _read_tensor_table, read_gguf_metadata

    h = read_header(model_path)
    class Every:  # decode every string array
        def __contains__(self, key):
            return True

    meta, names = read_gguf_metadata(str(model_path), Every())
    assert set(meta) == set(h.fields)
    for key, value in meta.items():
        got = h.get(key)
        assert got == value and type(got) is type(value), key
    assert h.fields["tokenizer.ggml.tokens"].count == 262144 == len(h.get("tokenizer.ggml.scores"))
    assert list(names) == [t.name for t in h.tensors]
    # its tensor table (GgufHeader.from_file refuses the file's Q5_0 tensors, so its parts are used)
    blob = _mapped(str(model_path))
    _, n_tensors, pos = _read_metadata(blob, str(model_path))
    entries, end = _read_tensor_table(blob, n_tensors, pos)
    assert h.data_offset == -(-end // 32) * 32
    assert [(name, shape, ggml_type, h.data_offset + offset) for name, shape, ggml_type, offset in entries] == \
        [(t.name, t.shape, int(t.tensor_type), t.offset) for t in h.tensors]
    sizes = {"F32": 4 * 640, "Q8_0": 34 * 20, "Q5_0": 22 * 20, "Q4_K": 144 * 2.5, "Q6_K": 210 * 2.5}  # per 640 values
    assert all(t.n_bytes == t.n_elements // 640 * sizes[t.tensor_type.name] for t in h.tensors if t.dims[0] == 640)
    types = {t.tensor_type.name for t in h.tensors}
    assert types == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}


def test_not_gguf_and_versions(tmp_path):
    p = tmp_path / "x.gguf"
    with pytest.raises(ModelFileError, match="not found"):
        read_header(p)
    p.write_bytes(b"")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        read_header(p)
    good = _write(tmp_path / "m.gguf").read_bytes()
    p.write_bytes(good[:4] + (1).to_bytes(4, "little") + good[8:])
    with pytest.raises(ModelFileError, match="GGUF version 1"):
        read_header(p)
    p.write_bytes(good[:4] + (3).to_bytes(4, "big") + good[8:])
    with pytest.raises(ModelFileError, match="big-endian"):
        read_header(p)
    with pytest.raises(ModelFileError, match="is not a file"):
        read_header(tmp_path)


def test_unknown_tensor_type(tmp_path):
    data = bytearray(_write(tmp_path / "m.gguf").read_bytes())
    i = data.index(b"a.weight") + len(b"a.weight") + 4 + 8 * 2  # n_dims u32, 2 dims u64, then the type
    data[i:i + 4] = (250).to_bytes(4, "little")
    (tmp_path / "odd.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"unknown type \(250 .*supported types: F32"):
        read_header(tmp_path / "odd.gguf")


_GOOD = {}


def _good(tmp_path_factory) -> tuple[bytes, int]:
    """A valid file's bytes (up to the end of its last tensor's data, without the padding after it)
    and where its header ends (written once per session)."""
    if not _GOOD:
        p = _write(tmp_path_factory.mktemp("h") / "m.gguf")
        h = read_header(p)
        _GOOD["b"] = p.read_bytes()[:max(t.offset + t.n_bytes for t in h.tensors)]
        _GOOD["end"] = h.data_offset
    return _GOOD["b"], _GOOD["end"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=4, max_value=10_000))
def test_every_truncation_is_reported(tmp_path_factory, cut):
    data, _ = _good(tmp_path_factory)
    cut = min(cut, len(data) - 1)
    p = tmp_path_factory.mktemp("cut") / "cut.gguf"
    p.write_bytes(data[:cut])
    with pytest.raises(ModelFileError, match="truncated"):
        read_header(p)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=4))
def test_corrupt_headers_parse_or_give_a_clear_error(tmp_path_factory, edits):
    """Bytes changed anywhere in the header: either a header comes back or a ModelFileError does;
    never another exception, a hang or a huge allocation."""
    good, end = _good(tmp_path_factory)
    data = bytearray(good)
    for pos, value in edits:
        data[4 + pos % (end - 4)] = value
    p = tmp_path_factory.mktemp("bad") / "bad.gguf"
    p.write_bytes(bytes(data))
    try:
        h = read_header(p)
        for t in h.tensors:  # what parses is consistent: every tensor lies within the file
            assert t.offset + t.n_bytes <= len(data)
        for f in h.fields.values():  # string arrays are decoded only now
            f.contents()
    except ModelFileError as exc:
        assert str(p) in str(exc), exc
        assert any(w in str(exc) for w in ("corrupt", "truncated", "unknown type", "version", "big-endian")), exc
