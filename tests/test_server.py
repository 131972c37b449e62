"""`gemmaspec serve` through the official openai client and raw HTTP: completions and chat, streamed
and not, with and without speculation; several users batched together get exactly their solo
output; metrics; every bad input; a client that goes away mid-stream frees its slot."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import ServerProcess
from gemmaspec.engine import RequestStats
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.drafters import NgramDrafter

MODEL = "gemma-3-270m-q4_k_m.gguf"
PROMPTS = [
    "Rewrite the list in the same order: apples, pears, plums, figs. Rewritten: apples, pears,",
    "def fib(n):\n    if n < 2:\n        return n\n    return",
    'Repeat exactly: {"name": "Ada", "age": 36, "city": "London"}\nRepeated: {"name":',
    "The capital of France is",
]
NO_SPEC = {"speculative.n_max": 0}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _solo(engine, prompt, n, chat=False):
    """What gemmaspec generate gives alone (greedy, ngram-simple n_max 3: the server's defaults)."""
    ids = engine.encode_prompt(prompt, chat=chat)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    evs = list(engine.generate(ids, params, NgramDrafter(4, 1), n_max=3))
    return "".join(e.text for e in evs), [t for e in evs for t in e.tokens]


def _metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


# ---- basics ------------------------------------------------------------------------------------------

def test_health_turns_200_after_loading(server):
    assert server.health_codes[-1] == 200
    assert set(server.health_codes[:-1]) <= {503}
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_models_props_and_slots(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    props = httpx.get(server.url + "/props").json()
    assert props["n_ctx"] == 2048 and props["total_slots"] == 4 and props["batched_forward"] is True
    assert props["speculative"]["type"] == "ngram-simple,draft-mtp" and props["speculative"]["n_max"] == 8  # the chosen length's bound
    # the default model's file has no chat template: a base model, said in /props (for the chat page) and the log
    assert props["is_base_model"] is True and props["model_has_chat_template"] is False
    log = server.log()
    assert "note: this is a base (pretrained) model" in log and "gemmaspec pull gemma-3-1b-it" in log
    assert "the chat page at / sends it text completions" in log  # what the page offers a base model
    assert "why:" not in log and "memory (" not in log  # provenance and the estimate: with --verbose
    slots = httpx.get(server.url + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]


def test_chat_page_is_served(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"] and "<script>" in r.text
    for src in re.findall(r'(?:src|href)="(static/[^"]+)"', r.text):  # every file the page names
        assert httpx.get(f"{server.url}/{src}").status_code == 200, src
    app = httpx.get(server.url + "/static/app.js")
    assert app.status_code == 200 and app.headers["content-type"].startswith("text/javascript")
    for vendored in ("marked.esm.js", "marked.LICENSE.md", "highlight.core.min.js", "highlight.LICENSE"):
        assert httpx.get(f"{server.url}/static/vendor/{vendored}").status_code == 200, vendored
    md = httpx.get(server.url + "/static/markdown.js").text  # every module it imports is there
    for mod in re.findall(r'from "\./(vendor/[^"]+)"', md):
        assert httpx.get(f"{server.url}/static/{mod}").status_code == 200, mod
    for bad in ("/static/nope.js", "/static/../api.py", "/static/%2e%2e/api.py", "/static/"):
        assert httpx.get(server.url + bad).status_code == 404, bad


# ---- completions and chat ------------------------------------------------------------------------------

def test_completion_equals_generate_and_max_tokens_is_exact(server, client, engine):
    want, _ = _solo(engine, PROMPTS[0], 24)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(engine.tokenizer.encode(PROMPTS[0]))
    t = _extra(r, "timings")
    assert t["predicted_n"] == 24 and t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert {"prompt_n", "prompt_ms", "predicted_ms", "predicted_per_second"} <= set(t)


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "no-spec"])
def test_completion_streamed_equals_whole(client, spec):
    extra = {"ignore_eos": True, **({} if spec else NO_SPEC)}
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, logprobs=2,
                                      extra_body=extra)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, logprobs=2,
                                            stream=True, extra_body=extra))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == whole.choices[0].text
    delivered = sum(len(c.choices[0].logprobs.token_logprobs) for c in chunks if c.choices[0].logprobs)
    last = chunks[-1]
    assert delivered == last.usage.completion_tokens == whole.usage.completion_tokens == 20
    assert len(whole.choices[0].logprobs.token_logprobs) == 20
    assert all(len(top) == 2 for top in whole.choices[0].logprobs.top_logprobs)
    assert last.choices[0].finish_reason == "length"
    t = _extra(last, "timings")
    assert t["predicted_n"] == 20
    assert (t["draft_n"] > 0) == spec and (_extra(whole, "timings")["draft_n"] > 0) == spec


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "no-spec"])
def test_chat_streamed_equals_whole(client, engine, spec):
    extra = {"ignore_eos": True, **({} if spec else NO_SPEC)}
    msgs = [{"role": "user", "content": "Write the numbers from 1 to 20, separated by commas."}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, logprobs=True,
                                           extra_body=extra)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                                 logprobs=True, stream=True, extra_body=extra))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content == _solo(engine, msgs[0]["content"], 24, chat=True)[0]
    delivered = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    assert delivered == chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 24
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    assert (_extra(chunks[-1], "timings")["draft_n"] > 0) == spec


