"""`gemmaspec serve` as llama-server (issue 13, the features llama.cpp's own server tests use):
``system_fingerprint`` shaped like a build string, ``n_probs`` with ``post_sampling_probs``,
``timings_per_token``, ``return_progress``, ``__verbose``, ``logit_bias`` keyed by text, JSON-object
prompts, continuing a final assistant message, ``/chat/completions/input_tokens``, model aliases and
tags, and the ``--no-slots``, ``--no-ui``, ``--verbose`` and ``--chat-template`` flags."""

from __future__ import annotations

import json
import math
import re

import httpx
import openai
import pytest

from conftest import ServerProcess, run_cli

CTX = 512
PROMPT = "Today was the day. Today I would finally become a"
LONG = "apples, pears, plums, figs, " * 48  # ~300 tokens: two 256-token prefill chunks


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("serve-llama"), "-np", "2", "-c", str(CTX), "-a", "zeta,alpha",
                      "--tags", "chat,small", "--temp", "0")
    yield s
    s.close()


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=120)


def _stream(srv, path, body) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]


def _err(resp, *needles):
    assert resp.status_code == 400, resp.text
    msg = resp.json()["error"]["message"]
    for n in needles:
        assert n in msg, msg


CHAT = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]}


# ---- system_fingerprint -----------------------------------------------------------------------------------

def test_system_fingerprint_is_a_build_string_everywhere(srv, oai):
    from gemmaspec import __version__

    want = f"b0-gemmaspec-{__version__}"
    got = [oai.chat.completions.create(model="x", messages=CHAT["messages"], max_tokens=2).system_fingerprint,
           oai.completions.create(model="x", prompt=PROMPT, max_tokens=2).system_fingerprint]
    for chunk in oai.chat.completions.create(model="x", messages=CHAT["messages"], max_tokens=3, stream=True,
                                             stream_options={"include_usage": True}):
        got.append(chunk.system_fingerprint)
    for chunk in oai.completions.create(model="x", prompt=PROMPT, max_tokens=3, stream=True):
        got.append(chunk.system_fingerprint)
    assert len(got) > 8 and set(got) == {want} and want.startswith("b")
    assert httpx.get(srv.url + "/props").json()["build_info"] == want


# ---- n_probs with post_sampling_probs ------------------------------------------------------------------------

def test_post_sampling_probs_are_the_sampling_distribution(srv):
    body = {"prompt": PROMPT, "n_probs": 10, "n_predict": 5, "temperature": 1.0, "top_k": 3, "seed": 1,
            "post_sampling_probs": True, "ignore_eos": True}
    r = _post(srv, "/completion", body).json()
    probs = r["completion_probabilities"]
    assert len(probs) == 5
    for tok in probs:
        assert "logprob" not in tok and 0 < tok["prob"] <= 1 and isinstance(tok["bytes"], list)
        top = tok["top_probs"]
        assert 1 <= len(top) <= 3  # top_k 3: only the candidates that survived, each above 0
        assert all(0 < p["prob"] <= 1 and "token" in p and "bytes" in p for p in top)
        assert [p["prob"] for p in top] == sorted((p["prob"] for p in top), reverse=True)
        assert math.isclose(sum(p["prob"] for p in top), 1.0, rel_tol=1e-9)  # all candidates listed: they sum to 1
        assert tok["id"] in [p["id"] for p in top]
        assert tok["prob"] == next(p["prob"] for p in top if p["id"] == tok["id"])
    # the model's log-probabilities without the flag: the same tokens (same seed), other numbers
    plain = _post(srv, "/completion", {**body, "post_sampling_probs": False}).json()["completion_probabilities"]
    assert [t["id"] for t in plain] == [t["id"] for t in probs]
    assert all("logprob" in t and len(t["top_logprobs"]) == 10 for t in plain)
    # greedy: the chosen token has probability 1, alone
    greedy = _post(srv, "/completion", {**body, "temperature": 0}).json()["completion_probabilities"]
    assert all(t["prob"] == 1.0 and [p["id"] for p in t["top_probs"]] == [t["id"]] for t in greedy)
    # streamed: one entry per event, same numbers
    events = [e for e in _stream(srv, "/completion", body) if not e["stop"]]
    streamed = [p for e in events for p in e["completion_probabilities"]]
    assert [(t["id"], t["prob"]) for t in streamed] == [(t["id"], t["prob"]) for t in probs]


