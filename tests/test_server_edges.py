"""Trust at the edges (issue 33): a request body that is not UTF-8 is a 400 naming the problem on every
route that reads a JSON body, streamed or not. Runs on the session server."""

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
