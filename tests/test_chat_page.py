"""The chat page at / in real headless Chromium (Debian's package, driven by playwright's driver),
against the default server (the embedded base model, `ngram-simple,draft-mtp`): a conversation with a
highlighted code block and its copy button, markdown that cannot carry HTML, conversations kept over a
reload, settings that reach the request, Stop keeping a reply's figures, and token colours that match
the provenance the server streamed for that reply, and the base-model notice with text completion by
default. The tests run in order on one page."""

from __future__ import annotations

import json
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

CODE_PROMPT = "```python\ndef add(a, b):\n    return a + b\n```\nExplain this code."  # the base model echoes the block
STORY_PROMPT = "Once upon a time, there was a little girl named Lily."  # greedy: both drafters' drafts accepted


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        ctx = browser.new_context()
        ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
        pg = ctx.new_page()
        pg.set_default_timeout(60_000)
        pg.on("dialog", lambda d: d.accept())  # confirm() before deleting a conversation
        pg.goto(server.url + "/")
        pg.wait_for_function("document.getElementById('model').textContent.includes('gguf')")
        yield pg
        pg.screenshot(path=str(tmp_path_factory.mktemp("chat") / "chat.png"))
        browser.close()


def settings(page, **fields):
    """Set fields of the settings panel (by element id) and close it."""
    page.click("#open-settings")
    for name, value in fields.items():
        sel = "#" + name.replace("_", "-")
        if page.eval_on_selector(sel, "e => e.tagName") == "SELECT":
            page.select_option(sel, value=value)
        else:
            page.fill(sel, value)
    page.click("#close-settings")


def send(page, text: str) -> int:
    """Send a message; returns the index of its reply among the page's replies, once it is done."""
    n = page.locator(".msg.assistant").count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_selector(f".msg.assistant >> nth={n}")
    page.wait_for_function(f"document.querySelectorAll('.msg.assistant')[{n}].dataset.done === '1'")
    return n


def test_a_reply_renders_markdown_with_highlighted_code_and_copies_it(page):
    assert page.is_visible("#empty")  # the empty-state hint
    page.wait_for_function("document.getElementById('model').textContent.includes('·')")  # /props has been read
    assert page.is_hidden("#attach")  # no vision tower (--mmproj): no attach button
    settings(page, mode="chat", max_tokens="48", temperature="0", seed="", top_k="", spec="on", n_max="")
    i = send(page, CODE_PROMPT)
    assert page.locator(".msg.user").first.inner_text().startswith(CODE_PROMPT)
    reply = page.locator(".msg.assistant").nth(i)
    stats = reply.locator(".stats").inner_text()
    assert "48 tokens" in stats and "tokens/s" in stats and "acceptance" in stats and "TTFT" in stats, stats
    code = reply.locator(".code pre code.hljs").first
    assert code.count() == 1, reply.inner_html()
    assert code.locator("span[class^='hljs-']").count() >= 2  # highlighted, not just escaped
    assert "def " in code.inner_text()
    reply.locator(".copy-code").first.click()
    page.wait_for_function("document.querySelector('.copy-code').textContent === 'copied'")
    assert page.evaluate("navigator.clipboard.readText()") == code.evaluate("e => e.textContent")
    page.wait_for_function("document.querySelector('.copy-code').textContent === 'copy'")
    assert page.locator(".msg.error").count() == 0


def test_markdown_from_the_model_cannot_carry_html(page):
    html = page.evaluate("""async () => {
        const m = await import('./static/markdown.js');
        return m.renderMarkdown('**bold** <img src=x onerror="window.pwned=1"> <script>window.pwned=1</script>\\n\\n' +
                                '[a](javascript:alert(1)) [b](https://example.com) ![c](http://example.com/c.png)');
    }""")
    page.evaluate("h => { const d = document.createElement('div'); d.innerHTML = h; document.body.append(d); }",
                  html)
    assert "<strong>bold</strong>" in html and "&lt;img" in html and "&lt;script&gt;" in html
    assert "<img" not in html and "<script" not in html and "javascript:" not in html
    assert '<a href="https://example.com"' in html and "[image: c]" in html
    assert page.evaluate("window.pwned") is None


def test_conversations_survive_a_reload_and_can_be_renamed_and_deleted(page):
    before = page.locator("#log .msg").all_inner_texts()
    page.reload()
    page.wait_for_selector(".msg.assistant[data-done='1']")
    assert page.locator("#log .msg").all_inner_texts() == before  # text, figures and buttons
    assert page.locator("#chats li").count() == 1
    assert page.locator("#chats li .title").inner_text().startswith("```python def add(a, b):")  # its first message
    page.click("#chats li .rename")
    page.fill("#chats .rename-box", "Code")
    page.press("#chats .rename-box", "Enter")
    page.click("#new-chat")
    assert page.is_visible("#empty") and page.locator("#chats li").count() == 2
    page.reload()
    assert page.locator("#chats li .title").all_inner_texts()[1] == "Code"
    page.locator("#chats li").nth(0).locator(".delete").click()  # the empty new one
    assert page.locator("#chats li .title").all_inner_texts() == ["Code"]
    assert page.locator("#log .msg").all_inner_texts() == before  # the remaining conversation is shown again


