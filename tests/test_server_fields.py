"""Request fields as OpenAI and llama-server clients send them (issue 13, "fields clients send"): a field
given as ``null`` is left out, ``n_predict`` wins over ``max_tokens`` and 0 runs the prompt only (into
the slot's cache), ``tokens_cached`` and ``/slots`` count what a slot holds, and a prompt over the
context gets llama-server's own words. Every generation endpoint, streamed and not, drafting on and off."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import ServerProcess

CTX = 512
PROMPT = "Rewrite the list in the same order: apples, pears, plums, figs. Rewritten: apples, pears,"
PATHS = ["/v1/completions", "/v1/chat/completions", "/completion", "/completions"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    # fixed draft lengths: these tests compare draft counts across requests, which the default per-round
    # choice (from measured timings) would make depend on the machine's load
    s = ServerProcess(tmp_path_factory.mktemp("serve-fields"), "-np", "2", "-c", str(CTX), "--temp", "0",
                      "--spec-draft-n-fixed")
    yield s
    s.close()


def _body(path: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": PROMPT}]} if "chat" in path else {"prompt": PROMPT}
    return {**body, **extra}


def _post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=120)


def _result(path: str, r: httpx.Response, stream: bool) -> tuple[str, int, str]:
    """(text, tokens generated, finish reason or stop type) of a response, whole or streamed."""
    assert r.status_code == 200, r.text
    if not stream:
        out = r.json()
        if "choices" in out:
            c = out["choices"][0]
            return (c.get("text") if "text" in c else c["message"]["content"]), out["usage"]["completion_tokens"], \
                c["finish_reason"]
        return out["content"], out["tokens_predicted"], out["stop_type"]
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    if "choices" in events[0]:
        text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                       for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        return text, events[-1]["usage"]["completion_tokens"], finish[-1]
    return "".join(e["content"] for e in events), events[-1]["tokens_predicted"], events[-1]["stop_type"]


@pytest.mark.parametrize("path", PATHS)
def test_null_fields_are_left_out(srv, path):
    """OpenAI's fields are nullable and llama-server reads null as absent: ``"n": null``,
    ``"stream": null``, ``"logprobs": null``... take their defaults instead of a 400."""
    want = _result(path, _post(srv, path, _body(path, max_tokens=4)), False)
    nulls = {k: None for k in ("n", "stream", "logprobs", "top_logprobs", "temperature", "seed", "stop", "ignore_eos",
                               "cache_prompt", "id_slot", "stream_options", "response_format", "logit_bias",
                               "presence_penalty", "frequency_penalty", "top_p", "n_keep", "n_discard",
                               "timings_per_token", "return_progress", "verbose", "user", "tools", "tool_choice",
                               "n_probs", "return_tokens", "post_sampling_probs", "echo", "suffix", "best_of",
                               "n_predict", "max_completion_tokens", "speculative.n_max")}
    assert _result(path, _post(srv, path, _body(path, max_tokens=4, **nulls)), False) == want


@pytest.mark.parametrize("path", PATHS)
def test_n_predict_wins_over_max_tokens_and_bad_limits_name_their_field(srv, path):
    """llama-server reads ``n_predict``, then ``max_completion_tokens``, then ``max_tokens``."""
    for extra in ({"max_tokens": 6, "n_predict": 2}, {"max_completion_tokens": 2, "max_tokens": 6}):
        if "max_completion_tokens" in extra and "chat" not in path:
            continue
        assert _result(path, _post(srv, path, _body(path, ignore_eos=True, **extra)), False)[1] == 2
    for field in ("max_tokens", "n_predict"):
        r = _post(srv, path, _body(path, **{field: -2}))
        assert r.status_code == 400 and f"{field} must be at least 0" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", PATHS)
def test_zero_tokens_runs_the_prompt_into_the_cache(srv, path, stream):
    """llama-server's ``n_predict: 0``: "no tokens will be generated but the prompt is evaluated into the
    cache" (``max_tokens: 0`` is its alias); the next request with that prompt reuses all of it."""
    field = "n_predict" if path in ("/completion", "/completions") else "max_tokens"
    body = _body(path, id_slot=1, stream=stream, **{field: 0})
    text, n, finish = _result(path, _post(srv, path, body), stream)
    assert (text, n) == ("", 0) and finish in ("length", "limit")
    again = _post(srv, path, _body(path, id_slot=1, max_tokens=1)).json()
    prompt = again["usage"]["prompt_tokens"] if "usage" in again else again["tokens_evaluated"]
    assert again["timings"]["cache_n"] == prompt - 1 and again["timings"]["prompt_n"] == 1