def test_post_sampling_probs_refused_where_not_honoured(srv):
    _err(_post(srv, "/completion", {"prompt": "Hi", "n_probs": 2, "post_sampling_probs": True,
                                    "grammar": 'root ::= "a"'}), "post_sampling_probs")
    _err(_post(srv, "/v1/completions", {"prompt": "Hi", "post_sampling_probs": True}), "post_sampling_probs")


# ---- timings_per_token, return_progress -----------------------------------------------------------------------

def test_timings_per_token_in_every_chunk(srv):
    body = {**CHAT, "max_tokens": 6, "ignore_eos": True, "stream_options": {"include_usage": True}}
    chunks = _stream(srv, "/v1/chat/completions", {**body, "timings_per_token": True})
    assert "timings" not in chunks[0]  # the role chunk comes before any token
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content") is not None]
    assert [c["timings"]["predicted_n"] for c in tokens] == list(range(1, 7))
    assert chunks[-1]["choices"] == [] and chunks[-1]["timings"]["predicted_n"] == 6  # usage chunk: final timings
    plain = _stream(srv, "/v1/chat/completions", body)
    assert [i for i, c in enumerate(plain) if "timings" in c] == [len(plain) - 1]  # without: on the last chunk only
    native = _stream(srv, "/completion", {"prompt": PROMPT, "n_predict": 4, "ignore_eos": True,
                                          "timings_per_token": True})
    assert [e["timings"]["predicted_n"] for e in native if not e["stop"]] == [1, 2, 3, 4]
    assert "timings" not in _stream(srv, "/completion", {"prompt": PROMPT, "n_predict": 2})[0]


@pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions"])
def test_return_progress_reports_prefill_chunks(srv, path):
    body = {"max_tokens": 2, "return_progress": True, "cache_prompt": False}
    body.update({"prompt": LONG} if path == "/completion" else {"messages": [{"role": "user", "content": LONG}]})
    events = _stream(srv, path, body)
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    total = progress[0]["total"]
    assert 256 < total < CTX
    assert [(p["total"], p["cache"], p["processed"]) for p in progress] == [(total, 0, 0), (total, 0, 256),
                                                                             (total, 0, total)]
    first_token = next(i for i, e in enumerate(events) if e.get("content") or e.get("choices", [{}])[0]
                       .get("delta", {}).get("content"))
    assert max(i for i, e in enumerate(events) if "prompt_progress" in e) < first_token  # all before the reply
    # the same prompt again, cache kept: the first report counts the reused tokens as processed
    again = [e["prompt_progress"] for e in _stream(srv, path, {**body, "cache_prompt": True})
             if "prompt_progress" in e]
    assert again[0]["cache"] == again[0]["processed"] >= total - 16 and again[-1]["processed"] == total
    assert not any("prompt_progress" in e for e in _stream(srv, path, {**body, "return_progress": False}))
    timed = [e for e in _stream(srv, path, {**body, "timings_per_token": True}) if "prompt_progress" in e]
    assert timed[0]["timings"]["prompt_n"] == 0 and timed[0]["timings"]["prompt_ms"] == 0.0
    assert all(e["timings"]["predicted_n"] == 0 for e in timed)
    assert timed[-1]["timings"]["prompt_n"] == total - timed[-1]["prompt_progress"]["cache"]


# ---- __verbose, continuing a final assistant message, input_tokens ---------------------------------------------

