"""Context shift (llama-server's ``--context-shift``, ``n_keep``, ``n_discard``): a prompt that does not fit is
cut, and a generation that fills the context drops tokens after the first ``n_keep`` and goes on, with the
cache rebuilt from the tokens kept — so what follows a shift is exactly what the model gives on the
shortened sequence, with and without drafting, greedy and seeded."""

from __future__ import annotations

import httpx
import pytest
import torch

from conftest import ServerProcess, run_cli
from gemmaspec.engine import PREFILL_CHUNK, Engine, RequestStats
from gemmaspec.errors import InputError
from gemmaspec.sampling import SamplingParams, ban_end_of_generation, greedy_token
from gemmaspec.speculative.drafters import NgramDrafter

CTX = 48


@pytest.fixture(scope="module")
def shifting(engine):
    return Engine(engine.model, engine.tokenizer, CTX)


def _run(e, ids, params, context_shift=True, **kw):
    st = RequestStats()
    out = [t for ev in e.generate(ids, params, stats=st, context_shift=context_shift, **kw) for t in ev.tokens]
    return out, st


def _reference(e, ids, params, n, keep_after_bos=0):
    """Greedy generation with llama-server's shift rule, written out step by step: the same operations
    (prefill in chunks, then one-token forwards) on a fresh cache after every shift."""
    params = ban_end_of_generation(params, e.tokenizer.stop_ids)
    model, cache = e.model, e.model.new_cache(CTX)
    keep = 1 + keep_after_bos  # BOS + n_keep

    def prefill(toks):
        cache.reset()
        out = None
        for i in range(0, len(toks), PREFILL_CHUNK):
            out = model.forward(torch.tensor(toks[i:i + PREFILL_CHUNK]), cache)
        return out

    toks = list(ids)
    out = prefill(toks)
    gen = []
    while True:
        t = greedy_token(out.logits[-1], params, toks)
        toks.append(t)
        gen.append(t)
        if len(gen) == n:
            return gen
        if len(toks) >= CTX:
            cached = len(toks) - 1
            discard = (cached - keep) // 2
            toks = toks[:keep] + toks[keep + discard:]
            prefill(toks[:-1])
        out = model.forward(torch.tensor(toks[-1:]), cache)


def test_generation_goes_past_the_context_and_continues_exactly(shifting):
    ids = shifting.tokenizer.encode("The quick brown fox jumps over the lazy dog. Then")
    p = SamplingParams(temperature=0, max_tokens=3 * CTX, ignore_eos=True)
    got, st = _run(shifting, ids, p)
    assert len(got) == 3 * CTX and st.truncated and st.stop_reason == "length"
    assert got == _reference(shifting, ids, p, 3 * CTX)
    kept, _ = _run(shifting, ids, p, n_keep=4)  # a longer kept head changes what follows the first shift
    assert kept == _reference(shifting, ids, p, 3 * CTX, keep_after_bos=4)


@pytest.mark.parametrize("temp", [0.0, 0.8])
@pytest.mark.parametrize("n_discard", [0, 5])
def test_a_shift_gives_the_same_tokens_with_and_without_drafting(shifting, temp, n_discard):
    ids = shifting.tokenizer.encode("one two three four one two three four one two three")
    p = SamplingParams(temperature=temp, seed=11, max_tokens=2 * CTX, ignore_eos=True)
    plain, st = _run(shifting, ids, p, n_discard=n_discard)
    for n_max in (1, 3):
        spec, st2 = _run(shifting, ids, p, drafter=NgramDrafter(), n_max=n_max, n_discard=n_discard)
        assert spec == plain
        assert st2.truncated and st2.spec.drafted > 0
    assert st.truncated and len(plain) == 2 * CTX


def test_a_prompt_that_does_not_fit_is_cut_as_llama_server_cuts_it(shifting, engine):
    ids = engine.tokenizer.encode("apples, pears, plums, figs, " * 12)
    assert len(ids) > CTX
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got, st = _run(shifting, ids, p)
    block = (CTX - 1) // 2  # BOS kept, then whole blocks of half the room dropped after it
    erased = (len(ids) - 1 - block) // block
    cut = ids[:1] + ids[1 + erased * block:]
    assert st.truncated and st.prompt_tokens == len(cut) < CTX
    assert got == _run(shifting, cut, p)[0]
    with pytest.raises(InputError, match="context"):
        _run(shifting, ids, p, context_shift=False)  # without --context-shift: refused


