"""Unit tests of the server's pure parts, without a model, a subprocess or a live server: slot choice
(:func:`~gemmaspec.server.scheduler.pick_slot`), admission order (``Scheduler._next_admissible``),
request translation (:mod:`gemmaspec.server.translate`), the API key rule (:mod:`gemmaspec.server.deps`),
response helpers (:mod:`gemmaspec.server.responses`) and the one place a Job is built
(:func:`gemmaspec.server.jobs.submit`)."""

from __future__ import annotations

import asyncio
import json
import math
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest

from gemmaspec.request import RequestOptions
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.config import SpecConfig
from gemmaspec.server import jobs
from gemmaspec.server.apierror import APIError
from gemmaspec.server.config import ServeConfig
from gemmaspec.server.deps import PUBLIC_PATHS, given_key, key_required
from gemmaspec.server.parse import ChatRequest, CompletionRequest, NativeCompletionRequest, utf8_text, validate
from gemmaspec.server.responses import (TokenText, _at_path, _MISSING, generation_settings, logit_bias_json, sse,
                                        sse_error, usage_of)
from gemmaspec.server.scheduler import SLOT_SIMILARITY, Job, Scheduler, Slot, common_prefix, pick_slot
from gemmaspec.server.state import LoadedModel, ServerState
from gemmaspec.server.translate import (check_context, check_slot, chat_messages, completion_prompt, continuation,
                                        include_usage, native_prompts, sampling_params, spec_overrides,
                                        template_kwargs, token_limit)


# -- fakes -----------------------------------------------------------------------------------------------
class FakeTokenizer:
    """One token per character (id = code point + 10), BOS 2, ids 0..299; ``<0xE4>`` is id 5."""

    vocab_size = 300
    stop_ids = {1, 106}

    def encode_text(self, text, add_bos=False):
        return ([2] if add_bos else []) + [ord(c) + 10 for c in text]

    def encode(self, text, add_bos=None):
        return self.encode_text(text, add_bos=add_bos is not False)

    def decode(self, ids):
        return "".join(chr(i - 10) for i in ids if i >= 10)

    def id_to_token(self, tid):
        return "<0xE4>" if tid == 5 else chr(tid - 10)


ENGINE = SimpleNamespace(tokenizer=FakeTokenizer(), ctx_size=64)


def chat(*messages, **fields) -> ChatRequest:
    msgs = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
    return validate(ChatRequest, {"messages": msgs, **fields})


def completion(**fields) -> CompletionRequest:
    return validate(CompletionRequest, {"prompt": "x", **fields})


def status_of(excinfo) -> int:
    return excinfo.value.status


# -- slot choice -----------------------------------------------------------------------------------------
def slot(index, cached=(), last_used=0.0) -> Slot:
    return Slot(index, cache=None, drafter=None, cached=list(cached), last_used=last_used)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3, 4]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([], [1]) == 0
    assert common_prefix([5, 1], [1, 5]) == 0


def test_pick_slot_takes_the_slot_holding_the_prompts_head():
    prompt = list(range(100, 120))
    hot = slot(0, prompt[:12], last_used=5.0)  # 12 of 20 tokens: over 10 %, and all it keeps
    cold = slot(1, [], last_used=1.0)  # least recently used
    assert pick_slot([cold, hot], prompt, cache_prompt=True) is hot
    assert pick_slot([cold, hot], prompt, cache_prompt=False) is cold  # no reuse: least recently used


def test_pick_slot_similarity_threshold_is_strictly_more_than_a_tenth():
    assert SLOT_SIMILARITY == 0.1  # llama-server's --slot-prompt-similarity default
    prompt = list(range(100, 120))  # 20 tokens: the prefix must be more than 2
    cold = slot(1, [], last_used=0.0)
    assert pick_slot([slot(0, prompt[:2], 9.0), cold], prompt, True) is cold  # exactly 10 %: not enough
    warm = slot(0, prompt[:3], 9.0)
    assert pick_slot([warm, cold], prompt, True) is warm


def test_pick_slot_does_not_evict_a_longer_conversation_for_a_shared_head():
    prompt = list(range(100, 110))
    other = slot(0, prompt[:4] + list(range(200, 210)), last_used=9.0)  # shares 4, keeps 14: 2*4 < 14
    free = slot(1, [7, 7, 7], last_used=3.0)
    assert pick_slot([other, free], prompt, True) is free
    half = slot(0, prompt[:4] + [200, 201, 202, 203], last_used=9.0)  # shares 4, keeps 8: 2*4 >= 8
    assert pick_slot([half, free], prompt, True) is half


