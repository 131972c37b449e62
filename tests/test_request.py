"""RequestOptions, the per-request options written down once (issue 30): how they are built and checked,
where the ``max_tokens`` limit is decided (the request state, not the detokenizer), and ``p_min`` applied
by Engine.generate for one call only."""

from __future__ import annotations

import pytest

from gemmaspec.engine import RequestState, RequestStats
from gemmaspec.errors import InputError
from gemmaspec.request import RequestOptions
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.drafters import Draft
from gemmaspec.streaming import StopChecker


def test_options_of_sampling_params_or_options():
    p = SamplingParams(temperature=0, max_tokens=5)
    o = RequestOptions.of(p, n_max=3, n_keep=2)
    assert (o.params, o.n_max, o.n_keep, o.n_min, o.logprobs, o.context_shift) == (p, 3, 2, 0, None, False)
    assert RequestOptions.of(o) is o
    assert RequestOptions.of(o, n_min=2) == RequestOptions(p, n_max=3, n_min=2, n_keep=2)
    with pytest.raises(TypeError):
        RequestOptions.of(p, n_maxx=3)


def test_tokens_left_counts_down_to_the_limit():
    assert RequestOptions(SamplingParams(max_tokens=4)).tokens_left(1) == 3
    assert RequestOptions(SamplingParams(max_tokens=4)).tokens_left(4) == 0
    assert RequestOptions(SamplingParams(max_tokens=-1)).tokens_left(10 ** 6) is None


@pytest.mark.parametrize("fields, needle", [({"n_max": 16}, "draft length"), ({"n_max": "fast"}, "draft length"),
                                            ({"n_keep": -2}, "n_keep"), ({"n_discard": -1}, "n_discard"),
                                            ({"post_sampling": True, "constraint": object()}, "grammar")])
def test_bad_options_are_refused(fields, needle):
    with pytest.raises(InputError, match=needle):
        RequestOptions(SamplingParams(), **fields).validate(max_rollback=16)
    RequestOptions(SamplingParams(), n_max="auto").validate(max_rollback=16)


def test_the_detokenizer_does_not_decide_length(tokenizer):
    """StopChecker reads no max_tokens: only the caller's ``last`` ends a text by length."""
    st = StopChecker(tokenizer, SamplingParams(max_tokens=1))
    ids = tokenizer.encode(" one two three", add_bos=False)
    for t in ids:
        assert st.add(t) is not None and st.reason == ""


def test_the_request_state_stops_at_max_tokens(engine):
    ids = engine.tokenizer.encode("Once upon a time")
    for n in (0, 1, 5):
        st = RequestStats()
        s = RequestState(engine, ids, RequestOptions(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)),
                         stats=st)
        s.prefill()
        while not s.done:
            rnd = s.begin_round()
            s.finish_round(engine.model.forward(rnd.tokens, s.cache, all_logits=rnd.all_logits))
        assert (st.generated_tokens, st.stop_reason) == (n, "length")


class _Recorder:
    """A drafter with a ``p_min`` that proposes nothing and records the ``p_min`` it drafted with."""

    name = "recorder"

    def __init__(self):
        self.p_min, self.seen = 0.25, []

    def propose(self, ctx, n_max):
        self.seen.append(self.p_min)
        return Draft()

    def reset(self):
        pass


def test_generate_applies_p_min_for_the_call_only(engine):
    ids = engine.tokenizer.encode("Once upon a time")
    d = _Recorder()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = [t for ev in engine.generate(ids, params) for t in ev.tokens]
    got = [t for ev in engine.generate(ids, params, d, n_max=2, p_min=0.5) for t in ev.tokens]
    assert got == plain and d.seen and set(d.seen) == {0.5} and d.p_min == 0.25
    list(engine.generate(ids, params, d, n_max=2))
    assert d.seen[-1] == 0.25