def test_a_long_kept_head_is_capped_at_half_the_context(shifting):
    """n_keep -1 with a prompt that fills the context would otherwise shift (and rebuild the cache) every
    token or two: the head kept is at most half the context, so each shift frees a quarter or more."""
    ids = shifting.tokenizer.encode("apples, pears, plums, figs, " * 12)
    p = SamplingParams(temperature=0, max_tokens=2 * CTX, ignore_eos=True)
    rebuilds = []
    orig = shifting._prefill
    shifting._prefill = lambda toks, *a, **k: (rebuilds.append(len(toks)), orig(toks, *a, **k))[1]
    try:
        got, st = _run(shifting, ids, p, n_keep=-1)
    finally:
        del shifting._prefill
    assert len(got) == 2 * CTX and st.truncated
    assert len(rebuilds) - 1 <= 2 * CTX // (CTX // 4)  # the prompt's prefill, then one per shift


def test_bad_shift_settings_are_refused(shifting):
    ids = shifting.tokenizer.encode("hello")
    for kw, msg in (({"n_keep": -2}, "n_keep"), ({"n_discard": -1}, "n_discard")):
        with pytest.raises(InputError, match=msg):
            _run(shifting, ids, SamplingParams(max_tokens=2), **kw)


def test_cli_generate_with_context_shift(model_path):
    r = run_cli("generate", "-m", str(model_path), "-p", "Once upon a time", "-n", "40", "-c", "24", "--temp", "0",
                "--ignore-eos", "--context-shift", "--json")
    assert r.returncode == 0, r.stderr
    assert '"generated_tokens": 40' in r.stdout and '"truncated": true' in r.stdout
    r = run_cli("generate", "-m", str(model_path), "-p", "Once upon a time", "-n", "40", "-c", "24", "--temp", "0",
                "--ignore-eos", "--json")
    assert r.returncode == 0 and '"generated_tokens": 40' not in r.stdout  # stops at the context


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("serve-shift"), "-np", "2", "-c", "128", "--context-shift",
                      "--temp", "0")
    yield s
    s.close()


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_server_cuts_long_prompts_and_shifts(srv, path):
    long = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 30
    r = httpx.post(srv.url + path, json={"prompt": long, "n_predict": 64, "ignore_eos": True}, timeout=300)
    assert r.status_code == 200, r.text
    b = r.json()
    if path == "/completion":
        assert b["truncated"] is True and b["timings"]["predicted_n"] == 64 and b["timings"]["prompt_n"] < 128
    else:
        assert b["usage"]["completion_tokens"] == 64 and b["usage"]["prompt_tokens"] < 128
    r = httpx.post(srv.url + "/completion", json={"prompt": "Once", "n_predict": 200, "ignore_eos": True,
                                                   "n_keep": 1, "n_discard": 16}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["timings"]["predicted_n"] == 200 and r.json()["truncated"] is True


def test_prompt_cache_reuse_is_checked_against_the_cut_prompt(srv):
    """A slot's cached tokens are matched against the prompt the request runs (cut by the shift), not the
    prompt it sent: a prompt that starts with a cached cut prompt but is itself cut must not reuse it."""
    def tok(text):
        return httpx.post(srv.url + "/tokenize", json={"content": text, "add_special": True}, timeout=60).json()["tokens"]

    def gen(prompt, cache=True):
        r = httpx.post(srv.url + "/completion", json={"prompt": prompt, "n_predict": 8, "cache_prompt": cache,
                                                       "return_tokens": True}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    p = tok("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 30)
    block = (128 - 1) // 2
    cut_p = p[:1] + p[1 + (len(p) - 1 - block) // block * block:]
    gen(p)  # a slot now holds cut(p) and its continuation
    q = cut_p + tok("Sed ut perspiciatis unde omnis iste natus error sit voluptatem. " * 4)[1:]
    assert len(q) >= 128
    cut_q = q[:1] + q[1 + (len(q) - 1 - block) // block * block:]
    assert cut_q[:8] != cut_p[:8]
    assert gen(q) == gen(cut_q, cache=False)