def test_pick_slot_least_recently_used_when_nothing_is_shared():
    a, b, c = slot(0, [1], 5.0), slot(1, [2], 2.0), slot(2, [3], 7.0)
    assert pick_slot([a, b, c], [9, 9, 9], True) is b
    never = slot(3, [], 0.0)  # a slot never used goes first
    assert pick_slot([a, b, c, never], [9, 9, 9], True) is never
    assert pick_slot([a, b, c], [], True) is b  # an empty prompt shares nothing


def test_pick_slot_prefers_the_longest_shared_prefix():
    prompt = list(range(100, 140))
    short, long_ = slot(0, prompt[:10], 1.0), slot(1, prompt[:30], 9.0)
    assert pick_slot([short, long_], prompt, True) is long_


# -- admission -------------------------------------------------------------------------------------------
def job(group=None, want_slot=-1, ids=(1, 2, 3)) -> Job:
    return Job(list(ids), RequestOptions(SamplingParams()), emit=lambda item: None, group=group, want_slot=want_slot)


def scheduler(n_slots: int, running=(), queued=()) -> Scheduler:
    """A scheduler that is never started: ``running[i]`` is slot i's job (None: free)."""
    s = Scheduler(lambda: None, n_slots)
    s.slots = [slot(i) for i in range(n_slots)]
    for i, j in enumerate(running):
        s.slots[i].job = j
    s._queue = deque(queued)
    return s


def test_admission_is_first_come_first_served():
    a, b = job(), job()
    s = scheduler(2, queued=[a, b])
    got, free = s._next_admissible()
    assert got is a and [f.index for f in free] == [0, 1]


def test_admission_with_every_slot_busy_or_nothing_queued():
    assert scheduler(1, running=[job()], queued=[job()])._next_admissible() == (None, None)
    assert scheduler(2)._next_admissible() == (None, None)


def test_admission_a_job_waiting_for_its_slot_lets_others_pass():
    waits, other = job(want_slot=0), job()
    s = scheduler(2, running=[job()], queued=[waits, other])
    got, free = s._next_admissible()
    assert got is other and [f.index for f in free] == [1]
    pinned = job(want_slot=1)
    got, free = scheduler(3, queued=[pinned])._next_admissible()
    assert got is pinned and [f.index for f in free] == [1]  # only its slot


def test_admission_a_request_with_jobs_running_yields_to_others():
    big_running = job(group=1)
    big_next, small = job(group=1), job()
    s = scheduler(3, running=[big_running], queued=[big_next, small])
    assert s._next_admissible()[0] is small
    # only a request's first queued job competes, and the fewest running wins
    g1 = [job(group=1) for _ in range(3)]
    g2 = job(group=2)
    s = scheduler(4, running=[job(group=1), job(group=1), job(group=2)], queued=[*g1, g2])
    assert s._next_admissible()[0] is g2
    # a request's jobs start in order: its later jobs never pass its first one
    first, second = job(group=3, want_slot=0), job(group=3)
    assert scheduler(2, running=[job()], queued=[first, second])._next_admissible() == (None, None)
    # with no other request queued, the busy request still gets the free slot
    s = scheduler(2, running=[job(group=1)], queued=[big_next])
    assert s._next_admissible()[0] is big_next


# -- request translation ---------------------------------------------------------------------------------
def test_token_limit_precedence():
    assert token_limit(chat(("user", "hi"), n_predict=5, max_completion_tokens=6, max_tokens=7)) == ("n_predict", 5)
    assert token_limit(chat(("user", "hi"), max_completion_tokens=6, max_tokens=7)) == ("max_completion_tokens", 6)
    assert token_limit(completion(max_tokens=7)) == ("max_tokens", 7)
    assert token_limit(completion()) == ("max_tokens", None)


