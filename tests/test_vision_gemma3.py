"""Gemma 3 images: the vision tower (SigLIP + projector) and the target after an image against
transformers' ``Gemma3ForConditionalGeneration`` on a tiny random checkpoint in the real layout; the
mmproj GGUF round trip; prompts with images; speculation after an image equals plain decoding."""

import io
import json

import pytest
import torch

from gemmaspec.engine import Engine, RequestStats
from gemmaspec.errors import InputError, ModelFileError
from gemmaspec.images import prepare
from gemmaspec.loading import load_checkpoint
from gemmaspec.loading.vision import check_pair, load_vision, write_mmproj
from gemmaspec.multimodal import image_prompt
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.drafters import ChainDrafter, DraftContext, MTPDrafter, NgramDrafter
from tiny_gemma3_vision import BOI, EOI, IMG, TOKENS_PER_IMAGE, tiny_multimodal

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("g3v")
    ref = tiny_multimodal(root / "mm")
    return ref, root


def _pixels(seed=1, n=2):
    return torch.randn(n, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_image_embeddings_match_transformers(tiny):
    ref, root = tiny
    with torch.no_grad():
        want = ref.model.get_image_features(_pixels()).pooler_output
    got = load_vision(root / "mm").model.encode(_pixels())
    assert got.shape == (2, TOKENS_PER_IMAGE, 64)
    assert _rel(got, want) < 1e-4
    # the mmproj GGUF (llama.cpp's layout): exact in f32, f16 matrices within f16 rounding
    for outtype, tol in (("f32", 1e-5), ("f16", 3e-3)):
        out = write_mmproj(root / "mm", root / f"mmproj-{outtype}.gguf", force=True, outtype=outtype)
        v = load_vision(out)
        hf = load_vision(root / "mm").config
        assert v.config.tokens_per_image == hf.tokens_per_image and v.config.num_layers == hf.num_layers
        assert v.config.image_std == pytest.approx(hf.image_std) and v.config.layer_norm_eps == pytest.approx(1e-6)
        assert _rel(v.model.encode(_pixels()), want) < tol


def test_target_logits_after_images_match_transformers(tiny):
    ref, root = tiny
    vision, target = load_vision(root / "mm").model, load_checkpoint(root / "mm").model
    g = torch.Generator().manual_seed(3)
    seg = lambda n: torch.randint(3, 290, (n,), generator=g).tolist()  # noqa: E731
    img = [BOI] + [IMG] * TOKENS_PER_IMAGE + [EOI]
    ids = [2] + seg(5) + img + seg(9) + img + seg(6)  # 34 positions: past the 8-token sliding window
    types = torch.tensor([[int(i == IMG) for i in ids]])
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids]), pixel_values=_pixels(), token_type_ids=types).logits[0]
        causal = ref(input_ids=torch.tensor([ids]), pixel_values=_pixels()).logits[0]
    assert _rel(causal, want) > 1e-2  # the bidirectional image mask matters here
    emb = vision.encode(_pixels())
    starts = [i for i in range(1, len(ids)) if ids[i] == IMG and ids[i - 1] != IMG]
    cache = target.new_cache(64)
    got = target.forward(torch.tensor(ids), cache, all_logits=True,
                         images=[(starts[0], emb[0]), (starts[1], emb[1])]).logits
    assert _rel(got, want) < 1e-4
    cache = target.new_cache(64)  # two forwards, each holding one whole image
    got = torch.cat([target.forward(torch.tensor(ids[:13]), cache, all_logits=True, images=[(starts[0], emb[0])]).logits,
                     target.forward(torch.tensor(ids[13:]), cache, all_logits=True,
                                    images=[(starts[1] - 13, emb[1])]).logits])
    assert _rel(got, want) < 1e-4


def _png(size=(40, 30), color=(200, 30, 90)):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def test_prompt_expansion_and_preprocessing(tiny):
    _, root = tiny
    loaded, vision = load_checkpoint(root / "mm"), load_vision(root / "mm")
    tok = loaded.tokenizer
    im = prepare(_png(), vision.config)
    assert im.pixels.shape == (3, 56, 56)
    want = (200 / 255 - 0.48) / 0.27  # the checkpoint's mean and std, red channel
    assert abs(float(im.pixels[0, 10, 10]) - want) < 1e-5
    ids, spans = image_prompt(tok, vision.model, "w5 <start_of_image> w6", [im])
    n = TOKENS_PER_IMAGE
    assert ids[:2] == [2, 5] and ids[ids.index(BOI):ids.index(EOI) + 1] == [BOI] + [IMG] * n + [EOI]
    assert [s.start for s in spans] == [ids.index(IMG)] and spans[0].embeddings.shape == (n, 64)
    ids2, _ = image_prompt(tok, vision.model, "w5", [im, im])  # no marker: images first
    assert ids2.count(IMG) == 2 * n and ids2[-1] == 5
    with pytest.raises(InputError, match="1 image markers"):
        image_prompt(tok, vision.model, "<start_of_image> w5", [im, im])
    chat, spans = image_prompt(tok, vision.model, "w7 w8", [im], chat=True)
    assert chat.count(IMG) == n and chat.index(IMG) == spans[0].start
    assert prepare(_png(), vision.config).key == im.key != prepare(_png(color=(1, 2, 3)), vision.config).key