def test_verbose_carries_the_native_result_and_prompt(srv):
    r = _post(srv, "/v1/chat/completions", {**CHAT, "max_tokens": 3, "verbose": True}).json()
    v = r["__verbose"]
    assert "<start_of_turn>user\nBook\n\nWhat is the best book<end_of_turn>\n<start_of_turn>model\n" in v["prompt"]
    assert v["content"] == r["choices"][0]["message"]["content"] and v["tokens_predicted"] == 3
    assert v["stop"] is True and v["generation_settings"]["n_ctx"] == CTX
    assert "__verbose" not in _post(srv, "/v1/chat/completions", {**CHAT, "max_tokens": 3}).json()
    chunks = _stream(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "verbose": True})
    finishing = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert finishing["__verbose"]["content"] == "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert sum("__verbose" in c for c in chunks) == 1


def test_final_assistant_message_is_continued(srv, oai):
    msgs = [*CHAT["messages"], {"role": "assistant", "content": "The best book is"}]
    r = _post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "verbose": True}).json()
    assert r["__verbose"]["prompt"].endswith("What is the best book<end_of_turn>\n<start_of_turn>model\n"
                                             "The best book is")
    explicit = _post(srv, "/apply-template", {"messages": msgs, "continue_final_message": True,
                                              "add_generation_prompt": False}).json()["prompt"]
    assert explicit.endswith("<start_of_turn>model\nThe best book is") and explicit in r["__verbose"]["prompt"]
    closed = _post(srv, "/apply-template", {"messages": msgs, "continue_final_message": False}).json()["prompt"]
    assert closed.endswith("The best book is<end_of_turn>\n<start_of_turn>model\n")
    no_gen = _post(srv, "/apply-template", {**CHAT, "add_generation_prompt": False}).json()["prompt"]
    assert no_gen.endswith("What is the best book<end_of_turn>\n")
    _err(_post(srv, "/v1/chat/completions", {"messages": msgs, "continue_final_message": True,
                                             "add_generation_prompt": True}), "add_generation_prompt")
    _err(_post(srv, "/v1/chat/completions", {**CHAT, "continue_final_message": True, "add_generation_prompt": False}),
         "final assistant message")
    _err(_post(srv, "/v1/chat/completions", {"messages": [*msgs, {"role": "assistant", "content": "x"}]}),
         "2 or more assistant messages")


