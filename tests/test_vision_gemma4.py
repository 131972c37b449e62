"""Gemma 4 images: the vision tower (variable-resolution encoder + multimodal embedder) and the target
after an image against transformers' ``Gemma4ForConditionalGeneration`` on tiny random checkpoints in
the real layout; the mmproj GGUF round trip; prompt expansion; draft-mtp after an image equals plain
decoding (greedy and seeded); a projector of the other Gemma generation is refused."""

import io
import json

import numpy as np
import pytest
import torch

from gemmaspec.engine import Engine, RequestStats
from gemmaspec.errors import InputError
from gemmaspec.images import patchify, prepare
from gemmaspec.loading import load_checkpoint
from gemmaspec.loading.vision import check_pair, load_vision, write_mmproj
from gemmaspec.multimodal import image_prompt
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.drafters import MTPDrafter, NgramDrafter
from tiny_gemma4_vision import BOI, EOI, IMG, MAX_SOFT_TOKENS, tiny_multimodal

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("g4v")
    return {True: tiny_multimodal(root / "mm"), False: tiny_multimodal(root / "causal", bidirectional=False)}, root


def _image(h, w, seed=0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _png(h=30, w=40, seed=0):
    buf = io.BytesIO()
    _image(h, w, seed).save(buf, "PNG")
    return buf.getvalue()


def _processed(images):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    proc = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=MAX_SOFT_TOKENS, pooling_kernel_size=3)
    return proc(images=images, return_tensors="pt")


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


IMAGES = [(50, 83), (120, 40)]  # a wide image and a tall one: different soft-token counts


def test_preprocessing_matches_transformers():
    imgs = [_image(h, w, i) for i, (h, w) in enumerate(IMAGES + [(7, 300), (300, 9), (12, 12)])]
    out = _processed(imgs)
    for i, img in enumerate(imgs):
        pixels, positions = patchify(img, 4, MAX_SOFT_TOKENS * 9, 3)
        n = pixels.shape[0]
        assert n == 9 * int(out["num_soft_tokens_per_image"][i])
        assert torch.equal(pixels, out["pixel_values"][i, :n])
        assert torch.equal(positions, out["image_position_ids"][i, :n].long())


def test_image_embeddings_match_transformers(tiny):
    refs, root = tiny
    imgs = [_image(h, w, i) for i, (h, w) in enumerate(IMAGES)]
    out = _processed(imgs)
    with torch.no_grad():
        want = refs[True].model.get_image_features(out["pixel_values"], out["image_position_ids"]).pooler_output
    hf = load_vision(root / "mm")
    assert hf.arch.name == "gemma4v" and hf.config.max_soft_tokens == MAX_SOFT_TOKENS and hf.config.num_kv_heads == 1
    ims = [prepare(_png_of(im), hf.config) for im in imgs]
    got = hf.model.embed(ims)
    assert [g.shape for g in got] == [(60, 64), (56, 64)] == [w.shape for w in want]
    assert all(_rel(g, w) < 1e-4 for g, w in zip(got, want))
    # the mmproj GGUF (llama.cpp's layout): exact in f32, f16 matrices within f16 rounding
    for outtype, tol in (("f32", 1e-4), ("f16", 5e-3)):
        v = load_vision(write_mmproj(root / "mm", root / f"mmproj-{outtype}.gguf", force=True, outtype=outtype))
        assert dataclass_eq(v.config, hf.config)
        assert all(_rel(g, w) < tol for g, w in zip(v.model.embed(ims), want))


def _png_of(img):
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def dataclass_eq(a, b):
    import dataclasses

    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    return da.pop("rms_norm_eps") == pytest.approx(db.pop("rms_norm_eps")) and da == db


