"""llama.cpp's ``ngram-mod`` drafter (speculative/drafters.py NgramModDrafter, NgramPool): drafts by
following a shared hash pool of n-grams, proposes nothing below its n-min, empties the pool after three
poor rounds, shares the pool between slots, takes the list syntax, and keeps greedy output exact."""

from __future__ import annotations

import pytest

from gemmaspec.errors import InputError
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.config import SpecConfig
from gemmaspec.speculative.drafters import ChainDrafter, DraftContext, NgramModDrafter, NgramPool
from gemmaspec.speculative.options import parse_spec_type
from gemmaspec.speculative.plan import build, plan


def test_follows_the_pool_from_the_last_n_tokens():
    pool = NgramPool(n=3, size=1 << 12)
    d = NgramModDrafter(pool)
    text = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7]  # 5 6 7 seen before, followed by 8 9 10 11
    assert d.propose(DraftContext(text), 4).tokens == [8, 9, 10, 11]
    assert d.propose(DraftContext(text), 2).tokens == [8, 9]
    assert d.propose(DraftContext([1, 2, 3, 4, 40, 41, 42]), 4).tokens == []  # nothing recorded for 40 41 42


def test_n_min_short_context_and_a_pool_shared_between_requests():
    pool = NgramPool(n=3, size=1 << 12)
    NgramModDrafter(pool).propose(DraftContext([1, 2, 3, 4, 5]), 4)  # another slot's text fills the pool
    assert NgramModDrafter(pool, n_min=2).propose(DraftContext([9, 1, 2, 3]), 8).tokens == [4, 5]
    assert NgramModDrafter(pool, n_min=3).propose(DraftContext([9, 1, 2, 3]), 8).tokens == []  # too short
    assert NgramModDrafter(pool).propose(DraftContext([1, 2]), 4).tokens == []  # fewer than n tokens


def test_three_poor_rounds_in_a_row_empty_the_pool():
    pool = NgramPool(n=2, size=1 << 12)
    resets, orig = [], pool.reset
    pool.reset = lambda: (resets.append(1), orig())
    d = NgramModDrafter(pool)
    toks = [1, 2, 3, 4, 1, 2]
    for i in range(4):
        assert d.propose(DraftContext(toks), 2).tokens  # it drafts every round...
        toks = toks + [100 + i, 1, 2]  # ...and the text never goes where the draft said
    assert resets == [1]  # emptied once, at the third miss in a row
    assert pool.used > 0  # and refilled from this request's text


def test_the_pool_is_shared_by_the_slots_and_the_list_syntax(engine):
    assert parse_spec_type("draft-mtp,ngram-mod") == "ngram-mod,draft-mtp"
    assert parse_spec_type("ngram-mod,ngram-simple") == "ngram-mod,ngram-simple"  # draftless: as given
    with pytest.raises(InputError):
        SpecConfig("ngram-mod", ngram_mod_n_match=0).checked()
    make = build(plan(SpecConfig("ngram-mod", ngram_mod_n_match=4), engine.model_path), engine)
    a, b = make(None), make(None)
    assert isinstance(a, NgramModDrafter) and a.pool is b.pool and a.pool.n == 4
    chain = build(plan(SpecConfig("ngram-mod,draft-mtp"), engine.model_path), engine)(engine.cache)
    assert isinstance(chain, ChainDrafter) and chain.name == "ngram-mod,draft-mtp"


def test_greedy_output_equals_plain(engine):
    d = build(plan(SpecConfig("ngram-mod", ngram_mod_n_match=3), engine.model_path), engine)(engine.cache)
    ids = engine.tokenizer.encode("Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [t for e in engine.generate(ids, params) for t in e.tokens]
    from gemmaspec.engine import RequestStats

    st = RequestStats()
    spec = [t for e in engine.generate(ids, params, d, n_max=4, stats=st) for t in e.tokens]
    assert spec == plain
    assert st.spec.drafted > 0
