"""Speculative decoding: lossless for greedy and sampling, stats, stops inside a round, rollback."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from gemmaspec.engine import Engine, RequestStats
from gemmaspec.errors import InputError
from gemmaspec.kv_cache import KVCache
from gemmaspec.models.base import ForwardOutput
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.drafters import Draft, NgramDrafter, check_same_vocabulary
from gemmaspec.speculative.verify import Verdict, verify_sampling

GREEDY = dict(temperature=0)

PROMPTS = {
    "code": "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n",
    "rewrite": "Repeat this list exactly:\n" + "".join(f"- item {i}: red apples and green pears\n" for i in range(8))
               + "\nRepeated list:\n",
    "json": 'Convert to JSON: name Alice, age 30, city Paris.\n{"name": "Alice", "age": 30, "city": "Paris"}\n'
            'Convert to JSON: name Bob, age 25, city Rome.\n',
    "story": "Once upon a time, a little fox lived near a river. One day,",
    "fact": "Water boils at 100 degrees Celsius at sea level because",
    "chat": None,
}


def _tokens(engine, ids, n, drafter=None, n_max=0, stats=None, **kw):
    params = SamplingParams(max_tokens=n, **(GREEDY | kw))
    return [t for ev in engine.generate(ids, params, drafter=drafter, n_max=n_max, stats=stats) for t in ev.tokens]


def _prompt_ids(engine, kind):
    if kind == "chat":
        return engine.tokenizer.encode_chat([{"role": "user", "content": "Name three primary colors."}])
    return engine.tokenizer.encode(PROMPTS[kind])


def _margin_at(engine, ids, plain, i):
    engine.cache.reset()
    logits = engine._prefill(ids + plain[:i]).logits[0]
    top2 = torch.topk(logits, 2).values
    return (top2[0] - top2[1]).item()


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_speculative_equals_plain(engine, kind):
    ids = _prompt_ids(engine, kind)
    plain = _tokens(engine, ids, 40)
    for n_max in (1, 2, 4):
        st = RequestStats()
        spec = _tokens(engine, ids, 40, NgramDrafter(), n_max, st)
        assert st.spec.drafted > 0, (kind, n_max)  # a drafter that never drafts proves nothing here
        first = next((i for i in range(min(len(plain), len(spec))) if plain[i] != spec[i]), None)
        if first is None:
            assert spec == plain, (kind, n_max)
            continue
        margin = _margin_at(engine, ids, plain, first)
        print(f"{kind} n_max={n_max}: first difference at {first}, top-2 margin {margin:.2e}")
        assert margin < 1e-3, (kind, n_max, first, margin)
    if kind == "rewrite":
        assert st.spec.accepted > 10  # the rewrite prompt is where n-gram drafts pay


class Oracle:
    """Proposes the target's own continuation (known in advance), or garbage."""

    name = "oracle"

    def __init__(self, prompt_len, future, garbage=False):
        self.p, self.future, self.garbage = prompt_len, future, garbage

    def propose(self, ctx, n_max):
        done = len(ctx.tokens) - self.p
        if self.garbage:
            return Draft([int(t) for t in np.random.default_rng(done).integers(1000, 200000, n_max)])
        return Draft(list(self.future[done:done + n_max]))

    def reset(self):
        pass


@pytest.mark.parametrize("n_max", [1, 3, 4])
def test_oracle_drafts_all_accepted(engine, n_max):
    ids = _prompt_ids(engine, "story")
    n = 1 + 6 * (n_max + 1)  # every round full
    plain = _tokens(engine, ids, n, ignore_eos=True)
    st = RequestStats()
    out = _tokens(engine, ids, n, Oracle(len(ids), plain), n_max, st, ignore_eos=True)
    assert out == plain
    assert st.spec.acceptance_rate == 1.0
    assert st.spec.mean_accepted_length == n_max + 1
    assert st.spec.accepted_per_pos == [6] * n_max


def test_garbage_drafts_rejected_and_output_unchanged(engine):
    ids = _prompt_ids(engine, "fact")
    plain = _tokens(engine, ids, 24)
    st = RequestStats()
    assert _tokens(engine, ids, 24, Oracle(len(ids), plain, garbage=True), 4, st) == plain
    assert st.spec.drafted > 20 and st.spec.acceptance_rate < 0.1


def test_n_max_zero_is_plain(engine):
    ids = _prompt_ids(engine, "rewrite")
    st = RequestStats()
    assert _tokens(engine, ids, 20, NgramDrafter(), 0, st) == _tokens(engine, ids, 20)
    assert st.spec.steps == 0 and st.spec.rounds == 19


