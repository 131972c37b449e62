"""Sampling: exact masks on hand-made logits, seeds, parameter validation."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gemmaspec.errors import InputError
from gemmaspec.sampling import Sampler, SamplingParams, apply_repeat_penalty, argmax, filtered_probs, greedy_token

# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 (temperature 1)
P = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
LOGITS = P.log()


def kept(params):
    ids, probs = filtered_probs(LOGITS, params)
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-12)
    return ids.tolist(), probs


def test_top_k_keeps_the_k_best():
    assert kept(SamplingParams(temperature=1, top_k=2, top_p=1, min_p=0))[0] == [1, 3]


def test_top_p_keeps_smallest_set_reaching_p():
    assert kept(SamplingParams(temperature=1, top_k=0, top_p=0.7, min_p=0))[0] == [1, 3]
    assert kept(SamplingParams(temperature=1, top_k=0, top_p=0.71, min_p=0))[0] == [1, 3, 4]
    assert kept(SamplingParams(temperature=1, top_k=0, top_p=0.01, min_p=0))[0] == [1]
    assert kept(SamplingParams(temperature=1, top_k=0, top_p=0, min_p=0))[0] == [1]  # 0: the most likely, as llama.cpp


def test_min_p_is_relative_to_the_top_token():
    # 0.4 * 0.3 = 0.12: keeps 0.4, 0.3, 0.15
    assert kept(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0.3))[0] == [1, 3, 4]


def test_top_p_after_top_k_renormalises_over_survivors():
    # top-k 3 leaves 0.4, 0.3, 0.15 (sum 0.85): renormalised 0.47, 0.35, 0.18; top-p 0.8 keeps two
    assert kept(SamplingParams(temperature=1, top_k=3, top_p=0.8, min_p=0))[0] == [1, 3]


def test_temperature_reshapes_kept_probabilities():
    ids, probs = kept(SamplingParams(temperature=0.5, top_k=0, top_p=1, min_p=0))
    expect = torch.softmax(LOGITS.double() / 0.5, -1)[ids]
    torch.testing.assert_close(probs, expect / expect.sum())


def test_greedy_is_argmax():
    assert kept(SamplingParams(temperature=0))[0] == [1]


def test_repeat_penalty():
    p = SamplingParams(temperature=0, repeat_penalty=10.0)
    logits = torch.tensor([1.0, 2.0, -1.0])
    ids, _ = filtered_probs(logits, p, history=[1])
    assert ids.tolist() == [0]  # 2.0 / 10 < 1.0


_small_logits = st.lists(st.sampled_from([-math.inf, -3.0, -1.0, 0.0, 0.5, 2.0, 2.0, 7.0]), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(_small_logits, st.lists(st.tuples(st.integers(0, 11), st.sampled_from([-math.inf, -100.0, -2.0, 0.0, 3.0])),
                               max_size=4),
       st.sampled_from([1.0, 1.3]), st.sampled_from([0.0, 0.5]), st.lists(st.integers(0, 11), max_size=6))
def test_greedy_token_is_the_argmax_after_bias_and_penalties(vals, bias, rep, pres, history):
    """The greedy shortcut (raw argmax unless the bias touches it) picks what the full chain picks:
    ties to the lowest id, bans of the raw winner, positive biases and penalties included."""
    logits = torch.tensor(vals, dtype=torch.float32)
    bias = tuple((t, b) for t, b in bias if t < len(vals))
    history = [t for t in history if t < len(vals)]
    p = SamplingParams(temperature=0, logit_bias=bias, repeat_penalty=rep, presence_penalty=pres)
    want = int(torch.argmax(apply_repeat_penalty(logits, history, p)))
    assert greedy_token(logits, p, history) == want
    assert filtered_probs(logits, p, history)[0].tolist() == [want]
    assert Sampler(p).sample(logits, history) == want


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([-math.inf, -1.0, 0.0, 1.0, 1.0, math.inf, math.nan]), min_size=1, max_size=40),
       st.integers(1, 3))
def test_argmax_matches_torch(vals, rows):
    """The NumPy argmax returns torch.argmax's index: first of equal maxima, first NaN, per row."""
    x = torch.tensor(vals, dtype=torch.float32).repeat(rows, 1)
    assert argmax(x).tolist() == torch.argmax(x, -1).tolist()
    assert int(argmax(x[0])) == int(torch.argmax(x[0]))


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_same_seed_same_draws(seed):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(seed % 1000))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0, seed=seed)
    a, b = Sampler(params), Sampler(params)
    assert [a.sample(logits) for _ in range(20)] == [b.sample(logits) for _ in range(20)]


