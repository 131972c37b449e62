"""The chat page's images in real headless Chromium (as tests/test_chat_page.py drives it), against a
tiny random Gemma 3 target served with its vision tower (--mmproj): the attach button shown because
/props says ``modalities.vision``, images attached by the file picker, by paste and by drop,
thumbnails in the composer and in the sent message, the request's image_url parts (downscaled JPEG
data URLs), replies equal to the API's for the same request, speculation on and off alike, a
conversation with images kept over a reload, and /completion's multimodal_data in text-completion
mode. The tests run in order on one page."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest

from test_chat_page import ARGS, CHROMIUM, send, settings
from tiny_gemma3_vision import tiny_multimodal

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package 'chromium')")


def _png(size, color) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vserver(tmp_path_factory):
    from conftest import ServerProcess

    root = tmp_path_factory.mktemp("pgv")
    tiny_multimodal(root / "mm")
    s = ServerProcess(root, "-m", str(root / "mm"), "--mmproj", str(root / "mm"), "-np", "2", "-c", "256",
                      "--spec-type", "ngram-simple", "--spec-draft-n-fixed")
    yield s
    s.close()


@pytest.fixture(scope="module")
def page(vserver, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        pg = browser.new_context().new_page()
        pg.set_default_timeout(60_000)
        pg.goto(vserver.url + "/")
        pg.wait_for_function("!document.getElementById('attach').hidden")  # /props: modalities.vision
        yield pg
        pg.screenshot(path=str(tmp_path_factory.mktemp("chatimg") / "chat.png"))
        browser.close()


def _give(page, how: str, png: bytes, name: str = "x.png"):
    """Paste or drop a PNG onto the composer, as the browser delivers them (a DataTransfer of files)."""
    page.evaluate("""([how, b64, name]) => {
        const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], name, { type: "image/png" }));
        if (how === "paste") document.getElementById("input").dispatchEvent(
            new ClipboardEvent("paste", { clipboardData: dt, bubbles: true, cancelable: true }));
        else document.getElementById("form").dispatchEvent(
            new DragEvent("drop", { dataTransfer: dt, bubbles: true, cancelable: true }));
    }""", [how, base64.b64encode(png).decode(), name])


def _thumbs(page, n: int):
    page.wait_for_function(f"document.querySelectorAll('#attachments .thumb img').length === {n}")


def _api_reply(vserver, body: dict, path: str) -> str:
    """The server's answer to the page's request, asked again without streaming."""
    plain = {k: v for k, v in body.items() if k not in ("stream", "return_provenance", "timings_per_token")}
    r = httpx.post(vserver.url + path, json=plain, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["content"] if path == "/completion" else r.json()["choices"][0]["message"]["content"]


def _size(data_url: str) -> tuple[int, int]:
    from PIL import Image

    assert data_url.startswith("data:image/jpeg;base64,")
    return Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1]))).size


def test_attach_by_picker_paste_and_drop_then_send(page, vserver, tmp_path):
    settings(page, mode="chat", max_tokens="8", temperature="0", spec="on", n_max="3")
    big = tmp_path / "big.png"
    big.write_bytes(_png((1200, 600), (200, 30, 90)))
    page.set_input_files("#file", str(big))
    _thumbs(page, 1)
    _give(page, "paste", _png((40, 30), (0, 90, 10)))
    _thumbs(page, 2)
    _give(page, "drop", _png((30, 40), (10, 10, 200)))
    _thumbs(page, 3)
    page.locator("#attachments .remove-image").nth(1).click()  # the pasted one goes
    _thumbs(page, 2)
    _give(page, "paste", b"not an image", "notes.png")  # claims image/png; the browser cannot decode it
    page.wait_for_selector(".msg.error >> text=notes.png: not an image the browser can read")
    _thumbs(page, 2)
    page.evaluate("document.querySelectorAll('.msg.error').forEach(e => e.remove())")
    with page.expect_request("**/v1/chat/completions") as req:
        i = send(page, "w5 w6")
    body = req.value.post_data_json
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"] and parts[2]["text"] == "w5 w6"
    assert _size(parts[0]["image_url"]["url"]) == (896, 448)  # downscaled to the tower's side
    assert _size(parts[1]["image_url"]["url"]) == (30, 40)  # small ones keep their size
    assert page.locator("#attachments .thumb").count() == 0 and page.is_hidden("#attachments")
    assert page.locator(".msg.user .images img").count() == 2
    reply = page.locator(".msg.assistant").nth(i)
    text = reply.locator(".text").inner_text()
    assert text.strip() and text.strip() == _api_reply(vserver, body, "/v1/chat/completions").strip()


def test_speculation_off_gives_the_same_reply(page):
    on = page.locator(".msg.assistant .text").first.inner_text()
    settings(page, spec="off")
    with page.expect_request("**/v1/chat/completions") as req:
        page.click(".msg.assistant .regen")
    page.wait_for_function("document.querySelector('.msg.assistant')?.dataset.done === '1'")
    assert req.value.post_data_json["speculative.n_max"] == 0
    assert "image_url" in json.dumps(req.value.post_data_json["messages"])  # the images are sent again
    assert page.locator(".msg.assistant .text").first.inner_text() == on
    settings(page, spec="on")


def test_images_survive_a_reload(page):
    before = page.locator(".msg.user .images img").evaluate_all("imgs => imgs.map(i => i.src)")
    page.reload()
    page.wait_for_selector(".msg.assistant[data-done='1']")
    page.wait_for_function("!document.getElementById('attach').hidden")
    assert page.locator(".msg.user .images img").evaluate_all("imgs => imgs.map(i => i.src)") == before
    with page.expect_request("**/v1/chat/completions") as req:  # regenerating after the reload: the same images
        page.click(".msg.assistant .regen")
    page.wait_for_function("document.querySelector('.msg.assistant')?.dataset.done === '1'")
    sent = [p["image_url"]["url"] for p in req.value.post_data_json["messages"][0]["content"] if p["type"] == "image_url"]
    assert sent == before


def test_text_completion_mode_sends_multimodal_data(page, vserver, tmp_path):
    page.click("#new-chat")
    settings(page, mode="completion", max_tokens="8", temperature="0")
    (tmp_path / "a.png").write_bytes(_png((40, 30), (200, 30, 90)))
    page.set_input_files("#file", str(tmp_path / "a.png"))
    _thumbs(page, 1)
    with page.expect_request("**/completion") as req:
        i = send(page, "w5 w6")
    body = req.value.post_data_json
    assert body["prompt"]["prompt_string"] == "<__media__>w5 w6" and len(body["prompt"]["multimodal_data"]) == 1
    reply = page.locator(".msg.assistant").nth(i).locator(".text").inner_text()
    assert reply.strip() and reply == _api_reply(vserver, body, "/completion")
    settings(page, mode="auto")