def test_native_result_after_zero_tokens_and_tokens_cached(srv):
    r = _post(srv, "/completion", _body("/completion", n_predict=0, id_slot=0)).json()
    assert r["stop_type"] == "limit" and r["truncated"] is False and r["tokens"] == [] and r["content"] == ""
    assert r["tokens_cached"] == r["tokens_evaluated"] and r["timings"]["predicted_n"] == 0
    assert r["generation_settings"]["n_predict"] == 0
    # llama-server's tokens_cached: the tokens whose KV the slot holds (the reply's last token never ran)
    r = _post(srv, "/completion", _body("/completion", n_predict=5, ignore_eos=True, id_slot=0)).json()
    assert r["tokens_cached"] == r["tokens_evaluated"] + r["tokens_predicted"] - 1
    slot = httpx.get(srv.url + "/slots").json()[0]
    assert slot["n_past"] == r["tokens_cached"] and slot["speculative"] is True
    assert "n_prompt_tokens_cache" in slot and "n_prompt_tokens_processed" in slot


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", PATHS)
def test_prompt_over_the_context_gets_llama_servers_words(srv, path, stream):
    body = {"messages": [{"role": "user", "content": "word " * CTX}]} if "chat" in path else {"prompt": "word " * CTX}
    r = _post(srv, path, {**body, "stream": stream})
    assert r.status_code == 400
    err = r.json()["error"]
    n = err["n_prompt_tokens"]
    assert err["message"] == f"request ({n} tokens) exceeds the available context size ({CTX} tokens), try increasing it"
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == CTX and n >= CTX


def test_another_users_request_does_not_evict_a_cached_conversation(srv):
    """Two users' chats with -np 2: B's first turn shares only the template's head with A's cached
    turn, so it goes to the least recently used slot instead of evicting A's KV, and A's second turn
    reuses A's first (it used to find B's turn in its slot and run its whole history again)."""
    for i in (0, 1):  # both slots hold something; slot 0 is the least recently used
        _post(srv, "/completion", {"prompt": f"Filler {i}: " + "zebra " * 20, "n_predict": 1, "id_slot": i})
    a1 = [{"role": "user", "content": "Alice here. Tell me about volcanoes and lava in three short points."}]
    b1 = [{"role": "user", "content": "Bob asking: what is the boiling point of water at sea level?"}]
    ra = _post(srv, "/v1/chat/completions", {"messages": a1, "max_tokens": 4}).json()
    rb = _post(srv, "/v1/chat/completions", {"messages": b1, "max_tokens": 4}).json()
    assert rb["timings"]["cache_n"] < 10
    a2 = a1 + [{"role": "assistant", "content": ra["choices"][0]["message"]["content"]},
               {"role": "user", "content": "And geysers?"}]
    r = _post(srv, "/v1/chat/completions", {"messages": a2, "max_tokens": 4}).json()
    assert r["timings"]["cache_n"] >= ra["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path,extra,field", [
    ("/completion", {"top_n_sigma": 1.0}, "top_n_sigma"), ("/completion", {"min_keep": 5}, "min_keep"),
    ("/completion", {"n_indent": 4}, "n_indent"), ("/completion", {"t_max_predict_ms": 500}, "t_max_predict_ms"),
    ("/completion", {"n_cmpl": 2}, "n_cmpl"), ("/completion", {"grammar_lazy": True}, "grammar_lazy"),
    ("/v1/chat/completions", {"repetition_penalty": 1.3}, "repetition_penalty"),
    ("/v1/completions", {"min_tokens": 8}, "min_tokens"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"stop_token_ids": [1]}, "stop_token_ids"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"repeat_penalty": 0}, "repeat_penalty"),
    ("/completion", {"repeat_last_n": -2}, "repeat_last_n"), ("/v1/completions", {"seed": 1.5}, "seed"),
])
def test_fields_that_would_change_the_output_are_400s_naming_them(srv, path, extra, field):
    r = _post(srv, path, _body(path, max_tokens=2, **extra))
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_samplers_at_their_off_values_are_accepted(srv):
    off = {"top_n_sigma": -1, "min_keep": 1, "t_max_predict_ms": -1, "n_indent": 0, "n_cmpl": 1,
           "repetition_penalty": 1.0, "min_tokens": 0, "adaptive_target": -1.0}
    want = _post(srv, "/completion", _body("/completion", n_predict=3)).json()["content"]
    assert _post(srv, "/completion", _body("/completion", n_predict=3, **off)).json()["content"] == want