def test_settings_change_the_request_sent(page, server):
    page.click("#new-chat")
    settings(page, system="Answer briefly.", top_k="7", seed="42", n_max="1", max_tokens="8", temperature="0.9")
    with page.expect_request("**/v1/chat/completions") as req:
        send(page, "Name a colour.")
    body = req.value.post_data_json
    assert body["messages"][0] == {"role": "system", "content": "Answer briefly."}
    assert body["messages"][1] == {"role": "user", "content": "Name a colour."}
    assert (body["top_k"], body["seed"], body["speculative.n_max"], body["max_tokens"], body["temperature"]) == \
        (7, 42, 1, 8, 0.9)
    assert body["return_provenance"] is True and body["stream"] is True
    params = [s["params"] for s in httpx.get(server.url + "/slots").json() if "params" in s]  # slots used so far
    assert any(p["top_k"] == 7 and p["seed"] == 42 and p["speculative.n_max"] == 1 for p in params), params
    settings(page, spec="off")
    with page.expect_request("**/v1/chat/completions") as req:
        page.click(".msg.assistant .regen")
    assert req.value.post_data_json["speculative.n_max"] == 0
    page.wait_for_function("document.querySelector('.msg.assistant').dataset.done === '1'")
    assert "(0/0 drafts)" in page.locator(".msg.assistant .stats").inner_text()


def test_edit_a_message_and_copy_a_reply(page):
    page.locator(".msg.assistant .copy-msg").click()
    page.wait_for_function("document.querySelector('.msg.assistant .copy-msg').textContent === 'copied'")
    kept = page.evaluate("""() => { const d = JSON.parse(localStorage.getItem('gemmaspec-chats-v1'));
                                    return d.chats.find(c => c.id === d.current).messages[1].content; }""")
    assert kept.strip() and page.evaluate("navigator.clipboard.readText()") == kept
    page.click(".msg.user .edit")
    page.fill(".msg.user .edit-box", "Name a fruit.")
    with page.expect_request("**/v1/chat/completions") as req:
        page.click(".msg.user .save-edit")
    assert req.value.post_data_json["messages"][1:] == [{"role": "user", "content": "Name a fruit."}]
    page.wait_for_function("document.querySelector('.msg.assistant')?.dataset.done === '1'")
    assert page.locator("#log .msg.user").all_inner_texts()[0].startswith("Name a fruit.")
    assert page.locator("#log .msg").count() == 2  # the edited message and its new reply, nothing else


def test_stop_keeps_the_replys_figures_and_frees_the_slot(page, server):
    page.click("#new-chat")
    settings(page, mode="chat", system="", top_k="", seed="", n_max="", spec="on", max_tokens="1500", temperature="0")
    page.fill("#input", "Tell me a very long story about a lighthouse keeper.")
    page.click("#send")
    page.wait_for_function("document.querySelector('.msg.assistant .text')?.textContent.length > 20")
    assert page.is_enabled("#stop")
    page.click("#stop")
    page.wait_for_function("document.querySelector('.msg.assistant').dataset.done === '1'")
    stats = page.locator(".msg.assistant .stats").inner_text()
    assert "stopped" in stats and "tokens/s" in stats and "acceptance" in stats and "TTFT" in stats, stats
    assert int(stats.split(" tokens")[0]) > 3
    deadline = time.monotonic() + 30
    while any(s["is_processing"] for s in httpx.get(server.url + "/slots").json()):
        assert time.monotonic() < deadline, "the stopped reply still holds its slot"
        time.sleep(0.1)
    page.reload()
    assert "stopped" in page.locator(".msg.assistant .stats").inner_text()  # kept with the conversation


def _expected_tokens(sse: str) -> list[tuple]:
    """(source, text, rejected) per token the server streamed, text going with the chunk's last token."""
    out = []
    for line in sse.splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        c = json.loads(line[5:])
        if not c["choices"] or "provenance" not in c["choices"][0]:
            continue
        prov, text = c["choices"][0]["provenance"], c["choices"][0]["delta"].get("content") or ""
        for k, e in enumerate(prov):
            out.append((e["source"], text if k == len(prov) - 1 else "", e.get("rejected") or None))
    return out