def test_stop_string_finishes_with_stop(client, engine):
    """The stop string is taken from the model's own greedy continuation, so the test does not depend on
    what the model writes: the reply is exactly generate's text and token count with that stop."""
    prompt, extra = "Count: 1, 2, 3, 4,", {"ignore_eos": True}
    full, _ = _solo(engine, prompt, 30)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full.index(stop)
    assert cut > 0, (full, stop)
    st = RequestStats()
    ids = engine.encode_prompt(prompt)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=(stop,))
    want = "".join(e.text for e in engine.generate(ids, params, NgramDrafter(4, 1), n_max=3, stats=st))
    assert want == full[:cut] and st.stop_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                  extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want
    assert r.usage.completion_tokens == st.generated_tokens
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stop,
                                            stream=True, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---- several users ----------------------------------------------------------------------------------

def test_concurrent_users_get_exactly_their_solo_output(server, client, engine):
    solo = [_solo(engine, p, 32)[0] for p in PROMPTS]
    before = _metrics(server)
    barrier = threading.Barrier(len(PROMPTS))

    def one(p):
        barrier.wait()
        return client.completions.create(model=MODEL, prompt=p, max_tokens=32, temperature=0,
                                         extra_body={"ignore_eos": True,  # fixed draft lengths: the
                                                     "speculative.n_fixed": True})  # choice follows timings

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    assert [r.choices[0].text for r in results] == solo
    assert all(r.usage.completion_tokens == 32 for r in results)
    assert sum(_extra(r, "timings")["draft_n"] for r in results) > 0
    after = _metrics(server)
    # rounds really were shared: some forwards carried more than one request
    shared = lambda m: m.get("gemmaspec_forward_batch_size_count", 0) - m.get('gemmaspec_forward_batch_size_bucket{le="1.0"}', 0)  # noqa: E731
    assert shared(after) > shared(before)