def test_chat_input_tokens_counts_the_prompt(srv):
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        n = _post(srv, path, CHAT).json()["input_tokens"]
        used = _post(srv, "/v1/chat/completions", {**CHAT, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
        assert n == used > 5
    _err(_post(srv, "/chat/completions/input_tokens", {"messages": []}), "messages")


# ---- logit_bias keyed by text, JSON-object prompts -----------------------------------------------------------

def test_logit_bias_by_text_as_a_map_or_pairs(srv):
    base = {"prompt": "The capital of France is", "n_predict": 3, "temperature": 0, "return_tokens": True}
    first = _post(srv, "/completion", base).json()["tokens"][0]
    text = _post(srv, "/detokenize", {"tokens": [first]}).json()["content"]
    assert _post(srv, "/tokenize", {"content": text}).json()["tokens"] == [first]
    for bias in ({text: -100}, {text: False}, [[text, False]]):
        got = _post(srv, "/completion", {**base, "logit_bias": bias}).json()["tokens"]
        assert first not in got, bias
    zebra = _post(srv, "/tokenize", {"content": " zebra"}).json()["tokens"]
    for bias in ({" zebra": 100}, [[" zebra", 100]]):
        for path in ("/completion", "/v1/completions"):
            r = _post(srv, path, {**base, "logit_bias": bias, "max_tokens": 3}).json()
            toks = r["tokens"] if path == "/completion" else \
                _post(srv, "/tokenize", {"content": r["choices"][0]["text"]}).json()["tokens"]
            assert set(toks) <= set(zebra), (path, bias)


def test_json_object_prompts(srv):
    base = {"n_predict": 4, "temperature": 0, "ignore_eos": True}
    plain = _post(srv, "/completion", {**base, "prompt": PROMPT}).json()["content"]
    assert _post(srv, "/completion", {**base, "prompt": {"prompt_string": PROMPT}}).json()["content"] == plain
    assert _post(srv, "/completion", {**base, "prompt": [{"prompt_string": PROMPT}]}).json()["content"] == plain
    ids = _post(srv, "/tokenize", {"content": PROMPT, "add_special": True}).json()["tokens"]
    both = _post(srv, "/completion", {**base, "prompt": [ids, {"prompt_string": PROMPT}]}).json()
    assert [r["content"] for r in both] == [plain, plain] and [r["index"] for r in both] == [0, 1]
    _err(_post(srv, "/completion", {**base, "prompt": {"prompt_string": "x <__media__>", "multimodal_data": ["AA=="]}}),
         "multimodal_data")
    _err(_post(srv, "/completion", {**base, "prompt": {"text": PROMPT}}), "prompt_string")
    _err(_post(srv, "/completion", {**base, "prompt": [5, {"prompt_string": PROMPT}]}), "prompt object")


# ---- aliases, tags and server flags -----------------------------------------------------------------------------

def test_model_aliases_and_tags(srv, oai):
    m = httpx.get(srv.url + "/v1/models").json()["data"][0]
    assert m["id"] == "alpha" and m["aliases"] == ["alpha", "zeta"] and m["tags"] == ["chat", "small"]
    assert oai.chat.completions.create(model="zeta", messages=CHAT["messages"], max_tokens=1).model == "alpha"
    assert httpx.get(srv.url + "/slots").status_code == 200 and httpx.get(srv.url + "/").status_code == 200


def test_slots_next_token_and_metrics_header_as_llama_server(srv):
    _post(srv, "/completion", {"prompt": PROMPT, "n_predict": 3, "id_slot": 1})
    slots = httpx.get(srv.url + "/slots").json()
    assert slots[1]["params"]["n_predict"] == 3  # the last request's, as llama-server's task_prev
    for slot in slots:
        assert slot["is_processing"] is False
        assert ("params" in slot) == ("next_token" in slot) == (slot["requests_served"] > 0)
        if "next_token" in slot:  # idle: the finished request's budget does not leak
            assert slot["next_token"][0]["n_remain"] == -1 and slot["next_token"][0]["n_decoded"] == 0
    r = httpx.get(srv.url + "/metrics")
    import time

    assert 0 <= time.time() - int(r.headers["Process-Start-Time-Unix"]) < 3600
    assert b"Process-Start-Time-Unix" in [k for k, _ in r.headers.raw]  # spelled as llama-server spells it


def _llama_metrics(srv) -> dict[str, float]:
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in httpx.get(srv.url + "/metrics").text.splitlines()
            if ln.startswith("llamacpp:") and "{" not in ln}


def test_prompt_tokens_cached_are_counted_apart(srv):
    before = _llama_metrics(srv)
    got = [_post(srv, "/completion", {"prompt": LONG, "n_predict": 2, "id_slot": 0}).json()["timings"] for _ in range(2)]
    after = _llama_metrics(srv)
    assert got[1]["cache_n"] > 0
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d["llamacpp:prompt_tokens_total"] == sum(t["prompt_n"] for t in got)
    assert d["llamacpp:prompt_tokens_cached_total"] == sum(t["cache_n"] for t in got)
    text = httpx.get(srv.url + "/metrics").text
    assert "# TYPE llamacpp:n_tokens_max counter" in text
    assert after["llamacpp:n_tokens_max"] >= got[0]["prompt_n"] + got[0]["cache_n"] + 2


def test_no_slots_no_ui_verbose_and_chat_template_flags(tmp_path):
    s = ServerProcess(tmp_path, "-np", "1", "-c", "256", "--no-slots", "--no-ui", "--verbose", "--chat-template",
                      "chatml", "--no-metrics")
    try:
        r = httpx.get(s.url + "/slots")
        assert r.status_code == 501 and "--no-slots" in r.json()["error"]["message"]
        r = httpx.get(s.url + "/metrics")
        assert r.status_code == 501 and "--no-metrics" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/").status_code == 404 and httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/static/app.js").status_code == 404
        prompt = httpx.post(s.url + "/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert prompt["prompt"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                             "max_tokens": 2}, timeout=120).json()
        assert r["__verbose"]["prompt"].endswith("<|im_start|>assistant\n")  # --verbose: without asking
        log = s.log()  # --verbose also says why the default speculation was chosen, and the memory estimate
        assert "why: measured by" in log and re.search(r"memory \(cpu\): target [\d.]+ MiB", log), log
    finally:
        s.close()
    (tmp_path / "t.jinja").write_text("{{ strftime_now('%Y') }}:{% for m in messages %}[{{ m['role'] }}] "
                                      "{{ m['content'] }}\n{% endfor %}")
    s = ServerProcess(tmp_path, "-np", "1", "-c", "256", "--chat-template-file", str(tmp_path / "t.jinja"))
    try:
        prompt = httpx.post(s.url + "/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        import datetime

        assert prompt["prompt"] == f"{datetime.date.today().year}:[user] Hi\n"  # strftime_now, as transformers
    finally:
        s.close()


@pytest.mark.parametrize("args,needle", [
    (("--chat-template", "no-such-template"), "unknown template name"),
    (("--chat-template-file", "/nonexistent/t.jinja"), "cannot read it"),
    (("--chat-template", "{% for %}"), "does not parse"),
])
def test_bad_chat_template_flags_are_one_line_errors(args, needle):
    r = run_cli("serve", "--port", "0", *args, timeout=120)
    assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("name,want", [
    ("chatml", "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ("llama3", "<bos><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>"
               "\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("command-r", "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>S<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi"
                  "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    ("gemma", "<bos><start_of_turn>user\nS\n\nHi<end_of_turn>\n<start_of_turn>model\n"),
])
def test_named_chat_templates(tokenizer, name, want):
    from types import SimpleNamespace

    from gemmaspec.cli.serve import chat_template_of

    tok = type(tokenizer).__new__(type(tokenizer))
    tok.__dict__.update(tokenizer.__dict__)
    tok.chat_template = chat_template_of(SimpleNamespace(chat_template=name, chat_template_file=None))
    assert tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]) == want


# ---- n > 1 choices ----------------------------------------------------------------------------------------

def test_n_choices_whole_and_streamed(srv):
    body = {**CHAT, "max_tokens": 6, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    r = _post(srv, "/v1/chat/completions", {**body, "n": 3}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in r["choices"]]
    singles = [_post(srv, "/v1/chat/completions", {**body, "seed": 7 + i}).json() for i in range(3)]
    assert texts == [s["choices"][0]["message"]["content"] for s in singles]  # choice i = seed 7 + i
    n_prompt = _post(srv, "/chat/completions/input_tokens", CHAT).json()["input_tokens"]
    assert r["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 18, "total_tokens": n_prompt + 18,
                          "prompt_tokens_details": {"cached_tokens": r["timings"]["cache_n"]}}
    greedy = _post(srv, "/v1/chat/completions", {**body, "temperature": 0, "n": 2}).json()["choices"]
    assert greedy[0]["message"]["content"] == greedy[1]["message"]["content"]
    comp = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.9, "seed": 3, "ignore_eos": True, "n": 2}
    whole = _post(srv, "/v1/completions", comp).json()
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=120,
                      json={**comp, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == whole["choices"][i]["text"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    def counts(u):  # how much of the prompt the slots had cached differs from run to run
        return {k: v for k, v in u.items() if k != "prompt_tokens_details"}

    assert [counts(u) for u in usage] == [counts(whole["usage"])] and chunks[-1]["choices"] == []
    assert whole["usage"]["completion_tokens"] == 10
    _err(_post(srv, "/v1/chat/completions", {**CHAT, "n": 2, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}), "n > 1")


def test_response_fields_pick_the_result_fields(srv):
    fields = ["content", "generation_settings/n_predict", "timings/predicted_n", "no/such"]
    body = {"prompt": PROMPT, "n_predict": 3, "ignore_eos": True, "response_fields": fields}
    r = _post(srv, "/completion", body).json()
    assert set(r) == {"content", "generation_settings/n_predict", "timings/predicted_n"}
    assert r["generation_settings/n_predict"] == 3 and r["timings/predicted_n"] == 3 and isinstance(r["content"], str)
    assert "generation_settings" in _post(srv, "/completion", {**body, "response_fields": []}).json()


def test_chat_templates_get_transformers_and_llama_cpp_extras(tokenizer):
    """{% break %}, {% generation %}, strftime_now (transformers) and date_string / datetime
    (llama.cpp): what llama.cpp's own model templates use (69 of the 70 in its models/templates render)."""
    import datetime

    tok = type(tokenizer).__new__(type(tokenizer))
    tok.__dict__.update(tokenizer.__dict__)
    tok.chat_template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% generation %}"
                         "{{ m['content'] }}{% endgeneration %}{% endfor %}|{{ date_string }}|{{ datetime }}|"
                         "{{ strftime_now('%Y') }}")
    today = datetime.date.today()
    got = tok.apply_chat_template([{"role": "user", "content": "A"}, {"role": "user", "content": "B"}])
    assert got == f"A|{today.strftime('%d %b %Y')}|{today.strftime('%b %d %Y')}|{today.year}"


def test_several_host_addresses_share_the_port(tmp_path):
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    s = ServerProcess(tmp_path, "-np", "1", "-c", "256", "--host", "127.0.0.1,::1")
    try:
        port = s.url.rsplit(":", 1)[1]
        assert f"http://[::1]:{port}" in s.log()
        for url in (s.url, f"http://[::1]:{port}"):
            assert httpx.get(url + "/health").status_code == 200
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        s.close()


def test_id_slot_on_the_openai_endpoints(srv):
    for path, body in (("/v1/chat/completions", {**CHAT, "max_tokens": 2}), ("/v1/completions", {"prompt": PROMPT})):
        before = {s["id"]: s["requests_served"] for s in httpx.get(srv.url + "/slots").json()}
        assert _post(srv, path, {**body, "id_slot": 1, "n": 2}).status_code == 200
        after = {s["id"]: s["requests_served"] for s in httpx.get(srv.url + "/slots").json()}
        assert after[1] - before[1] == 2 and after[0] == before[0]  # both choices ran in slot 1
        _err(_post(srv, path, {**body, "id_slot": 2}), "id_slot")


@pytest.mark.parametrize("extra", [{}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                                   {"filename": 123, "text": 456}, "not a chunk"])
def test_infill_checks_its_input_then_refuses_a_model_without_fim_tokens(srv, extra):
    body = {"input_prefix": "int main() {\n", "prompt": "    int n = ", "input_suffix": "}\n"}
    bad = _post(srv, "/infill", {**body, "input_extra": [extra]})
    assert bad.status_code == 400 and "input_extra" in bad.json()["error"]["message"]
    assert _post(srv, "/infill", {**body, "input_extra": "x"}).status_code == 400
    assert _post(srv, "/infill", {**body, "input_prefix": 3}).status_code == 400
    ok = _post(srv, "/infill", {**body, "input_extra": [{"filename": "a.h", "text": "int f();"}]})
    assert ok.status_code == 501 and ok.json()["error"]["type"] == "not_supported_error"
    assert "Infill is not supported by this model" in ok.json()["error"]["message"]