def test_token_colours_match_the_servers_provenance(page):
    page.click("#new-chat")
    settings(page, max_tokens="64", temperature="0")

    def fixed_lengths(route):  # the server chooses draft lengths from measured timings; pin n-max so both
        body = json.loads(route.request.post_data)  # drafters draft whatever the machine's load
        route.continue_(post_data=json.dumps({**body, "speculative.n_fixed": True}))

    page.route("**/v1/chat/completions", fixed_lengths)
    try:
        with page.expect_response("**/v1/chat/completions") as resp:
            i = send(page, STORY_PROMPT)
    finally:
        page.unroute("**/v1/chat/completions", fixed_lengths)
    expected = _expected_tokens(resp.value.text())
    reply = page.locator(".msg.assistant").nth(i)
    reply.locator(".toggle-tokens").click()
    spans = reply.locator(".tok").evaluate_all("""ss => ss.map(s => [s.dataset.source || null, s.textContent,
                                                      s.dataset.rejected ? JSON.parse(s.dataset.rejected) : null,
                                                      s.title])""")
    assert [tuple(s[:3]) for s in spans] == [tuple(e) for e in expected]
    sources = {s[0] for s in spans}
    assert {"draft-mtp", "ngram-simple", "target"} <= sources, sources  # both drafters of the default list
    rejected = [s for s in spans if s[2]]
    assert rejected and all(all(json.dumps(t, ensure_ascii=False) in s[3] for t in s[2]) for s in rejected)  # hover
    accepted = sum(1 for s in spans if s[0] not in (None, "target"))
    stats = reply.locator(".stats").inner_text()
    assert f"({accepted}/" in stats, stats  # drafter-coloured tokens = the accepted drafts of the figures
    legend = reply.locator(".legend").inner_text()
    assert f"MTP assistant (accepted draft): {sum(s[0] == 'draft-mtp' for s in spans)}" in legend
    first = reply.locator(".pos-value[data-pos='0']").inner_text()
    assert first.split(" ")[0].split("/")[0] != "0"  # the first draft position was accepted at least once
    page.check("#spec-view")  # every reply in the token view, kept over a reload
    page.reload()
    assert page.locator(".msg.assistant .tok").count() == len(spans)
    page.uncheck("#spec-view")


def test_dark_mode_and_a_narrow_screen(page):
    bg = "getComputedStyle(document.body).backgroundColor"
    page.emulate_media(color_scheme="dark")
    dark = page.evaluate(bg)
    page.emulate_media(color_scheme="light")
    light = page.evaluate(bg)
    assert dark != light
    page.click("#theme")  # auto -> dark, whatever the system says
    assert page.evaluate("document.documentElement.dataset.theme") == "dark" and page.evaluate(bg) == dark
    page.click("#theme")
    page.click("#theme")  # back to the system's
    page.set_viewport_size({"width": 360, "height": 700})
    assert not page.is_visible("#sidebar")  # folded away; the ☰ button shows it
    page.click("#toggle-sidebar")
    assert page.is_visible("#sidebar")
    page.click("#close-sidebar")
    assert not page.is_visible("#sidebar")
    page.click("#open-settings")
    box = page.locator("#apikey").bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 360 and box["width"] >= 200
    page.click("#close-settings")
    page.set_viewport_size({"width": 1280, "height": 800})


def test_text_completion_mode(page):
    page.click("#new-chat")
    settings(page, mode="completion", max_tokens="16", temperature="0")
    with page.expect_request("**/completion") as req:
        i = send(page, "def fib(n):\n    if n < 2:\n        return n\n    return")
    body = req.value.post_data_json
    assert body["prompt"].startswith("def fib(n):") and body["n_predict"] == 16 and "messages" not in body
    reply = page.locator(".msg.assistant").nth(i)
    assert reply.locator(".text.plain").count() == 1 and reply.inner_text().strip()
    assert "16 tokens" in reply.locator(".stats").inner_text()
    settings(page, mode="auto")


def test_a_base_model_gets_a_notice_and_text_completion_by_default(page):
    """The default model is a base model (/props: is_base_model): the page says so, and its automatic mode
    sends text completions; choosing chat keeps the notice, which then points back to text completion."""
    page.click("#new-chat")
    settings(page, mode="auto", max_tokens="8", temperature="0")
    notice = page.locator("#notice")
    assert notice.is_visible() and "base model" in notice.inner_text() and "text completions" in notice.inner_text()
    with page.expect_request("**/completion") as req:
        send(page, "The capital of France is")
    assert req.value.url.endswith("/completion") and "prompt" in req.value.post_data_json
    settings(page, mode="chat")
    assert notice.is_visible() and "switches to text completion" in notice.inner_text()
    settings(page, mode="auto")