def test_metrics_rise_by_the_requests_counts(server, client):
    before = _metrics(server)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = _metrics(server)
    t = _extra(r, "timings")
    d = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
    assert d("spec_decode_num_draft_tokens_total") == t["draft_n"] > 0
    assert d("spec_decode_num_accepted_tokens_total") == t["draft_n_accepted"] > 0
    per_pos = sum(after[k] - before.get(k, 0) for k in after if k.startswith("spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == t["draft_n_accepted"]
    assert 1 <= d("spec_decode_num_drafts_total") <= t["draft_n"]
    assert d('gemmaspec_requests_total{endpoint="completions",finish_reason="length"}') == 1
    assert d("gemmaspec_generation_tokens_total") == 24 and d("gemmaspec_prompt_tokens_total") == r.usage.prompt_tokens


def test_each_request_logs_its_speed_and_acceptance(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0)
    line = next(ln for ln in server.log().splitlines() if r.id in ln)
    assert re.search(r"generated \d+ tokens, decode [\d.]+ tokens/s", line)
    assert re.search(r"draft acceptance = [\d.]+ \( *\d+ accepted / +\d+ generated\), mean len = +[\d.]+", line)


# ---- bad input -------------------------------------------------------------------------------------------

def _err(resp, status, *needles):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == status
    for n in needles:
        assert n in err["message"], err["message"]
    return err


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", b'{"prompt": "x", ', 400, "not valid JSON"),
    ("/v1/completions", b'["x"]', 400, "JSON object"),
    ("/v1/completions", b'{"max_tokens": 4}', 400, "'prompt'"),
    ("/v1/chat/completions", b'{"max_tokens": 4}', 400, "'messages'"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "'messages'"),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, "'messages.0.role'"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400, "messages[0].content is missing"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}', 400, "content is missing"),
    ("/v1/chat/completions", b'{"messages": [{"role": "bot", "content": "hi"}]}', 400, "role must be"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "text"),
    ("/v1/completions", b'{"prompt": "x", "stop": [3]}', 400, "'stop'"),
    ("/v1/completions", b'{"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i"], "n": 2}', 400, "choices"),
    ("/v1/completions", b'{"prompt": [999999999]}', 400, "vocabulary"),
    ("/v1/completions", b'{"prompt": "x", "seed": 0.5}', 400, "seed"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -3}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 2.5}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": -0.1}', 400, "top_p"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 1.5}', 400, "top_p"),
    ("/v1/completions", b'{"prompt": "x", "n": 17}', 400, "n must be in 1..16"),
    ("/v1/completions", b'{"prompt": "x", "speculative.n_max": 999}', 400, "speculative.n_max"),
    ("/v1/nothing", b'{}', 404, "no such endpoint"),
])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, path, body, status, needle):
    _err(httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}), status, needle)
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_prompt_longer_than_context_names_both_lengths(server, client, engine):
    prompt = "word " * 2100
    n = len(engine.tokenizer.encode(prompt))
    err = _err(httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}), 400,
               str(n), "2048")
    assert err["n_prompt_tokens"] == n and err["n_ctx"] == 2048
    with pytest.raises(openai.BadRequestError, match="exceeds the available context size"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_serve_command_errors_are_one_line(tmp_path):
    from conftest import run_cli

    for args, needle in [(("-m", str(tmp_path / "nope.gguf")), "not found"), (("-np", "0"), "-np"),
                         (("--port", "70000"), "--port"), (("--spec-draft-n-max", "x"), "--spec-draft-n-max"),
                         (("--cors-origin", "app.example"), "not an origin"),
                         (("--allowed-hosts", "http://box.example"), "--allowed-hosts takes host names")]:
        res = run_cli("serve", "--port", "0", *args, timeout=120) if "--port" not in args else run_cli("serve", *args)
        assert res.returncode == 1, res.stderr
        assert "Traceback" not in res.stderr
        assert res.stderr.strip().splitlines()[-1].startswith("error: ") and needle in res.stderr.splitlines()[-1]


# ---- disconnects ---------------------------------------------------------------------------------------

def test_client_gone_mid_stream_frees_its_slot(server):
    before = _metrics(server)
    body = {"prompt": PROMPTS[3], "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [ln for _, ln in zip(range(6), lines)]
            assert any(ln.startswith("data: ") for ln in got)
    # 1500 tokens would keep the slot busy for tens of seconds; a cancelled request leaves it within a round
    deadline = time.monotonic() + 30
    while any(s["is_processing"] for s in httpx.get(server.url + "/slots").json()):
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.1)
    after = _metrics(server)
    key = 'gemmaspec_requests_total{endpoint="completions",finish_reason="cancelled"}'
    assert after.get(key, 0) - before.get(key, 0) == 1
    assert after["gemmaspec_generation_tokens_total"] - before["gemmaspec_generation_tokens_total"] < 1500


# ---- a second server: 2 slots, an API key -------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("serve-np2"), "-np", "2", "-c", "1024", "--api-key", "sekret")
    yield s
    s.close()


def test_api_key_is_required_when_set(keyed_server):
    url = keyed_server.url
    body = {"prompt": "Hi", "max_tokens": 2}
    _err(httpx.post(url + "/v1/completions", json=body), 401, "API key")
    _err(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401, "API key")
    _err(httpx.get(url + "/slots"), 401)
    assert httpx.get(url + "/health").status_code == 200  # public, as in llama-server
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).completions.create(
            model=MODEL, prompt="Hi", max_tokens=2)
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_sixteen_requests_through_two_slots_all_complete(keyed_server):
    client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="sekret", max_retries=0, timeout=300)

    def one(i):
        return client.completions.create(model=MODEL, prompt=PROMPTS[i % 4], max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True, "stream": False})

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert all(r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length" for r in results)
    for i in range(4):  # the same prompt gives the same text, whichever slot and neighbours it had
        assert len({r.choices[0].text for r in results[i::4]}) == 1
    slots = httpx.get(keyed_server.url + "/slots", headers={"Authorization": "Bearer sekret"}).json()
    assert len(slots) == 2 and sum(s["requests_served"] for s in slots) >= 16


def test_stream_events_are_sse_ending_in_done(keyed_server):
    with httpx.stream("POST", keyed_server.url + "/v1/chat/completions", headers={"Authorization": "Bearer sekret"},
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True,
                            "temperature": 0}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and "usage" in last and "timings" in last