@pytest.mark.parametrize("data, why", [(b"", "empty"), (b"not an image at all", "not an image format"),
                                        (_png()[:60], "corrupt or truncated")])
def test_bad_images_are_clear_errors(tiny, data, why):
    _, root = tiny
    with pytest.raises(InputError, match=why):
        prepare(data, load_vision(root / "mm").config)


def test_huge_image_is_refused(tiny, monkeypatch):
    from gemmaspec import images

    _, root = tiny
    monkeypatch.setattr(images, "MAX_PIXELS", 1000)
    with pytest.raises(InputError, match="40x30 pixels is more than"):
        prepare(_png(), load_vision(root / "mm").config)


def test_wrong_files_for_mmproj(tiny, tmp_path):
    _, root = tiny
    with pytest.raises(ModelFileError, match="not an mmproj"):
        load_vision(_text_gguf(tmp_path))
    loaded = load_vision(root / "mm")
    from gemmaspec.models.config import Gemma3Config

    with pytest.raises(InputError, match="width 64, but the model's width is 128"):
        check_pair(loaded, Gemma3Config(300, 128, 1, 8, 1, 1, 16))


def _text_gguf(tmp_path):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(tmp_path / "text.gguf", "gemma3")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return tmp_path / "text.gguf"


def test_ngram_lookup_skips_image_positions():
    d = NgramDrafter(3, 1)
    toks = [2, 10, IMG, IMG, IMG, 11, 10]
    # "10" was last followed by an image placeholder: nothing to copy there
    assert d.propose(DraftContext(toks, None, frozenset({IMG})), 3).tokens == []
    toks = [2, 10, 12, IMG, IMG, 11, 10]
    assert d.propose(DraftContext(toks, None, frozenset({IMG})), 3).tokens == [12]  # cut before the image
    assert NgramDrafter(3, 1).propose(DraftContext(toks, None), 3).tokens == [12, IMG, IMG]


def test_speculation_after_an_image_equals_plain(tiny):
    from tiny_gemma4 import ASSISTANT_TEXT, tiny_assistant

    _, root = tiny
    loaded, vision = load_checkpoint(root / "mm"), load_vision(root / "mm")
    text = {**ASSISTANT_TEXT, "global_head_dim": 16, "sliding_window": 8}
    tiny_assistant(text=text, backbone=64).save_pretrained(root / "asst")
    cfg = json.loads((root / "asst" / "config.json").read_text())
    cfg["text_config"]["global_head_dim"] = 16  # the Gemma 3 target's full layers: head dim 16
    (root / "asst" / "config.json").write_text(json.dumps(cfg))
    assistant = load_checkpoint(root / "asst").model
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=128)
    im = prepare(_png(), vision.config)
    ids, spans = image_prompt(loaded.tokenizer, vision.model, "w5 w6 w7 <start_of_image> w5 w6", [im])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [t for ev in engine.generate(ids, params, images=spans) for t in ev.tokens]
    no_image = [t for ev in engine.generate(ids, params) for t in ev.tokens]
    assert plain != no_image  # the image's embeddings reach the output
    for drafter in (NgramDrafter(), MTPDrafter(assistant, loaded.model, engine.cache),
                    ChainDrafter([NgramDrafter(), MTPDrafter(assistant, loaded.model, engine.cache)])):
        st = RequestStats()
        spec = [t for ev in engine.generate(ids, params, drafter, n_max=3, stats=st, images=spans) for t in ev.tokens]
        assert spec == plain, type(drafter).__name__
        assert IMG not in spec
        if not isinstance(drafter, NgramDrafter):
            assert st.spec.drafted > 0  # the assistant drafted from the hidden state and KV after the image


def test_generate_with_image_cli(tiny, tmp_path):
    from conftest import run_cli

    _, root = tiny
    (tmp_path / "a.png").write_bytes(_png())
    args = ["generate", "-m", str(root / "mm"), "-p", "w5 w6", "--image", str(tmp_path / "a.png"),
            "--mmproj", str(root / "mm"), "--temp", "0", "-n", "10", "--ignore-eos"]
    plain, spec = run_cli(*args, "--spec-type", "none"), run_cli(*args, "--spec-type", "ngram-simple")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert plain.stdout == spec.stdout and "prompt 9 tokens" in plain.stderr  # BOS, BOI, 4 image tokens, EOI, w5, w6
    no_proj = run_cli("generate", "-m", str(root / "mm"), "-p", "w5", "--image", str(tmp_path / "a.png"))
    assert no_proj.returncode == 1 and "error: --image needs --mmproj" in no_proj.stderr
    (tmp_path / "b.png").write_bytes(b"junk")
    bad = run_cli(*args[:5], "--image", str(tmp_path / "b.png"), "--mmproj", str(root / "mm"))
    assert bad.returncode == 1 and "not an image format" in bad.stderr and "Traceback" not in bad.stderr