def test_sliding_window_wrap_mid_round(engine):
    """A 505-520 token prompt plus 64 tokens with n-max 4: rounds straddle the 512 window edge."""
    text = "".join(f"Line {i % 7}: the cat sat on the mat and looked at the hat.\n" for i in range(30))
    ids = engine.tokenizer.encode(text)[:512]
    assert 505 <= len(ids) <= 520
    plain = _tokens(engine, ids, 64)
    st = RequestStats()
    spec = _tokens(engine, ids, 64, NgramDrafter(), 4, st)
    first = next((i for i in range(64) if plain[i] != spec[i]), None)
    if first is not None:
        margin = _margin_at(engine, ids, plain, first)
        assert margin < 1e-3, (first, margin)
    assert st.spec.accepted > 0


def test_adaptive_draft_length_is_lossless(engine):
    ids = _prompt_ids(engine, "rewrite")
    st = RequestStats()
    assert _tokens(engine, ids, 40, NgramDrafter(), "auto", st) == _tokens(engine, ids, 40)
    assert st.spec.drafted > 0


# ---- stops inside an accepted chunk, on a scripted target -----------------------------------------

class ScriptModel:
    """A target whose greedy choice at generated index i is script[i] (vocabulary of the real tokenizer)."""

    def __init__(self, prompt_len, script, vocab):
        self.p, self.script, self.vocab = prompt_len, script, vocab
        self.device = torch.device("cpu")
        self.forwards = 0

    def new_cache(self, capacity, max_rollback=16):
        return KVCache([], capacity, 1, 1, max_rollback)

    def forward(self, tokens, cache, all_logits=False):
        start, t = cache.length, tokens.shape[0]
        logits = torch.zeros(t, self.vocab)
        for j in range(t):
            i = start + j + 1 - self.p  # the generated index this position predicts
            logits[j, self.script[i] if i < len(self.script) else 0] = 1.0
        cache.advance(start, t)
        self.forwards += 1
        return ForwardOutput(logits if all_logits else logits[-1:], torch.zeros(t, 4))


def _script_engine(tokenizer, prompt, script):
    ids = tokenizer.encode(prompt)
    model = ScriptModel(len(ids), script, tokenizer.vocab_size)
    return Engine(model, tokenizer, ctx_size=256), ids, model


def test_eos_inside_chunk(tokenizer):
    words = tokenizer.encode(" one two three four five six", add_bos=False)
    script = words[:3] + [tokenizer.eos_id] + words[3:]
    eng, ids, _ = _script_engine(tokenizer, "Count:", script)
    st = RequestStats()
    # first token from prefill, then one round of 4 drafts: EOS is draft position 2 (0-based)
    text = "".join(ev.text for ev in eng.generate(ids, SamplingParams(temperature=0, max_tokens=50),
                                                    Oracle(len(ids), script), n_max=4, stats=st))
    assert text == tokenizer.decode(words[:3])
    assert st.generated_tokens == 3 and st.stop_reason == "eos"
    assert st.spec.accepted == 2  # words[1], words[2]; EOS and what follows are not counted
    assert eng.cache.length == len(ids) + 3 - 1  # prompt + kept tokens, minus the last (never fed)


def test_stop_string_split_across_tokens(tokenizer):
    words = tokenizer.encode(" alpha beta gamma delta epsilon zeta eta", add_bos=False)
    eng, ids, _ = _script_engine(tokenizer, "Greek:", words)
    stop = "ma del"  # spans " gamma" and " delta"
    st = RequestStats()
    text = "".join(ev.text for ev in eng.generate(ids, SamplingParams(temperature=0, max_tokens=50, stop=(stop,)),
                                                    Oracle(len(ids), words), n_max=4, stats=st))
    assert text == " alpha beta gam"
    assert st.stop_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 5, 7])
def test_max_tokens_exact(tokenizer, max_tokens):
    words = tokenizer.encode(" a b c d e f g h i j k l m n o p", add_bos=False)
    eng, ids, _ = _script_engine(tokenizer, "Letters:", words)
    st = RequestStats()
    toks = [t for ev in eng.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens),
                                     Oracle(len(ids), words), n_max=4, stats=st) for t in ev.tokens]
    assert toks == words[:max_tokens]
    assert st.generated_tokens == max_tokens and st.stop_reason == "length"


def test_streamed_deltas_keep_every_token(tokenizer):
    words = tokenizer.encode(" héllo wörld 😀 日本 語 done", add_bos=False)
    eng, ids, _ = _script_engine(tokenizer, "Say:", words)
    events = list(eng.generate(ids, SamplingParams(temperature=0, max_tokens=len(words)), Oracle(len(ids), words), n_max=4))
    assert "".join(e.text for e in events) == tokenizer.decode(words)
    assert [t for e in events for t in e.tokens] == words


# ---- sampling is lossless ------------------------------------------------------------------------

P = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05], dtype=torch.float64)
Q = torch.tensor([0.5, 0.02, 0.3, 0.02, 0.06, 0.1], dtype=torch.float64)  # far from P
IDS = torch.arange(6)


