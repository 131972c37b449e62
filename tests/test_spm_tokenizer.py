"""The tokenizer's SentencePiece fast path gives the ``tokenizers`` BPE's ids and text exactly."""

import glob
import json
import sysconfig

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmaspec.spm_tokenizer import NotReproducible, SpmText, build_model
from gemmaspec.tokenizer import GemmaTokenizer


@pytest.fixture(scope="module")
def both(tokenizer):
    """(the engine's tokenizer, which must have the fast path, and its tokenizers backend)."""
    assert tokenizer.fast is not None, "the default model's tokenizer should load through SentencePiece"
    return tokenizer, tokenizer.backend


def _plain(backend, text):
    old = backend.encode_special_tokens
    backend.encode_special_tokens = True
    try:
        return backend.encode(text, add_special_tokens=False).ids
    finally:
        backend.encode_special_tokens = old


def test_stdlib_sources_encode_identically(both):
    tok, backend = both
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))[::25]
    assert len(files) > 20
    for f in files:
        text = open(f, encoding="utf-8", errors="replace").read()[:6000]
        assert tok.encode(text, add_bos=False) == backend.encode(text, add_special_tokens=False).ids, f
        assert tok.encode_text(text) == _plain(backend, text), f


PIECES = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "[multimodal]",
          "<start_of_image>", "<unused3>", "<0x41>", "▁", " ", "  ", "    ", "\t\t", "\n", "\n\n\n", "\r\n",
          "def ", "print(", "é", "中文", "😀", "👩‍💻", "\u200b", "\ufeff", "\x00", "123", "4567", "<", ">", "[", "]"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=12)), max_size=12).map("".join))
def test_any_text_encodes_and_decodes_identically(both, text):
    tok, backend = both
    want = backend.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_bos=False) == want
    assert tok.encode_text(text) == _plain(backend, text)
    assert tok.decode(want) == backend.decode(want, skip_special_tokens=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 262143), max_size=16))
def test_any_ids_decode_identically(both, ids):
    """Byte tokens in any order (invalid UTF-8 included), control tokens, whitespace runs."""
    tok, backend = both
    ids = ids + [i for i in ids if i % 3 == 0] + list(range(238, 244))[: len(ids) % 6]  # some byte tokens
    assert tok.decode(ids) == backend.decode(ids, skip_special_tokens=False)


def test_vocabulary_and_ids(both):
    tok, backend = both
    assert tok.get_vocab() == backend.get_vocab()
    for t in ("<start_of_turn>", "▁the", "<0x0A>", "▁▁▁▁", "no-such-token-xyz"):
        assert tok.token_to_id(t) == backend.token_to_id(t)
    assert tok.special_ids == frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)


def test_a_cached_load_does_not_read_tokenizer_json(tmp_path, tokenizer):
    tokenizer.save(tmp_path)
    assert (tmp_path / "tokenizer.model").is_file()
    again = GemmaTokenizer.load(tmp_path)
    assert again._backend is None  # tokenizer.json not parsed
    text = "<start_of_turn>user\n    def f(x):  return x<end_of_turn>\n"
    assert again.encode(text) == tokenizer.encode(text)
    assert again._backend is None
    assert again.backend.token_to_id("<bos>") == 2  # and still there when asked for


def test_a_pipeline_it_cannot_reproduce_is_refused(tokenizer):
    """Another normalizer (here: lowercasing before the space replacement) must not get a fast path."""
    from tokenizers import Tokenizer

    j = json.loads(tokenizer.backend.to_str())
    j["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Lowercase"}, j["normalizer"]]}
    other = Tokenizer.from_str(json.dumps(j))
    with pytest.raises(NotReproducible, match="normalizer"):
        build_model(other)
    tok = GemmaTokenizer(other, 2, 1, True, None)
    assert tok.add_fast_path() is not None and tok.fast is None
    assert tok.encode("Hello", add_bos=False) == other.encode("Hello", add_special_tokens=False).ids


def test_the_self_check_catches_a_wrong_model(tmp_path, tokenizer):
    """A model whose scores do not follow the merge ranks encodes differently; the check says so."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from gemmaspec.spm_tokenizer import self_check

    blob, controls = build_model(tokenizer.backend)
    m = pb.ModelProto()
    m.ParseFromString(blob)
    for p in m.pieces:  # flip the merge order
        p.score = -p.score
    f = tmp_path / "bad.model"
    f.write_bytes(m.SerializeToString())
    assert self_check(tokenizer.backend, SpmText(f, controls)) is not None