def test_native_logprobs_is_n_probs(srv):
    r = _post(srv, "/completion", _body("/completion", n_predict=3, logprobs=2)).json()
    assert len(r["completion_probabilities"]) == 3 and all(len(p["top_logprobs"]) == 2
                                                           for p in r["completion_probabilities"])


def test_one_prompt_as_a_list_of_token_lists(srv):
    ids = _post(srv, "/tokenize", {"content": PROMPT, "add_special": True}).json()["tokens"]
    want = _post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}).json()["choices"][0]["text"]
    got = _post(srv, "/v1/completions", {"prompt": [ids], "max_tokens": 4}).json()
    assert got["choices"][0]["text"] == want and got["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_several_prompts_on_v1_completions(srv, stream):
    """OpenAI's batch: ``prompt`` a list of texts (or of id lists) answers one choice per prompt and
    ``n``, prompt p's choices at indexes p*n .. p*n+n-1; usage counts each prompt once."""
    prompts = [PROMPT, "The capital of France is"]
    alone = [_post(srv, "/v1/completions", {"prompt": p, "max_tokens": 4}).json() for p in prompts]
    body = {"prompt": prompts, "max_tokens": 4, "n": 2, "stream": stream}
    r = _post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        texts = {}
        for e in events:
            for c in e["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        usage = [e["usage"] for e in events if e.get("usage")][-1]
    else:
        out = r.json()
        texts, usage = {c["index"]: c["text"] for c in out["choices"]}, out["usage"]
    want = [a["choices"][0]["text"] for a in alone]
    assert texts == {0: want[0], 1: want[0], 2: want[1], 3: want[1]}  # temperature 0: the n choices agree
    assert usage["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert usage["completion_tokens"] == sum(2 * a["usage"]["completion_tokens"] for a in alone)
    r = _post(srv, "/v1/completions", {"prompt": ["a"] * 9, "n": 2, "max_tokens": 1})
    assert r.status_code == 400 and "choices" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", b'{"prompt": "\\ud800 hi", "max_tokens": 2}'),
    ("/completion", b'{"prompt": "hi", "n_predict": 2, "stop": ["\\udc00"]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00x"}], "max_tokens": 2}'),
    ("/tokenize", b'{"content": "\\ud800"}'),
    ("/apply-template", b'{"messages": [{"role": "user", "content": "x\\ud83d"}]}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"\\ud800": 5}}'),
])
def test_a_lone_surrogate_is_a_400_not_a_500(srv, path, raw):
    """JSON may spell a lone UTF-16 surrogate (``"\\ud800"``); Python reads it, but no tokenizer or
    encoder can: it used to crash the request with a 500."""
    r = httpx.post(srv.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    ok = httpx.post(srv.url + "/tokenize", content=b'{"content": "\\ud83d\\ude00"}',  # a pair is a character
                    headers={"Content-Type": "application/json"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["tokens"]


def test_true_is_not_a_token_id(srv):
    r = _post(srv, "/completion", {"prompt": [True], "n_predict": 2})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", PATHS)
def test_a_limit_above_the_context_ends_at_the_context(srv, path):
    """``max_tokens`` (``n_predict``) above the context is accepted, as llama-server does (clients
    hard-code 4096 and the like): generation ends when the context is full, like ``-1``."""
    body = _body(path, ignore_eos=True, **({"n_predict": 4 * CTX} if path in ("/completion", "/completions") else
                                          {"max_tokens": 4 * CTX}))
    text, n, finish = _result(path, _post(srv, path, body), False)
    assert finish in ("length", "limit") and 0 < n < CTX


def test_chat_template_kwargs_reach_the_template(srv, tokenizer):
    """``chat_template_kwargs`` (llama-server's and vLLM's) are template variables: a template that reads
    one renders it (it was accepted and ignored); the template's own variables cannot be replaced."""
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "hi"
    assert tok.apply_chat_template(msgs, template_kwargs={"enable_thinking": False}) == "hi<no-think>"
    body = {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}
    r = _post(srv, "/apply-template", body)
    assert r.status_code == 200 and r.json()["prompt"] == tokenizer.apply_chat_template(msgs), r.text
    for path in ("/apply-template", "/v1/chat/completions"):
        r = _post(srv, path, {**body, "chat_template_kwargs": {"messages": []}, "max_tokens": 2})
        assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"], r.text


SAMPLED = {"max_tokens": 8, "ignore_eos": True, "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
           "cache_prompt": False}
FRESH = "Describe a quiet morning at a mountain lake, with birds and mist."  # open-ended, little to copy


def _fresh(path: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": FRESH}]} if "chat" in path else {"prompt": FRESH}
    return {**body, **extra}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", PATHS)
def test_any_integer_seed_is_the_uint32_llama_server_reads(srv, path, stream):
    """llama-server reads ``seed`` as a uint32 (-2 is 4294967294) and OpenAI and vLLM take any int64:
    every integer is accepted (negative ones other than -1 were a 400) and samples as the wrapped
    seed does, drafting on and off."""
    for spec in ({}, {"speculative.n_max": 0}):
        base = _fresh(path, stream=stream, **SAMPLED, **spec)
        got = {seed: _result(path, _post(srv, path, {**base, "seed": seed}), stream)
               for seed in (-2, 2**32 - 2, -(2**40) + 3, 3)}
        assert got[-2] == got[2**32 - 2] and got[-(2**40) + 3] == got[3], spec
        assert got[3] != got[2**32 - 2]  # the seed matters: the equalities are not vacuous


def test_generation_settings_show_the_seed_as_a_uint32(srv):
    def seed_of(seed):
        body = _body("/completion", n_predict=1, **({} if seed is None else {"seed": seed}))
        return _post(srv, "/completion", body).json()["generation_settings"]["seed"]

    assert seed_of(-2) == seed_of(2**32 - 2) == 4294967294 and seed_of(2**32 + 5) == 5
    assert seed_of(-1) == seed_of(None) == 4294967295  # llama-server's LLAMA_DEFAULT_SEED: a random one
    assert httpx.get(srv.url + "/props").json()["default_generation_settings"]["params"]["seed"] == 4294967295


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", PATHS)
def test_negative_top_k_and_repeat_last_n_read_as_llama_server(srv, path, stream):
    """llama.cpp's top-k is off at k <= 0 (vLLM's ``top_k: -1`` means off too) and llama-server's
    ``repeat_last_n: -1`` is the context size: both were 400s. Drafting on and off."""
    for spec in ({}, {"speculative.n_max": 0}):
        base = _fresh(path, stream=stream, **SAMPLED, seed=5, repeat_penalty=1.5, **spec)
        got = [_result(path, _post(srv, path, {**base, **k}), stream)
               for k in ({"top_k": -1}, {"top_k": 0}, {"repeat_last_n": -1}, {"repeat_last_n": CTX})]
        assert got[0] == got[1] and got[2] == got[3], spec
    r = _post(srv, "/completion", _body("/completion", n_predict=1, top_k=-1, repeat_last_n=-1)).json()
    assert (r["generation_settings"]["top_k"], r["generation_settings"]["repeat_last_n"]) == (0, CTX)


def _timings(r: httpx.Response, stream: bool) -> dict:
    if not stream:
        return r.json()["timings"]
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    return [e["timings"] for e in events if "timings" in e][-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", PATHS)
def test_speculative_p_min_applies_to_the_request_only(srv, path, stream):
    """llama-server's per-request ``speculative.p_min``: the MTP assistant (after n-gram lookup in the
    default ``ngram-simple,draft-mtp``) stops drafting below it, so 1.0 drafts (nearly) nothing and 0
    drafts the most (``timings.draft_n_by_type``: n-gram lookup drafts whatever the p-min); greedy output
    is unchanged, and the slot's own value (0.3) is back afterwards."""
    base = _fresh(path, max_tokens=24, ignore_eos=True, cache_prompt=False, id_slot=0, stream=stream)

    def run(**extra):
        r = _post(srv, path, {**base, **extra})
        t = _timings(r, stream)
        by_type = t.get("draft_n_by_type", {})
        assert sum(v["draft_n"] for v in by_type.values()) == t["draft_n"]
        return _result(path, r, stream), by_type.get("draft-mtp", {}).get("draft_n", 0)

    before = run()
    text, none = run(**{"speculative.p_min": 1.0})
    assert httpx.get(srv.url + "/slots").json()[0]["params"]["speculative.p_min"] == 1.0
    text0, most = run(**{"speculative.p_min": 0})
    assert text == text0 == before[0] and none <= 1 and none < before[1] <= most, (none, before[1], most)
    assert run() == before
    assert httpx.get(srv.url + "/slots").json()[0]["params"]["speculative.p_min"] == 0.3


def test_generation_settings_show_the_requests_p_min(srv):
    body = _body("/completion", n_predict=1)
    assert _post(srv, "/completion", body).json()["generation_settings"]["speculative.p_min"] == 0.3
    r = _post(srv, "/completion", {**body, "speculative.p_min": 0.75}).json()
    assert r["generation_settings"]["speculative.p_min"] == 0.75
    chat = _post(srv, "/v1/chat/completions", _body("/v1/chat/completions", max_tokens=1, verbose=True,
                                                   **{"speculative.p_min": 0.5})).json()
    assert chat["__verbose"]["generation_settings"]["speculative.p_min"] == 0.5


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", PATHS)
def test_an_out_of_range_p_min_is_a_400_naming_it(srv, path, stream):
    for spec in ({}, {"speculative.n_max": 0}):
        for bad in (1.5, -0.1, "high", True):
            r = _post(srv, path, _body(path, max_tokens=2, stream=stream, **spec, **{"speculative.p_min": bad}))
            assert r.status_code == 400 and "speculative.p_min" in r.json()["error"]["message"], (bad, r.text)
        assert _post(srv, path, _body(path, max_tokens=2, **spec, **{"speculative.p_min": 0.9})).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", PATHS)
def test_speculative_n_max_and_n_min_clamp_as_llama_server(srv, path, stream):
    """llama-server clamps ``speculative.n_max`` below 0 to 0 (drafting off) and ``speculative.n_min`` to
    0..n_max: a negative value was a 400 here."""
    base = _fresh(path, max_tokens=8, ignore_eos=True, stream=stream)
    r = _post(srv, path, {**base, "speculative.n_max": -1})
    off = _post(srv, path, {**base, "speculative.n_max": 0})
    assert _result(path, r, stream) == _result(path, off, stream) and _timings(r, stream)["draft_n"] == 0
    r = _post(srv, path, {**base, "speculative.n_min": -3})
    assert _result(path, r, stream) == _result(path, _post(srv, path, base), stream)
    assert _timings(r, stream)["draft_n"] > 0
    body = _body("/completion", n_predict=1, **{"speculative.n_max": 2, "speculative.n_min": 9})
    settings = _post(srv, "/completion", body).json()["generation_settings"]
    assert (settings["speculative.n_max"], settings["speculative.n_min"]) == (2, 2)
