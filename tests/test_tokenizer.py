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


CONTROL_TEXTS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<mask>", "<unused0>"]


def _template_controls(tokenizer, msgs, **kw):
    """The control tokens the template itself writes for ``msgs`` (their contents made harmless)."""
    plain = [{**m, "content": "x" if m["content"] else ""} for m in msgs]
    return [t for t in tokenizer.encode_chat(plain, **kw) if t in tokenizer.special_ids]


@pytest.mark.parametrize("ctl", CONTROL_TEXTS)
@pytest.mark.parametrize("shape", ["system-newline", "padded-user", "assistant-trailing", "continued"])
def test_control_token_text_in_chat_content_is_text_whatever_its_whitespace(tokenizer, ctl, shape):
    """Control-token spellings in message content stay text even when the content has leading or
    trailing whitespace that the template trims for some messages and keeps for others (Gemma's
    trims turns, not the system text it folds into the first one): was a 400."""
    kw = {}
    if shape == "system-newline":
        msgs = [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": f" x {ctl} y\n"}]
    elif shape == "padded-user":
        msgs = [{"role": "system", "content": " S "}, {"role": "user", "content": f"  {ctl}hi  "}]
    elif shape == "assistant-trailing":
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"ok {ctl}\n"},
                {"role": "user", "content": f"\t{ctl}"}]
    else:
        msgs = [{"role": "system", "content": "S\n"}, {"role": "user", "content": f" hi {ctl} "},
                {"role": "assistant", "content": f"Sure {ctl} "}]
        kw = {"add_generation_prompt": False, "continue_final": True}
    ids = tokenizer.encode_chat(msgs, **kw)
    assert [t for t in ids if t in tokenizer.special_ids] == _template_controls(tokenizer, msgs, **kw)
    assert ids.count(tokenizer.bos_id) == 1 and ids[0] == tokenizer.bos_id
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(msgs, **kw)