def test_sampling_params_defaults_and_llama_server_readings():
    d = SamplingParams(temperature=0.3, top_k=7, seed=11, repeat_last_n=32)
    p = sampling_params(completion(), 64, default_max=16, defaults=d)
    assert (p.temperature, p.top_k, p.seed, p.max_tokens, p.repeat_last_n) == (0.3, 7, 11, 16, 32)
    p = sampling_params(completion(seed=-2, top_k=-1, repeat_last_n=-1, max_tokens=-1, stop="END"), 64, 16)
    assert p.seed == 4294967294 and p.top_k == 0 and p.repeat_last_n == 64 and p.max_tokens == -1
    assert p.stop == ("END",)
    assert sampling_params(completion(repeat_last_n=-1), None, 16).repeat_last_n == 1 << 31
    assert sampling_params(completion(max_tokens=1000), 64, 16).max_tokens == 1000  # above the context: taken


@pytest.mark.parametrize("fields, needle", [
    ({"max_tokens": -2}, "max_tokens must be at least 0"),
    ({"n_predict": -5}, "n_predict must be at least 0"),
    ({"temperature": 2.5}, "temperature must be between 0 and 2"),
    ({"top_p": 1.5}, "top_p must be between 0 and 1"),
    ({"presence_penalty": 3}, "presence_penalty must be between -2 and 2"),
    ({"min_p": 2}, "min_p must be between 0 and 1"),
    ({"repeat_last_n": -2}, "repeat_last_n must be >= 0"),
    ({"n": 2}, "only n = 1 is supported here"),
    ({"stop": ["x"] * 65}, "too many stop strings"),
    ({"logit_bias": [[5, "high"]]}, "logit_bias values must be numbers"),
    ({"logit_bias": {"999": 1}}, "outside the vocabulary"),
])
def test_sampling_params_refuses_bad_fields(fields, needle):
    with pytest.raises(APIError, match=needle) as e:
        sampling_params(completion(**fields), 64, 16, tokenizer=FakeTokenizer())
    assert status_of(e) == 400


def test_sampling_params_n_and_logit_bias():
    assert sampling_params(completion(n=3), 64, 16, max_n=16).max_tokens == 16
    with pytest.raises(APIError, match=r"n must be in 1..16"):
        sampling_params(completion(n=17), 64, 16, max_n=16)
    tok = FakeTokenizer()
    p = sampling_params(completion(logit_bias={"15": 2, "20": -100, "ab": False}), 64, 16, tokenizer=tok)
    assert p.logit_bias == ((15, 2.0), (20, -math.inf), (ord("a") + 10, -math.inf), (ord("b") + 10, -math.inf))
    p = sampling_params(completion(logit_bias=[[15, 1.5], ["a", -3]]), 64, 16, tokenizer=tok)
    assert p.logit_bias == ((15, 1.5), (ord("a") + 10, -3.0))


