"""Trust at the edges (issue 33): a request body that is not UTF-8 is a 400 naming the problem on every
route that reads a JSON body, streamed or not, and prompt-cache hits are visible as OpenAI's
``usage.prompt_tokens_details.cached_tokens`` (= ``timings.cache_n``). Runs on the session server."""

from __future__ import annotations

import json

import httpx
import pytest

BAD = {  # bytes that are not UTF-8, as clients send them
    "latin1": b"caf\xe9 au lait",  # Latin-1 text
    "cut": b"price \xe2\x82 only",  # a euro sign cut after two of its three bytes
    "surrogate": b"x\xed\xa0\x80y",  # U+D800 encoded as if it were a character (json.loads(bytes) reads it)
}
MARK = "@@BAD@@"
GEN = {  # the generation routes, a body with MARK where the bad bytes go
    "/completion": {"prompt": MARK, "n_predict": 4},
    "/completions": {"prompt": MARK, "n_predict": 4},
    "/v1/completions": {"prompt": MARK, "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": MARK}], "max_tokens": 4},
    "/chat/completions": {"messages": [{"role": "user", "content": MARK}], "max_tokens": 4},
}
OTHER = {  # every other route that reads a JSON body
    "/tokenize": {"content": MARK},
    "/detokenize": {"tokens": [2, 3], "note": MARK},
    "/apply-template": {"messages": [{"role": "user", "content": MARK}]},
    "/v1/chat/completions/input_tokens": {"messages": [{"role": "user", "content": MARK}]},
    "/infill": {"input_prefix": MARK, "input_suffix": ""},
}


def _raw(body: dict, bad: bytes) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode().replace(MARK.encode(), bad)


def _post_raw(srv, path, raw: bytes) -> httpx.Response:
    return httpx.post(srv.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=120)


def _not_utf8(r: httpx.Response, kind: str) -> None:
    """A 400 in the server's error shape, naming UTF-8 (and for an encoded surrogate, that)."""
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"} and err["code"] == 400 and err["type"] == "invalid_request_error"
    assert "not valid UTF-8" in err["message"], err
    if kind == "surrogate":
        assert "surrogate" in err["message"], err


# -- bytes that are not UTF-8 ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", GEN)
def test_bad_bytes_in_the_prompt_are_a_400(server, path, stream, kind):
    _not_utf8(_post_raw(server, path, _raw({**GEN[path], "stream": stream}, BAD[kind])), kind)


@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions"])
def test_bad_bytes_in_stop_are_a_400_not_accepted(server, path, stream, kind):
    good = json.loads(json.dumps(GEN[path]).replace(MARK, "Count: 1, 2,"))
    body = {**good, "stream": stream, "stop": ["\n\n", MARK]}
    _not_utf8(_post_raw(server, path, _raw(body, BAD[kind])), kind)


@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("path", OTHER)
def test_bad_bytes_on_the_other_json_routes_are_a_400(server, path, kind):
    _not_utf8(_post_raw(server, path, _raw(OTHER[path], BAD[kind])), kind)


def test_the_server_answers_good_requests_after_bad_bytes(server):
    """After every kind (the tests above, and here once more), good UTF-8, non-ASCII included, is served."""
    for kind, bad in BAD.items():
        _not_utf8(_post_raw(server, "/completion", _raw({"prompt": MARK, "n_predict": 2, "stream": True}, bad)), kind)
    good = _raw({"prompt": "Caf\u00e9 \u20ac \U0001f600:", "n_predict": 3, "ignore_eos": True}, b"")
    r = _post_raw(server, "/completion", good)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 3, r.text
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "na\u00efve \u2192 ?"}], "max_tokens": 3,
                            "stream": True}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert resp.status_code == 200 and lines[-1] == "data: [DONE]"
    assert _post_raw(server, "/tokenize", '{"content": "caf\u00e9"}'.encode()).json()["tokens"]
    assert _post_raw(server, "/tokenize", b'\xef\xbb\xbf{"content": "x"}').status_code == 200  # a BOM, as before


# -- prompt-cache hits in usage --------------------------------------------------------------------------
FIRST = ("Here is a list of fruit, one per line, to remember for later: apples, pears, plums, figs, "
         "cherries, grapes, lemons, limes, oranges, peaches, apricots, mangoes, melons, kiwis. "
         "Say only: noted.")


def _cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def _stream(srv, path, body) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def _check_streamed(chunks: list[dict], include_usage: bool) -> int:
    """The one usage of a stream (in the finishing chunk, or a last chunk of its own with
    include_usage), checked against the last chunk's timings; its cached_tokens."""
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1 and "timings" in chunks[-1]
    assert chunks[-1]["usage"] == usage[0] and (chunks[-1]["choices"] == []) == include_usage
    assert _cached(usage[0]) == chunks[-1]["timings"]["cache_n"] < usage[0]["prompt_tokens"]
    return _cached(usage[0])


def test_chat_reports_cached_tokens_as_timings_cache_n(server):
    """Turn 1 (not reusing the cache) reports 0; turn 2 repeats turn 1's conversation and reuses its
    prompt from the slot: cached_tokens > 0, equal to timings.cache_n, whole and streamed."""
    path, turn1 = "/v1/chat/completions", [{"role": "user", "content": FIRST}]
    r1 = httpx.post(server.url + path, json={"messages": turn1, "max_tokens": 4, "cache_prompt": False},
                    timeout=120).json()
    assert _cached(r1["usage"]) == 0 == r1["timings"]["cache_n"]
    n1 = r1["usage"]["prompt_tokens"]
    turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Which came third?"}]
    r2 = httpx.post(server.url + path, json={"messages": turn2, "max_tokens": 4}, timeout=120).json()
    assert n1 // 2 < _cached(r2["usage"]) == r2["timings"]["cache_n"] < r2["usage"]["prompt_tokens"], r2
    body = {"messages": turn2 + [{"role": "assistant", "content": "pears"}, {"role": "user", "content": "And?"}],
            "max_tokens": 4}
    assert _check_streamed(_stream(server, path, {**body, "stream_options": {"include_usage": True}}), True) > n1 // 2
    assert _check_streamed(_stream(server, path, body), False) > n1 // 2  # usage in the finishing chunk
    assert "usage" not in _stream(server, path, {**body, "stream_options": {"include_usage": False}})[-1]


def test_completions_report_cached_tokens(server):
    path = "/v1/completions"
    r1 = httpx.post(server.url + path, json={"prompt": FIRST, "max_tokens": 2, "cache_prompt": False},
                    timeout=120).json()
    assert _cached(r1["usage"]) == 0 == r1["timings"]["cache_n"]
    body = {"prompt": FIRST + " Noted. Now say: done.", "max_tokens": 2}
    r2 = httpx.post(server.url + path, json=body, timeout=120).json()
    assert r1["usage"]["prompt_tokens"] // 2 < _cached(r2["usage"]) == r2["timings"]["cache_n"]
    assert _check_streamed(_stream(server, path, {**body, "stream_options": {"include_usage": True}}), True) > 0
    n2 = httpx.post(server.url + path, json={**body, "n": 2}, timeout=120).json()  # each prompt once
    assert _cached(n2["usage"]) == n2["timings"]["cache_n"] <= n2["usage"]["prompt_tokens"]