def test_draws_follow_the_distribution():
    from scipy.stats import chisquare

    s = Sampler(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, seed=123))
    n = 20000
    counts = torch.bincount(torch.tensor([s.sample(LOGITS) for _ in range(n)]), minlength=5)
    expected = (P.double() / P.double().sum() * n).numpy()
    assert chisquare(counts.numpy(), expected).pvalue > 1e-3


@pytest.mark.parametrize("kw,msg", [
    ({"temperature": -1}, "temperature"), ({"top_p": 2}, "top-p"), ({"top_p": -0.1}, "top-p"),
    ({"top_k": -1}, "top-k"), ({"min_p": 1.5}, "min-p"), ({"max_tokens": -2}, "tokens"),
    ({"repeat_penalty": 0}, "repeat-penalty"), ({"temperature": float("nan")}, "temperature"),
])
def test_out_of_range_values(kw, msg):
    with pytest.raises(InputError, match=msg):
        SamplingParams(**kw).validate()


def test_same_seed_same_text(engine):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=16)
    ids = engine.tokenizer.encode("The weather today")
    a = "".join(ev.text for ev in engine.generate(ids, params))
    b = "".join(ev.text for ev in engine.generate(ids, params))
    c = "".join(ev.text for ev in engine.generate(ids, SamplingParams(temperature=1.0, seed=8, max_tokens=16)))
    assert a == b
    assert a != c


def test_a_large_logit_bias_is_turned_into_tensors_once(monkeypatch):
    """A request may bias most of the vocabulary (llama-server's and OpenAI's logit_bias has no size
    limit): its ids and biases become tensors once per request, not at every position of every round
    on the thread that runs all the slots (was two tensors from 200,000-entry lists per position)."""
    import gemmaspec.sampling as sampling

    bias = tuple((t, 0.5 if t % 4 else -100.0) for t in range(0, 200_000, 2)) + ((7, -math.inf),)
    params = SamplingParams(temperature=0.7, logit_bias=bias, presence_penalty=0.1, seed=1)
    logits = torch.linspace(-3, 3, 262_144)
    want = logits.clone().index_add_(0, torch.tensor([t for t, _ in bias]), torch.tensor([b for _, b in bias]))
    greedy = SamplingParams(temperature=0, logit_bias=bias)
    made = []
    real = torch.tensor
    monkeypatch.setattr(sampling.torch, "tensor", lambda *a, **k: made.append(1) or real(*a, **k))
    for _ in range(20):
        got = apply_repeat_penalty(logits, [], params)
        top = greedy_token(logits, greedy, [])
    assert torch.equal(got, want) and top == int(want.argmax())
    assert len(made) <= 4  # ids and biases, once for each params object


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),                                # raw argmax
    SamplingParams(temperature=0, ignore_eos=True),               # with a logit bias
    SamplingParams(temperature=0, repeat_penalty=1.3),            # penalties
    SamplingParams(temperature=0.8, seed=1),                      # sampling, whole vocabulary
    SamplingParams(temperature=0.8, seed=1, top_k=5, top_p=0.9),  # sampling, filtered
])
@pytest.mark.parametrize("where", ["all", "one"])
def test_nan_logits_raise_instead_of_token_zero(params, where):
    """An argmax over NaN scores gives id 0 (numpy's and torch's rule), which once reached a user as a
    spurious token: NaN logits are a defect and raise a clear error on every path that picks a token
    (the sampler, the greedy and sampling verification of a speculative round)."""
    from gemmaspec.sampling import NonFiniteLogitsError
    from gemmaspec.speculative.verify import verify_round

    logits = torch.randn(3, 50)
    if where == "all":
        logits[1] = float("nan")
    else:
        logits[1, 17] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="NaN"):
        Sampler(params).sample(logits[1], [1, 2], pos=4)
    if not params.greedy:  # the draft accepted at row 0 must be the token drawn there
        first = Sampler(params).sample(logits[0], [1, 2], pos=4)
    else:
        first = greedy_token(logits[0], params, [1, 2])
    with pytest.raises(NonFiniteLogitsError, match="NaN"):  # row 0's draft accepted, row 1 is NaN
        verify_round(logits, [1, 2], [first, 3], None, params, Sampler(params), pos=4)
    assert isinstance(Sampler(params).sample(logits[0], [1, 2], pos=4), int)  # a finite row still works