@pytest.fixture(scope="module")
def vision_server(tiny, tmp_path_factory):
    from conftest import ServerProcess

    _, root = tiny
    s = ServerProcess(tmp_path_factory.mktemp("vserve"), "-m", str(root / "mm"), "--mmproj", str(root / "mm"),
                      "-np", "1", "-c", "256")
    yield s
    s.close()


def _chat(server, parts, **extra):
    import httpx

    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def _data_url(png):
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_server_image_parts(vision_server):
    import httpx

    assert httpx.get(vision_server.url + "/props").json()["modalities"]["vision"] is True
    parts = [{"type": "image_url", "image_url": {"url": _data_url(_png())}}, {"type": "text", "text": "w5 w6"}]
    first, again = _chat(vision_server, parts), _chat(vision_server, parts)
    assert first.status_code == 200, first.text
    a, b = first.json(), again.json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    n = a["usage"]["prompt_tokens"]
    # the same image again: its KV is reused (all but the last prompt token)
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    other = _chat(vision_server, [{**parts[0], "image_url": {"url": _data_url(_png(color=(0, 90, 10)))}}, parts[1]])
    assert other.status_code == 200
    cached = other.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached < n - 1 - TOKENS_PER_IMAGE  # another image: reuse stops before it


@pytest.mark.parametrize("part, why", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "remote image URLs are not fetched"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}, "base64 is malformed"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "not an image format"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "no audio input"),
])
def test_server_bad_image_parts(vision_server, part, why):
    r = _chat(vision_server, [part, {"type": "text", "text": "w5"}])
    assert r.status_code == 400 and why in r.text, r.text


def test_convert_mmproj_cli(tiny, tmp_path):
    from conftest import run_cli

    _, root = tiny
    r = run_cli("convert", str(root / "mm"), str(tmp_path / "mmproj.gguf"), "--mmproj")
    assert r.returncode == 0 and "4 tokens per image" in r.stderr, r.stderr
    assert load_vision(tmp_path / "mmproj.gguf").config.text_hidden_size == 64
    again = run_cli("convert", str(root / "mm"), str(tmp_path / "mmproj.gguf"), "--mmproj")
    assert again.returncode == 1 and "exists" in again.stderr


def test_preprocessing_matches_transformers():
    import numpy as np
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from gemmaspec.images import preprocess

    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (150, 209, 3), dtype=np.uint8))
    proc = Gemma3ImageProcessorPil(size={"height": 224, "width": 224}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    want = torch.as_tensor(np.asarray(proc(images=img, return_tensors="np")["pixel_values"][0]))
    assert torch.equal(preprocess(img, 224, [0.5] * 3, [0.5] * 3), want)


def test_chat_image_command(tiny, tmp_path):
    from conftest import run_cli

    _, root = tiny
    (tmp_path / "a.png").write_bytes(_png())
    lines = f"/image {tmp_path / 'a.png'}\nw5 w6\nw7\n/image {tmp_path / 'missing.png'}\n"
    r = run_cli("chat", "-m", str(root / "mm"), "--mmproj", str(root / "mm"), "--temp", "0", "-n", "4",
                "--spec-type", "none", stdin=lines)
    assert r.returncode == 0, r.stderr
    assert "goes with your next message" in r.stderr and "cannot read the image" in r.stderr
    assert r.stderr.count("prompt ") == 2  # two replies
    no_proj = run_cli("chat", "-m", str(root / "mm"), "-n", "2", stdin=f"/image {tmp_path / 'a.png'}\n")
    assert no_proj.returncode == 0 and "start chat with --mmproj" in no_proj.stderr


def test_prefill_never_splits_an_image(tiny):
    from gemmaspec.models.base import PREFILL_CHUNK

    _, root = tiny
    loaded, vision = load_checkpoint(root / "mm"), load_vision(root / "mm")
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=512)
    prompt = "w5 " * (PREFILL_CHUNK - 3) + "<start_of_image> w6 w7"  # the image straddles the first chunk's end
    ids, spans = image_prompt(loaded.tokenizer, vision.model, prompt, [prepare(_png(), vision.config)])
    assert spans[0].start < PREFILL_CHUNK < spans[0].end
    got = engine._prefill(ids, loaded.model.new_cache(512), images=[(s.start, s.embeddings) for s in spans])
    want = loaded.model.forward(torch.tensor(ids), loaded.model.new_cache(512),
                                images=[(s.start, s.embeddings) for s in spans])
    assert _rel(got.logits, want.logits) < 1e-5