@pytest.mark.parametrize("bidirectional", [True, False])
def test_target_logits_after_images_match_transformers(tiny, bidirectional):
    refs, root = tiny
    ref, path = refs[bidirectional], root / ("mm" if bidirectional else "causal")
    vision, target = load_vision(path).model, load_checkpoint(path).model
    assert target.config.bidirectional_vision is bidirectional
    imgs = [_image(h, w, i) for i, (h, w) in enumerate(IMAGES)]
    out = _processed(imgs)
    n = [int(k) for k in out["num_soft_tokens_per_image"]]
    g = torch.Generator().manual_seed(3)
    seg = lambda k: torch.randint(3, 290, (k,), generator=g).tolist()  # noqa: E731
    ids = [2] + seg(5) + [BOI] + [IMG] * n[0] + [EOI] + seg(9) + [BOI] + [IMG] * n[1] + [EOI] + seg(6)
    types = torch.tensor([[int(i == IMG) for i in ids]])
    kw = dict(input_ids=torch.tensor([ids]), pixel_values=out["pixel_values"],
              image_position_ids=out["image_position_ids"])
    with torch.no_grad():
        want = ref(**kw, mm_token_type_ids=types).logits[0]
        plain = ref(**kw).logits[0]
    assert (_rel(plain, want) > 1e-2) is bidirectional  # the image mask matters on sliding layers
    emb = vision.embed([prepare(_png_of(im), load_vision(path).config) for im in imgs])
    starts = [i for i in range(1, len(ids)) if ids[i] == IMG and ids[i - 1] != IMG]
    got = target.forward(torch.tensor(ids), target.new_cache(256), all_logits=True,
                         images=[(starts[0], emb[0]), (starts[1], emb[1])]).logits
    assert _rel(got, want) < 1e-4
    cut = starts[1] - 3  # two forwards, each holding one whole image
    cache = target.new_cache(256)
    got = torch.cat([target.forward(torch.tensor(ids[:cut]), cache, all_logits=True,
                                    images=[(starts[0], emb[0])]).logits,
                     target.forward(torch.tensor(ids[cut:]), cache, all_logits=True,
                                    images=[(starts[1] - cut, emb[1])]).logits])
    assert _rel(got, want) < 1e-4


def test_prompt_expansion(tiny):
    _, root = tiny
    loaded, vision = load_checkpoint(root / "mm"), load_vision(root / "mm")
    tok = loaded.tokenizer
    wide, tall = prepare(_png(50, 83), vision.config), prepare(_png(120, 40, 1), vision.config)
    assert vision.model.image_tokens(wide) == 60 and vision.model.image_tokens(tall) == 56
    ids, spans = image_prompt(tok, vision.model, "w5 <|image|> w6 <|image|> w7", [wide, tall])
    assert ids[:3] == [2, 5, BOI] and ids[3:63] == [IMG] * 60 and ids[63:65] == [EOI, 6]
    assert ids[65] == BOI and ids[66:122] == [IMG] * 56 and ids[122:] == [EOI, 7]
    assert [s.start for s in spans] == [3, 66] and [s.end for s in spans] == [63, 122]
    ids2, spans2 = image_prompt(tok, vision.model, "w5", [tall, wide])  # no marker: images first
    assert ids2.count(IMG) == 116 and ids2[-1] == 5 and [s.embeddings.shape[0] for s in spans2] == [56, 60]
    with pytest.raises(InputError, match="1 image markers"):
        image_prompt(tok, vision.model, "<|image|> w5", [wide, tall])


def test_projector_of_the_other_generation_is_refused(tiny, tmp_path):
    from tiny_gemma3_vision import tiny_multimodal as tiny_gemma3

    _, root = tiny
    tiny_gemma3(tmp_path / "g3")
    g3, g4 = load_checkpoint(tmp_path / "g3").model, load_checkpoint(root / "mm").model
    g3_proj = load_vision(write_mmproj(tmp_path / "g3", tmp_path / "g3.gguf"))
    with pytest.raises(InputError, match="gemma3 vision projector.*the model is gemma4: pass the model's own mmproj "
                                         r"file \(projector type gemma4v\)"):
        check_pair(g3_proj, g4.config)  # same width (64): only the architecture tells them apart
    with pytest.raises(InputError, match=r"gemma4v vision projector.*the model is gemma3.*projector type gemma3\)"):
        check_pair(load_vision(root / "mm"), g3.config)
    check_pair(load_vision(root / "mm"), g4.config)


