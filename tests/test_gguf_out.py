"""StreamingGGUF writes what gguf.GGUFWriter writes itself, byte for byte, at any alignment.

This guards ``gguf_out.write_header``: it drives GGUFWriter's header/metadata/tensor-table steps and
appends the data section itself, so a gguf release that lays files out differently must fail here.
"""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from gemmaspec.errors import InputError
from gemmaspec.loading.gguf_out import StreamingGGUF, encode_rows


def _tensors():
    """name → (array as GGUFWriter.add_tensor takes it, raw type, element shape): sizes that need padding."""
    rng = np.random.default_rng(0)
    q4 = gguf.quants.quantize(rng.standard_normal((3, 64)).astype(np.float32), T.Q4_0)  # 3 x 36 bytes
    q8 = gguf.quants.quantize(rng.standard_normal((1, 32)).astype(np.float32), T.Q8_0)  # 34 bytes
    bf16 = rng.integers(0, 1 << 15, (5, 3), dtype=np.uint16)  # 30 bytes
    return {
        "blk.0.attn_q.weight": (q4, T.Q4_0, (3, 64)),
        "blk.0.ffn_up.weight": (q8, T.Q8_0, (1, 32)),
        "blk.0.attn_norm.weight": (rng.standard_normal(7).astype(np.float32), None, (7,)),
        "blk.0.odd.weight": (bf16, T.BF16, (5, 3)),
        "ordering": (np.arange(5, dtype=np.int32), None, (5,)),
    }


def _metadata(w: gguf.GGUFWriter) -> None:
    w.add_uint32("llama.block_count", 1)
    w.add_string("general.name", "x" * 11)  # a header length that is not a multiple of the alignment
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "def"])


@pytest.mark.parametrize("alignment", [32, 64, 256])
def test_streaming_equals_gguf_writer(tmp_path, alignment):
    ref = gguf.GGUFWriter(str(tmp_path / "ref.gguf"), "llama")
    if alignment != gguf.GGUF_DEFAULT_ALIGNMENT:
        ref.add_custom_alignment(alignment)
    _metadata(ref)
    for name, (arr, raw, _) in _tensors().items():
        ref.add_tensor(name, arr, raw_dtype=raw)
    ref.write_header_to_file()
    ref.write_kv_data_to_file()
    ref.write_tensors_to_file()
    ref.close()

    with StreamingGGUF(tmp_path / "out.gguf", "llama", alignment=alignment) as s:
        for name, (arr, raw, shape) in _tensors().items():
            qtype = raw if raw is not None else T.F32 if arr.dtype == np.float32 else T.I32
            s.begin(name, shape, qtype)
            half = arr.nbytes // 2  # in two pieces, as rows stream in
            s.write(arr.tobytes()[:half])
            s.write(arr.tobytes()[half:])
            assert s.end() == arr.nbytes
        size = s.finish(_metadata)

    assert (tmp_path / "out.gguf").read_bytes() == (tmp_path / "ref.gguf").read_bytes()
    assert size == (tmp_path / "out.gguf").stat().st_size
    r = gguf.GGUFReader(tmp_path / "out.gguf")
    assert r.alignment == alignment
    got = {t.name: t for t in r.tensors}
    for name, (arr, _, shape) in _tensors().items():
        assert tuple(int(x) for x in reversed(got[name].shape.tolist())) == shape
        assert np.asarray(got[name].data).tobytes() == arr.tobytes()


def test_discard_then_another_type(tmp_path):
    rows = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    with StreamingGGUF(tmp_path / "o.gguf", "llama") as s:
        s.begin("w", rows.shape, T.Q4_0)
        s.write(gguf.quants.quantize(rows, T.Q4_0)[:1])
        s.discard()
        s.begin("w", rows.shape, T.Q8_0)
        s.write(encode_rows(rows, T.Q8_0))
        s.end()
        s.finish(lambda w: None)
    (t,) = gguf.GGUFReader(tmp_path / "o.gguf").tensors
    assert t.tensor_type == T.Q8_0
    np.testing.assert_array_equal(np.asarray(t.data), gguf.quants.quantize(rows, T.Q8_0))


def test_wrong_size_and_failures_leave_nothing(tmp_path):
    with pytest.raises(ValueError, match="bytes written"):
        with StreamingGGUF(tmp_path / "o.gguf", "llama") as s:
            s.begin("w", (2, 32), T.Q8_0)
            s.write(b"\0" * 33)
            s.end()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "o.gguf").write_bytes(b"old")
    with pytest.raises(InputError, match="--force"):
        StreamingGGUF(tmp_path / "o.gguf", "llama")
