"""The chat page at / in real headless Chromium (Debian's package, driven by playwright's driver):
type a message, see a streamed reply with its tokens/s and acceptance; the stop button ends a reply
and frees the slot."""

from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package 'chromium'; "
                                                          ".ci/run installs it when it runs as root)")


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        pg = browser.new_page()
        pg.set_default_timeout(120_000)
        pg.goto(server.url + "/")
        yield pg
        pg.screenshot(path=str(tmp_path_factory.mktemp("chat") / "chat.png"))
        browser.close()


def test_chat_page_streams_a_reply_with_stats(page):
    page.fill("#max-tokens", "24")
    page.fill("#temperature", "0")
    page.wait_for_function("document.getElementById('model').textContent.includes('gguf')")
    page.fill("#input", "Write the numbers from 1 to 10.")
    page.press("#input", "Enter")
    assert page.locator(".msg.user").first.inner_text() == "Write the numbers from 1 to 10."
    page.wait_for_selector(".msg.assistant[data-done='1']")
    reply = page.locator(".msg.assistant .text").last.inner_text()
    stats = page.locator(".msg.assistant .stats").last.inner_text()
    assert reply.strip()
    assert "24 tokens" in stats and "tokens/s" in stats and "acceptance" in stats, stats
    assert page.locator(".msg.error").count() == 0


def test_stop_button_ends_the_reply_and_frees_the_slot(page, server):
    page.fill("#max-tokens", "1500")
    n = page.locator(".msg.assistant").count()
    page.fill("#input", "Tell me a very long story about a lighthouse keeper.")
    page.click("#send")
    page.wait_for_function(f"document.querySelectorAll('.msg.assistant .text')[{n}]?.textContent.length > 10")
    assert page.is_enabled("#stop")
    page.click("#stop")
    page.wait_for_selector(f".msg.assistant >> nth={n}", state="attached")
    page.wait_for_function(f"document.querySelectorAll('.msg.assistant')[{n}].dataset.done === '1'")
    assert "stopped" in page.locator(".msg.assistant .stats").nth(n).inner_text()
    deadline = time.monotonic() + 30
    while any(s["is_processing"] for s in httpx.get(server.url + "/slots").json()):
        assert time.monotonic() < deadline, "the stopped reply still holds its slot"
        time.sleep(0.1)