def _assistant(root):
    from tiny_gemma4 import tiny_assistant

    tiny_assistant(seed=5).save_pretrained(root / "asst")
    return load_checkpoint(root / "asst").model


def test_draft_mtp_after_an_image_equals_plain(tiny):
    _, root = tiny
    loaded, vision = load_checkpoint(root / "mm"), load_vision(root / "mm")
    assistant = _assistant(root)
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=256)
    im = prepare(_png(50, 83), vision.config)
    ids, spans = image_prompt(loaded.tokenizer, vision.model, "w5 w6 w7 <|image|> w5 w6", [im])
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [t for ev in engine.generate(ids, greedy, images=spans) for t in ev.tokens]
    no_image = [t for ev in engine.generate(ids, greedy) for t in ev.tokens]
    assert plain != no_image  # the image's embeddings reach the output
    for drafter in (NgramDrafter(), MTPDrafter(assistant, loaded.model, engine.cache)):
        st = RequestStats()
        spec = [t for ev in engine.generate(ids, greedy, drafter, n_max=3, stats=st, images=spans) for t in ev.tokens]
        assert spec == plain, type(drafter).__name__
        assert IMG not in spec
        if isinstance(drafter, MTPDrafter):
            assert st.spec.drafted > 0  # the assistant drafted from the hidden state and KV after the image
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True)
    plain = [t for ev in engine.generate(ids, seeded, images=spans) for t in ev.tokens]
    st = RequestStats()
    spec = [t for ev in engine.generate(ids, seeded, MTPDrafter(assistant, loaded.model, engine.cache), n_max=3,
                                        stats=st, images=spans) for t in ev.tokens]
    assert spec == plain and st.spec.drafted > 0


def test_generate_and_convert_cli(tiny, tmp_path):
    from conftest import run_cli

    _, root = tiny
    (tmp_path / "a.png").write_bytes(_png(50, 83))
    r = run_cli("convert", str(root / "mm"), str(tmp_path / "mmproj.gguf"), "--mmproj")
    assert r.returncode == 0 and "gemma4v projector" in r.stderr and f"up to {MAX_SOFT_TOKENS} tokens" in r.stderr, r.stderr
    _assistant(tmp_path)
    args = ["generate", "-m", str(root / "mm"), "-p", "w5 w6", "--image", str(tmp_path / "a.png"),
            "--mmproj", str(tmp_path / "mmproj.gguf"), "--temp", "0", "-n", "10", "--ignore-eos"]
    plain = run_cli(*args, "--spec-type", "none")
    spec = run_cli(*args, "-md", str(tmp_path / "asst"), "--spec-type", "draft-mtp")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert plain.stdout == spec.stdout and "prompt 65 tokens" in plain.stderr  # BOS, BOI, 60 image tokens, EOI, w5, w6
    g3 = tmp_path / "g3"
    from tiny_gemma3_vision import tiny_multimodal as tiny_gemma3

    tiny_gemma3(g3)
    wrong = run_cli(*args[:7], "--mmproj", str(g3), "-n", "2")
    assert wrong.returncode == 1 and "projector type gemma4v" in wrong.stderr and "Traceback" not in wrong.stderr


@pytest.fixture(scope="module")
def vision_server(tiny, tmp_path_factory):
    from conftest import ServerProcess

    _, root = tiny
    s = ServerProcess(tmp_path_factory.mktemp("v4serve"), "-m", str(root / "mm"), "--mmproj", str(root / "mm"),
                      "-np", "1", "-c", "512")
    yield s
    s.close()