def test_chat_messages():
    req = chat(("developer", "be brief"), {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]},
               {"role": "assistant", "content": None})
    assert chat_messages(req) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                                  {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("message, needle", [
    ({"role": "robot", "content": "x"}, r"messages\[0\].role must be system"),
    ({"role": "user"}, r"messages\[0\].content is missing"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "'image_url' parts are not supported"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, r"content\[0\].text must be a string"),
    ({"role": "user", "content": "x", "tool_calls": []}, "tool_calls must be an assistant message"),
])
def test_chat_messages_refuses(message, needle):
    with pytest.raises(APIError, match=needle):
        chat_messages(chat(message))


def test_continuation_as_llama_server_decides():
    assert continuation(chat(("user", "hi"))) == (True, False)
    assert continuation(chat(("user", "hi"), ("assistant", "Sure,"))) == (False, True)  # a final reply goes on
    assert continuation(chat(("user", "hi"), ("assistant", "Sure,"), continue_final_message=False)) == (True, False)
    assert continuation(chat(("user", "hi"), add_generation_prompt=False)) == (False, False)
    for req, needle in [
        (chat(("user", "a"), ("assistant", "b"), ("assistant", "c")), "2 or more assistant messages"),
        (chat(("user", "a"), ("assistant", "b"), continue_final_message=True, add_generation_prompt=True),
         "Cannot set both"),
        (chat(("user", "a"), continue_final_message=True, add_generation_prompt=False), "needs a final assistant"),
        (chat(("user", "a"), {"role": "assistant", "content": "b", "tool_calls": [{"function": {"name": "f"}}]},
              continue_final_message=True, add_generation_prompt=False), "contains tool calls"),
    ]:
        with pytest.raises(APIError, match=needle):
            continuation(req)


def test_template_kwargs():
    assert template_kwargs(chat(("user", "a"))) is None
    assert template_kwargs(chat(("user", "a"), chat_template_kwargs={"enable_thinking": False})) == \
        {"enable_thinking": False}
    with pytest.raises(APIError, match="cannot set bos_token, messages"):
        template_kwargs(chat(("user", "a"), chat_template_kwargs={"messages": [], "bos_token": "x"}))


def test_spec_overrides_clamps_as_llama_server():
    cfg = ServeConfig(spec=SpecConfig(n_max=3, n_min=1))
    assert spec_overrides(completion(), cfg) == (3, 1, None)
    assert spec_overrides(completion(**{"speculative.n_max": -4}), cfg) == (0, 0, None)  # off
    assert spec_overrides(completion(**{"speculative.n_max": 2, "speculative.n_min": 9}), cfg) == (2, 2, None)
    assert spec_overrides(completion(**{"speculative.n_max": "auto", "speculative.n_min": 9,
                                        "speculative.p_min": 0.5}), cfg) == ("auto", 9, 0.5)
    for bad, needle in [({"speculative.n_max": "many"}, "speculative.n_max must be a number or 'auto'"),
                        ({"speculative.n_min": 1.5}, "speculative.n_min must be a number"),
                        ({"speculative.p_min": 2}, r"speculative.p_min must be a number in \[0, 1\]")]:
        with pytest.raises(APIError, match=needle):
            spec_overrides(completion(**bad), cfg)


def test_prompts_of_completion_and_native_requests():
    assert completion_prompt("ab", ENGINE) == [2, ord("a") + 10, ord("b") + 10]
    assert completion_prompt([15, 16], ENGINE) == [15, 16]
    assert completion_prompt([15, "a"], ENGINE) == [15, ord("a") + 10]  # text after ids: no BOS
    with pytest.raises(APIError, match="prompt token id 300 is outside"):
        completion_prompt([300], ENGINE)
    with pytest.raises(APIError, match="the prompt is empty"):
        completion_prompt([], ENGINE)
    assert native_prompts(["a", "b"], ENGINE) == [[2, ord("a") + 10], [2, ord("b") + 10]]
    assert native_prompts({"prompt_string": "a"}, ENGINE) == [[2, ord("a") + 10]]
    assert native_prompts([[15], [16, 17]], ENGINE) == [[15], [16, 17]]
    with pytest.raises(APIError, match="start it with --mmproj FILE"):
        native_prompts({"prompt_string": "a", "multimodal_data": ["x"]}, ENGINE)


def test_checks_of_slot_context_and_usage_options():
    check_slot(-1, 2)
    check_slot(1, 2)
    with pytest.raises(APIError, match=r"id_slot must be -1 \(any\) or a slot in 0..1 \(got 2\)"):
        check_slot(2, 2)
    check_context([1] * 63, 64, False)
    check_context([1] * 64, 64, True)  # --context-shift cuts the prompt instead
    with pytest.raises(APIError) as e:
        check_context([1] * 64, 64, False)
    assert e.value.type == "exceed_context_size_error" and e.value.extra == {"n_prompt_tokens": 64, "n_ctx": 64}
    assert include_usage(completion()) is None
    assert include_usage(completion(stream=True, stream_options={"include_usage": True})) is True
    assert include_usage(completion(stream=True, stream_options={})) is False
    with pytest.raises(APIError, match="only allowed with stream: true"):
        include_usage(completion(stream_options={"include_usage": True}))
    with pytest.raises(APIError, match="must be true or false"):
        include_usage(completion(stream=True, stream_options={"include_usage": "yes"}))


# -- the API key ------------------------------------------------------------------------------------------
def test_api_key_rule():
    assert given_key({"authorization": "Bearer  abc "}) == "abc"
    assert given_key({"authorization": "bEaReR abc"}) == "abc"
    assert given_key({"x-api-key": "xyz"}) == "xyz"
    assert given_key({"authorization": "Basic abc", "x-api-key": "xyz"}) == "xyz"
    assert given_key({}) == ""
    assert not key_required(None, "/v1/completions", {})  # no --api-key: everything open
    assert key_required("k", "/v1/completions", {})
    assert key_required("k", "/props", {"authorization": "Bearer j"})
    assert not key_required("k", "/props", {"authorization": "Bearer k"})
    assert not key_required("k", "/metrics", {"x-api-key": "k"})
    for path in ("/", "/health", "/v1/health", "/v1/models", "/models"):
        assert path in PUBLIC_PATHS and not key_required("k", path, {})
    assert not key_required("k", "/static/app.js", {})  # the chat page's files
    assert key_required("k", "/staticx", {}) and key_required("k", "/v1/static/app.js", {})
    assert key_required("k", "/slots", {}) and key_required("k", "/health/", {})


@pytest.mark.parametrize("raw,needles", [
    (b'{"prompt": "caf\xe9"}', ("e9 at byte 15", "cut short", "Latin-1")),
    (b'{"prompt": "\xe2\x82"}', ("e2 82 at byte 12", "cut short")),
    (b'{"prompt": "\xed\xa0\x80"}', ("ed a0 80 at byte 12", "surrogate")),
    (b'{"stop": ["\xed\xbf\xbf"]}', ("ed bf bf at byte 11", "surrogate")),
    (b'{"prompt": "\x80"}', ("80 at byte 12", "continuation byte")),
    (b'{"prompt": "\xc0\xaf"}', ("c0 at byte 12", "never uses")),
    (b'{"prompt": "\xf4\x90\x80\x80"}', ("f4 90 at byte 12", "out-of-range")),
    (b'\xef\xbb\xbf{"p": "\xe9"}', ("e9 at byte 10",)),  # the offset counts the byte-order mark
])
def test_a_body_that_is_not_utf8_is_a_400_naming_the_bytes(raw, needles):
    with pytest.raises(APIError) as e:
        utf8_text(raw)
    assert e.value.status == 400 and "not valid UTF-8" in e.value.message
    for n in needles:
        assert n in e.value.message, e.value.message


def test_utf8_text_reads_what_json_loads_reads():
    """Valid UTF-8 (with or without a byte-order mark) and UTF-16 / UTF-32 bodies read as before;
    a UTF-16 body's lone surrogate is refused too."""
    text = '{"prompt": "caf\u00e9 \u20ac \U0001f600"}'
    for raw in (text.encode(), b"\xef\xbb\xbf" + text.encode(), text.encode("utf-16"), text.encode("utf-16-le"),
                text.encode("utf-32")):
        assert utf8_text(raw) == text and json.loads(utf8_text(raw)) == json.loads(raw)
    with pytest.raises(APIError, match="UTF-16"):
        utf8_text('{"a": "\ud800"}'.encode("utf-16-le", "surrogatepass"))


# -- responses ---------------------------------------------------------------------------------------------
def test_usage_counts_each_prompt_once():
    shared, other = [1, 2, 3], [4, 5]
    jobs_ = []
    for ids, prompt_n, gen, cached in ((shared, 3, 4, 2), (shared, 3, 6, 0), (other, 2, 1, 1)):
        j = job(ids=())
        j.prompt_ids = ids
        j.stats.prompt_tokens, j.stats.generated_tokens, j.cache_n = prompt_n, gen, cached
        jobs_.append(j)
    assert usage_of(jobs_) == {"prompt_tokens": 5, "completion_tokens": 11, "total_tokens": 16,
                               "prompt_tokens_details": {"cached_tokens": 3}}  # each prompt's first choice
    assert usage_of(jobs_[1:2])["prompt_tokens_details"] == {"cached_tokens": 0}  # nothing reused: 0, not absent


def test_token_text_byte_tokens_and_repeated_keys():
    tt = TokenText(FakeTokenizer())
    assert tt(5) == ("bytes:\\xe4", b"\xe4")
    assert tt(ord("a") + 10) == ("a", b"a")
    assert tt.keyed([(ord("a") + 10, -0.5), (ord("b") + 10, -1.0)]) == {"a": -0.5, "b": -1.0}
    tt.tok = SimpleNamespace(id_to_token=lambda t: "x", decode=lambda ids: "same")
    assert TokenText(tt.tok).keyed([(40, -0.1), (41, -0.2)]) == {"same": -0.1, "same [id 41]": -0.2}


def test_sse_and_paths():
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n'
    err = json.loads(sse_error((503, "busy"))[len("data: "):])
    assert err == {"error": {"message": "busy", "type": "unavailable_error", "code": 503}}
    assert _at_path({"a": {"b": 1}}, "a/b") == 1
    assert _at_path({"a": {"b": 1}}, "a/c") is _MISSING and _at_path({"a": 1}, "a/b") is _MISSING


def test_logit_bias_json_and_generation_settings():
    p = SamplingParams(logit_bias=((7, 1.5),), ignore_eos=True)
    assert logit_bias_json(p, {106, 1}) == [{"bias": 1.5, "token": 7}, {"bias": None, "token": 1},
                                           {"bias": None, "token": 106}]
    st = state(ServeConfig(n_predict=32, spec=SpecConfig(n_max=4), defaults=SamplingParams(seed=-1, temperature=0.2)))
    s = generation_settings(st)
    assert (s["n_predict"], s["seed"], s["temperature"], s["speculative.n_max"], s["speculative.p_min"]) == \
        (32, 4294967295, 0.2, 4, 0.25)
    s = generation_settings(st, SamplingParams(max_tokens=5, seed=9), n_max=0, n_min=0, p_min=0.5)
    assert (s["n_predict"], s["seed"], s["speculative.n_max"], s["speculative.p_min"]) == (5, 9, 0, 0.5)


# -- building and submitting a Job --------------------------------------------------------------------------
class FakeScheduler:
    def __init__(self, fail=None):
        self.submitted, self.fail = [], fail

    def submit(self, j):
        if self.fail:
            raise RuntimeError(self.fail)
        self.submitted.append(j)


def state(cfg=None, scheduler=None) -> ServerState:
    model = LoadedModel(engine=ENGINE, path=Path("m.gguf"), spec_type="ngram-simple", model_id="m", aliases=[],
                        p_min=0.25, draft_file=None, load_s=0.0, created=0)
    return ServerState(cfg or ServeConfig(), scheduler or FakeScheduler(), metrics=None, started=0, model=model)


def test_submit_builds_the_job_from_the_request():
    st = state(ServeConfig(spec=SpecConfig(n_max=3), n_keep=7))
    req = validate(NativeCompletionRequest, {"prompt": "x", "speculative.n_max": 2, "cache_prompt": False,
                                              "return_progress": True, "stream": True, "n_discard": 4,
                                              "post_sampling_probs": True})
    fmt = SimpleNamespace(id="cmpl-abc")

    async def go():
        queue = asyncio.Queue()
        j = await jobs.submit(st, req, "completion", [1, 2], SamplingParams(), 3, fmt, queue, want_slot=1, tag=4,
                              group=9)
        j.emit(("done", j))
        return j, await asyncio.wait_for(queue.get(), 5)

    j, item = asyncio.run(go())
    assert st.scheduler.submitted == [j]
    o = j.options
    assert (j.prompt_ids, o.n_max, o.n_min, o.logprobs, o.p_min, j.name, j.endpoint, j.want_slot) == \
        ([1, 2], 2, 0, 3, None, "cmpl-abc", "completion", 1)
    assert (j.cache_prompt, o.post_sampling, j.progress, o.n_keep, o.n_discard, j.group) == \
        (False, True, True, 7, 4, 9)
    assert o.context_shift is False and o.params == SamplingParams()
    assert item == (4, ("done", j))  # tagged with its choice


def test_submit_refuses_long_prompts_and_a_stopped_scheduler():
    req = completion()
    with pytest.raises(APIError, match="exceeds the available context size"):
        asyncio.run(jobs.submit(state(), req, "completions", [1] * 64, SamplingParams(), None, None,
                                asyncio.Queue()))
    with pytest.raises(APIError, match="shutting down") as e:
        asyncio.run(jobs.submit(state(scheduler=FakeScheduler("the server is shutting down")), req, "completions",
                                [1], SamplingParams(), None, None, asyncio.Queue()))
    assert status_of(e) == 503
    st = state(ServeConfig(n_keep=7), FakeScheduler())
    asyncio.run(jobs.submit(st, completion(n_keep=-1), "completions", [1], SamplingParams(), None, None,
                            asyncio.Queue()))
    j = st.scheduler.submitted[0]
    assert j.options.n_keep == -1 and j.progress is False and j.name.startswith("cmpl-") and j.cache_prompt is True
