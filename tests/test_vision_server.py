"""Images on the server's other front ends, against a tiny random Gemma 3 target with its vision
tower (tests/tiny_gemma3_vision.py): llama-server's ``multimodal_data`` on ``/completion``,
``/completions`` and ``/v1/completions`` (streamed or not, speculation on or off, equal to the
``image_url`` chat path and to ``generate --image``), its errors, and ``--allow-image-urls`` against a
local HTTP server."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading

import httpx
import pytest

from tiny_gemma3_vision import TOKENS_PER_IMAGE, tiny_multimodal

GREEDY = {"temperature": 0, "n_predict": 12, "ignore_eos": True, "cache_prompt": False}


def _png(size=(40, 30), color=(200, 30, 90)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


PNG, OTHER = _png(), _png(color=(0, 90, 10))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("g3vs")
    tiny_multimodal(root / "mm")
    return root


@pytest.fixture(scope="module")
def images_host():
    """A local HTTP server: /a.png (an image), /big.png (over the cap), /page (HTML), /missing (404),
    /redirect (to /a.png)."""
    big = _png(size=(1500, 1500), color=(1, 2, 3)) + b"\0" * (11 << 20)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            routes = {"/a.png": (200, "image/png", PNG), "/big.png": (200, "image/png", big),
                      "/page": (200, "text/html", b"<html></html>"), "/redirect": (302, None, b"")}
            code, kind, body = routes.get(self.path, (404, "text/plain", b"no"))
            self.send_response(code)
            if kind:
                self.send_header("Content-Type", kind)
            if code == 302:
                self.send_header("Location", "/a.png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def vserver(tiny, tmp_path_factory):
    from conftest import ServerProcess

    s = ServerProcess(tmp_path_factory.mktemp("vs"), "-m", str(tiny / "mm"), "--mmproj", str(tiny / "mm"), "-np", "2",
                      "-c", "256", "--spec-type", "ngram-simple", "--spec-draft-n-fixed", "--allow-image-urls")
    yield s
    s.close()


@pytest.fixture(scope="module")
def plain_server(tiny, tmp_path_factory):
    """The same model without --mmproj (text only), and without --allow-image-urls."""
    from conftest import ServerProcess

    s = ServerProcess(tmp_path_factory.mktemp("ps"), "-m", str(tiny / "mm"), "-np", "1", "-c", "256")
    yield s
    s.close()


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120)


def _stream(server, path, body) -> tuple[str, list]:
    """The text of a streamed response, and its events."""
    events = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    if path == "/v1/completions":
        return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events
    return "".join(e.get("content", "") for e in events), events


def _chat_text_prompt(server, text: str) -> str:
    """The chat template's prompt for one user message (``/apply-template``)."""
    return _post(server, "/apply-template", {"messages": [{"role": "user", "content": text}]}).json()["prompt"]


def test_multimodal_data_equals_generate_image_and_chat_image_url(vserver, tiny, tmp_path):
    from conftest import run_cli

    obj = {"prompt_string": "<__media__>w5 w6", "multimodal_data": [_b64(PNG)]}
    r = _post(vserver, "/completion", {"prompt": obj, **GREEDY, "speculative.n_max": 0})
    assert r.status_code == 200, r.text
    text = r.json()["content"]
    assert r.json()["tokens_evaluated"] == 9  # BOS, BOI, 4 image tokens, EOI, w5, w6
    without = _post(vserver, "/completion", {"prompt": "w5 w6", **GREEDY}).json()["content"]
    assert text != without  # the image reaches the output
    # generate --image: the images first, then the prompt (the same tokens), greedy
    (tmp_path / "a.png").write_bytes(PNG)
    cli = run_cli("generate", "-m", str(tiny / "mm"), "--mmproj", str(tiny / "mm"), "-p", "w5 w6", "--image",
                  str(tmp_path / "a.png"), "--temp", "0", "-n", "12", "--ignore-eos", "--spec-type", "none")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == text + "\n"  # generate ends its output with a newline
    # the OpenAI image_url path, against /completion with the template's text and a marker where the image is
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(PNG)}},
             {"type": "text", "text": "w5 w6"}]
    chat = _post(vserver, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 12,
                                                   "temperature": 0, "ignore_eos": True, "cache_prompt": False})
    assert chat.status_code == 200, chat.text
    templ = _chat_text_prompt(vserver, "w5 w6").replace("w5 w6", "<__media__>w5 w6")
    native = _post(vserver, "/completion", {"prompt": {"prompt_string": templ, "multimodal_data": [_b64(PNG)]},
                                            **GREEDY})
    assert native.json()["content"] == chat.json()["choices"][0]["message"]["content"]
    assert native.json()["tokens_evaluated"] == chat.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path", ["/completion", "/completions", "/v1/completions"])
def test_multimodal_data_every_path_speculation_on_and_off(vserver, path):
    obj = {"prompt_string": "w7 <__media__> w5 w6 w5 w6", "multimodal_data": [_b64(PNG)]}
    body = {"prompt": obj, **GREEDY, "max_tokens": 24, "n_predict": 24}
    texts, drafted = [], 0
    for n_max in (0, 3):
        whole = _post(vserver, path, {**body, "speculative.n_max": n_max})
        assert whole.status_code == 200, whole.text
        js = whole.json()
        texts.append(js["choices"][0]["text"] if path == "/v1/completions" else js["content"])
        streamed, events = _stream(vserver, path, {**body, "speculative.n_max": n_max})
        texts.append(streamed)
        if n_max:
            drafted += js["timings"]["draft_n"]
    assert len(set(texts)) == 1 and texts[0], texts
    assert drafted > 0  # speculation did draft after the image


