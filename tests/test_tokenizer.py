"""Our token ids equal the transformers reference tokenizer's (built from the same GGUF)."""

import pytest

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    "Ünïcödé façade, naïve café — “quotes” and ‘apostrophes’…",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 😀🎉👩‍💻🇫🇷 and math ∑∫√π≈3.14159",
    "   leading spaces, trailing spaces   ",
    "many     spaces\n\n\n\nnewlines\t\ttabs",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos> in the middle <eos> and <pad> tokens",
    "",
    "a" * 200,
    "JSON: {\"key\": [1, 2.5e-3, null, true], \"nested\": {\"k\": \"v\"}}",
    "URL https://example.com/path?q=1&r=%20 email a.b@c.de",
]


@pytest.mark.reference
@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_reference(tokenizer, reference, text):
    _, ref = reference
    want = ref(text).input_ids
    if want[:2] == [tokenizer.bos_id] * 2:  # a text that starts with <bos> never gets a second one here
        want = want[1:]
    assert tokenizer.encode(text) == want


def test_bos_from_file(tokenizer):
    assert tokenizer.add_bos is True
    assert tokenizer.encode("hi")[0] == tokenizer.bos_id == 2
    assert tokenizer.encode("hi", add_bos=False)[0] != 2


def test_roundtrip(tokenizer):
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text, add_bos=False)) == text


def test_incremental_decoder_never_splits_characters(tokenizer):
    from gemmaspec.streaming import IncrementalDecoder

    text = "emoji 😀🎉👩‍💻 日本語 café"
    ids = tokenizer.encode(text, add_bos=False)
    dec = IncrementalDecoder(tokenizer)
    pieces = [dec.push([i]) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_chat_template(tokenizer):
    ids = tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    text = tokenizer.decode(ids)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert ids.count(tokenizer.bos_id) == 1
    end_of_turn = tokenizer.token_to_id("<end_of_turn>")
    assert end_of_turn in tokenizer.stop_ids and tokenizer.eos_id in tokenizer.stop_ids