def _first_token_counts(n, one_hot):
    rng = np.random.default_rng(1234)
    uniform = rng.random

    def draw(ids, probs):
        p = probs.numpy() / probs.numpy().sum()
        return int(ids[rng.choice(len(p), p=p)])

    counts = np.zeros(6, np.int64)
    for _ in range(n):
        d = 2 if one_hot else int(rng.choice(6, p=Q.numpy()))
        v = verify_sampling(lambda i: (IDS, P), [d, 1], None if one_hot else [(IDS, Q), (IDS, Q)], uniform, draw)
        counts[d if v.n_accepted >= 1 else v.next_token] += 1
    return counts


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_preserves_target_distribution(one_hot):
    from scipy.stats import chisquare

    n = 30_000  # finds (p < 1e-3) a shift of ~1.3 points of probability in one category
    counts = _first_token_counts(n, one_hot)
    res = chisquare(counts, (P * n).numpy())
    assert res.pvalue > 1e-3, (counts, res.pvalue)


def _sampled(engine, ids, seed):
    st = RequestStats()
    params = SamplingParams(temperature=0.7, seed=seed, max_tokens=30)
    evs = list(engine.generate(ids, params, NgramDrafter(), n_max=3, stats=st))
    return "".join(ev.text for ev in evs), [t for ev in evs for t in ev.tokens], st


def test_sampled_speculation_is_reproducible_per_seed(engine):
    """Same seed, same text and tokens; some other seed gives another text (so the seed is used).
    That the draws follow the target's distribution is the chi-square test's job above."""
    ids = _prompt_ids(engine, "rewrite")
    text, toks, st = _sampled(engine, ids, 3)
    assert len(toks) == 30 and st.spec.drafted > 0
    again, toks2, _ = _sampled(engine, ids, 3)
    assert (again, toks2) == (text, toks)
    assert any(_sampled(engine, ids, seed)[0] != text for seed in (4, 5, 6))


# ---- pairing and parameters ------------------------------------------------------------------------

def test_incompatible_draft_vocabulary_refused(tokenizer):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from gemmaspec.tokenizer import GemmaTokenizer

    other = GemmaTokenizer(Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1, "<bos>": 2, "a": 3}, unk_token="<pad>")),
                           2, 1, True, None)
    with pytest.raises(InputError, match="vocabulary has 4 tokens"):
        check_same_vocabulary(tokenizer, other)
    check_same_vocabulary(tokenizer, tokenizer)


def test_bad_draft_length(engine):
    with pytest.raises(InputError, match="draft length"):
        list(engine.generate([2, 100], SamplingParams(max_tokens=2), NgramDrafter(), n_max=16))


def test_verdict_says_recovered_or_bonus():
    """The target's own token ends every round: it replaces the first rejected draft (recovered) or,
    when all drafts were accepted, comes on top (bonus)."""
    from gemmaspec.speculative.verify import verify_greedy

    assert verify_greedy([5, 6, 7], [5, 9]) == Verdict(1, 6, "recovered")
    assert verify_greedy([5, 6, 7], [5, 6]) == Verdict(2, 7, "bonus")
    assert verify_greedy([4], []) == Verdict(0, 4, "bonus")
    always = lambda: 0.0  # noqa: E731  (a uniform draw of 0 accepts any draft with p > 0)
    never = lambda: 1.0  # noqa: E731
    draw = lambda ids, probs: int(ids[int(probs.argmax())])  # noqa: E731
    assert verify_sampling(lambda i: (IDS, P), [2, 1], None, always, draw).kind == "bonus"
    v = verify_sampling(lambda i: (IDS, P), [2, 1], None, never, draw)
    assert (v.n_accepted, v.kind) == (0, "recovered") and v.next_token != 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True),
       st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True), st.integers(0, 2**31 - 1))
def test_residual_aligns_q_onto_p_by_token(p_ids, q_ids, seed):
    """norm(max(p - q, 0)) over p's support, q looked up by token id (ids in any order, q's tokens
    outside p's support ignored): the element-wise definition, written out here."""
    from gemmaspec.speculative.verify import residual

    g = torch.Generator().manual_seed(seed)
    pp = torch.rand(len(p_ids), generator=g, dtype=torch.float64)
    qp = torch.rand(len(q_ids), generator=g, dtype=torch.float64)
    p = (torch.tensor(p_ids), pp / pp.sum())
    q = (torch.tensor(q_ids), qp / qp.sum())
    qd = dict(zip(q_ids, q[1].tolist()))
    r = torch.tensor([max(a - qd.get(t, 0.0), 0.0) for t, a in zip(p_ids, p[1].tolist())], dtype=torch.float64)
    ids, probs = residual(p, q)
    assert torch.equal(ids, p[0])
    if float(r.sum()) > 0:
        torch.testing.assert_close(probs, r / r.sum(), rtol=1e-12, atol=1e-15)
    else:
        assert torch.equal(probs, p[1])