def _full_sort_filter(logits, top_p, temperature, mask=None):
    """The filter as a full stable sort of the vocabulary computes it (the reference for the head-only
    sorts of :func:`filtered_probs`)."""
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf)
    log_z = torch.logsumexp(logits.double(), 0)
    vals, ids = torch.sort(logits, descending=True, stable=True)
    p = torch.exp(vals.double() - log_z)
    keep = p.shape[0]
    if top_p < 1:
        cum = torch.cumsum(p, 0)
        keep = min(keep, int(torch.searchsorted(cum, torch.tensor([top_p], dtype=torch.float64))) + 1)
    keep = max(1, min(keep, int(torch.isfinite(vals).sum())))
    return ids[:keep], torch.softmax(vals[:keep].double() / temperature, -1)


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])  # flat, typical, peaked logits
@pytest.mark.parametrize("top_p", [0.0, 0.5, 0.9, 0.95, 0.999999])
def test_top_p_over_a_full_vocabulary_equals_a_full_sort(spread, top_p):
    """Top-p without top-k sorts only the head of a 262,144-token vocabulary (widened until it holds
    top-p of the mass); its ids and probabilities are a full stable sort's, bit for bit, with ties,
    a grammar mask and a temperature."""
    g = torch.Generator().manual_seed(int(spread * 10) + int(top_p * 100))
    logits = (torch.randn(262144, generator=g) * spread).round(decimals=1)  # rounding makes ties
    mask = torch.rand(262144, generator=g) > 0.1
    for m in (None, mask):
        params = SamplingParams(temperature=0.8, top_k=0, top_p=top_p, min_p=0)
        ids, probs = filtered_probs(logits, params, mask=m)
        want_ids, want_probs = _full_sort_filter(logits, top_p, 0.8, m)
        assert torch.equal(ids, want_ids) and torch.equal(probs, want_probs)


def test_no_filter_keeps_every_possible_token_with_its_probability():
    """With no filter that cuts, every token the mask allows comes back once, the head (within 8 of
    the best logit) sorted first, with softmax(logits / T) as its probability."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(262144, generator=g) * 4
    mask = torch.rand(262144, generator=g) > 0.3
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1, min_p=0)
    ids, probs = filtered_probs(logits, params, mask=mask)
    assert sorted(ids.tolist()) == torch.nonzero(mask).view(-1).tolist()
    want = torch.softmax(logits.masked_fill(~mask, -math.inf).double() / 0.7, -1)[ids]
    torch.testing.assert_close(probs, want, rtol=1e-12, atol=1e-300)
    head = int((logits.masked_fill(~mask, -math.inf) >= logits[mask].max() - 8).sum())
    assert torch.equal(probs[:head], torch.sort(probs[:head], descending=True).values)


def test_draws_follow_a_distribution_with_a_long_tail():
    """Inverse-CDF draws over the head-sorted order (3,000 tokens 8.5 below the best, 29% of the mass,
    in id order after the head) still follow softmax(logits)."""
    from scipy.stats import chisquare

    logits = torch.cat([torch.full((1500,), -6.5), torch.tensor([2.0, 1.0, 0.0]), torch.full((1500,), -6.5)])
    s = Sampler(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, seed=7))
    n = 20000
    draws = torch.tensor([s.sample(logits) for _ in range(n)])
    counts = [int((draws == t).sum()) for t in (1500, 1501, 1502)]
    counts.append(n - sum(counts))
    p = torch.softmax(logits.double(), -1)
    expected = [float(p[t]) * n for t in (1500, 1501, 1502)]
    expected.append(n - sum(expected))
    assert chisquare(counts, expected).pvalue > 1e-3