def test_server_image_and_audio_parts(vision_server):
    import base64

    import httpx

    url = "data:image/png;base64," + base64.b64encode(_png(50, 83)).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w5 w6"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0}
    r = httpx.post(vision_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 62  # the image's 60 soft tokens and BOI/EOI are in the prompt
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    r = httpx.post(vision_server.url + "/v1/chat/completions", json={**body, "messages": [
        {"role": "user", "content": [audio, parts[1]]}]}, timeout=60)
    assert r.status_code == 400 and "no audio input" in r.text


def test_config_from_checkpoint_metadata(tiny):
    _, root = tiny
    cfg = json.loads((root / "mm" / "config.json").read_text())
    c = load_vision(root / "mm").config
    v = cfg["vision_config"]
    assert (c.patch_size, c.pooling_kernel, c.position_embedding_size, c.head_dim) == (
        v["patch_size"], v["pooling_kernel_size"], v["position_embedding_size"], v["head_dim"])
    assert c.rope_theta == v["rope_parameters"]["rope_theta"] and c.text_hidden_size == cfg["text_config"]["hidden_size"]


def test_multimodal_data_with_images_of_different_sizes(vision_server, tiny):
    """llama-server's ``multimodal_data`` on ``/completion`` with a Gemma 4 tower: each ``<__media__>``
    becomes its own image's text (Gemma 4's soft-token count varies by image), so two images of
    different sizes give the prompt :func:`~gemmaspec.multimodal.marked_prompt` builds in-process."""
    import base64

    import httpx

    from gemmaspec.multimodal import marked_prompt

    models, root = tiny
    pngs = [_png(50, 83), _png(120, 40, seed=1)]
    text = "<__media__> w5 <__media__> w6"
    body = {"prompt": {"prompt_string": text, "multimodal_data": [base64.b64encode(p).decode() for p in pngs]},
            "n_predict": 4, "temperature": 0}
    r = httpx.post(vision_server.url + "/completion", json=body, timeout=60)
    assert r.status_code == 200, r.text
    vision = load_vision(root / "mm")
    loaded = load_checkpoint(root / "mm")
    images = [prepare(p, vision.config) for p in pngs]
    assert len({vision.model.image_tokens(im) for im in images}) == 2  # the two sizes differ in soft tokens
    ids, spans = marked_prompt(loaded.tokenizer, vision.model, text, images, "<__media__>")
    assert r.json()["tokens_evaluated"] == len(ids) and len(spans) == 2


def test_converted_target_keeps_the_image_mask(tiny, tmp_path):
    """A GGUF target attends to images as its checkpoint says: llama.cpp's rule when the file says
    nothing (bidirectional on sliding layers except at E2B/E4B widths, as llama-mtmd-cli decodes
    them), our own key only where the checkpoint disagrees with that rule."""
    import gguf

    from gemmaspec.loading.convert import convert
    from gemmaspec.loading.gguf import read_config
    from gemmaspec.models.config import llama_cpp_bidirectional_vision

    _, root = tiny
    assert llama_cpp_bidirectional_vision(64) and not llama_cpp_bidirectional_vision(1536)
    assert not llama_cpp_bidirectional_vision(2560)
    for name, bidirectional in (("mm", True), ("causal", False)):
        out = tmp_path / f"{name}.gguf"
        convert(root / name, out, "f32")
        keys = gguf.GGUFReader(out).fields
        assert ("gemma4.attention.bidirectional_vision" in keys) is (not bidirectional)
        assert read_config(out)[1].bidirectional_vision is bidirectional
    # the tiny tower has 2 heads over 1 KV head: llama.cpp would take 2 without its key
    fields = gguf.GGUFReader(write_mmproj(root / "mm", tmp_path / "mmproj.gguf")).fields
    assert fields["clip.vision.attention.head_count_kv"].contents() == 1
    assert "clip.vision.attention.head_dim" not in fields  # 32 wide / 2 heads = 16, the default