def test_multimodal_data_several_prompts_and_images(vserver):
    one = {"prompt_string": "<__media__>w5 w6", "multimodal_data": [_b64(PNG)]}
    two = {"prompt_string": "w5 <__media__> w6 <__media__>", "multimodal_data": [_b64(PNG), _b64(OTHER)]}
    swapped = {**two, "multimodal_data": [_b64(OTHER), _b64(PNG)]}
    r = _post(vserver, "/completion", {"prompt": [one, "w5 w6", two, swapped], **GREEDY})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [g["index"] for g in got] == [0, 1, 2, 3]
    alone = _post(vserver, "/completion", {"prompt": one, **GREEDY}).json()["content"]
    assert got[0]["content"] == alone
    assert got[2]["tokens_evaluated"] == 1 + 2 + 2 * (TOKENS_PER_IMAGE + 2)
    assert got[2]["content"] != got[3]["content"]  # the images are taken in order
    v1 = _post(vserver, "/v1/completions", {"prompt": [one, two], **GREEDY, "max_tokens": 12})
    assert [c["text"] for c in sorted(v1.json()["choices"], key=lambda c: c["index"])] == \
        [got[0]["content"], got[2]["content"]]
    text, events = _stream(vserver, "/completion", {"prompt": [one, two], **GREEDY})
    by_index = {i: "".join(e.get("content", "") for e in events if e.get("index") == i) for i in (0, 1)}
    assert by_index == {0: got[0]["content"], 1: got[2]["content"]}


@pytest.mark.parametrize("prompt, why", [
    ({"prompt_string": "w5 w6", "multimodal_data": [_b64(PNG)]}, "0 <__media__> markers for 1 images"),
    ({"prompt_string": "<__media__> <__media__>", "multimodal_data": [_b64(PNG)]}, "2 <__media__> markers for 1"),
    ({"prompt_string": "<__media__>", "multimodal_data": ["!!"]}, "prompt.multimodal_data[0]: malformed base64"),
    ({"prompt_string": "<__media__>", "multimodal_data": ["AAAA"]}, "not an image format"),
    ({"prompt_string": "<__media__>", "multimodal_data": "AAAA"}, "must be an array of base64"),
    ({"prompt_string": [5, "<__media__>"], "multimodal_data": [_b64(PNG)]}, "prompt_string must be text"),
])
@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_multimodal_data_errors(vserver, prompt, why, path):
    r = _post(vserver, path, {"prompt": prompt, "n_predict": 2})
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert "Traceback" not in r.text


def test_without_mmproj_images_are_a_clear_400(plain_server):
    obj = {"prompt_string": "<__media__>w5", "multimodal_data": [_b64(PNG)]}
    for path in ("/completion", "/v1/completions"):
        r = _post(plain_server, path, {"prompt": obj, "n_predict": 2})
        assert r.status_code == 400 and "start it with --mmproj FILE" in r.json()["error"]["message"], r.text
    ok = _post(plain_server, "/completion", {"prompt": {"prompt_string": "w5", "multimodal_data": []}, "n_predict": 2})
    assert ok.status_code == 200  # no images: a text prompt
    assert httpx.get(plain_server.url + "/props").json()["modalities"]["vision"] is False


def _chat_url(server, url):
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w5 w6"}]
    return _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 8,
                                                  "temperature": 0, "ignore_eos": True, "cache_prompt": False})


def test_image_urls_fetched_with_the_flag(vserver, images_host):
    inline = _chat_url(vserver, "data:image/png;base64," + _b64(PNG))
    fetched = _chat_url(vserver, images_host + "/a.png")
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["choices"][0]["message"]["content"] == inline.json()["choices"][0]["message"]["content"]
    assert _chat_url(vserver, images_host + "/redirect").status_code == 200
    for path, why in [("/missing", "answered HTTP 404"), ("/page", "Content-Type is text/html, not an image"),
                      ("/big.png", "more than the 10 MiB")]:
        r = _chat_url(vserver, images_host + path)
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    closed = _chat_url(vserver, "http://127.0.0.1:9/a.png")  # nothing listens on the discard port
    assert closed.status_code == 400 and "the fetch failed" in closed.json()["error"]["message"]


def test_image_urls_refused_by_default(tiny, images_host, tmp_path):
    from conftest import ServerProcess

    s = ServerProcess(tmp_path, "-m", str(tiny / "mm"), "--mmproj", str(tiny / "mm"), "-np", "1", "-c", "256")
    try:
        r = _chat_url(s, images_host + "/a.png")
        assert r.status_code == 400 and "--allow-image-urls" in r.json()["error"]["message"], r.text
    finally:
        s.close()


def test_images_with_several_choices_are_a_400(vserver):
    obj = {"prompt_string": "<__media__>w5", "multimodal_data": [_b64(PNG)]}
    r = _post(vserver, "/v1/completions", {"prompt": obj, "max_tokens": 2, "n": 2})
    assert r.status_code == 400 and "n > 1 is not supported together with images" in r.json()["error"]["message"]
