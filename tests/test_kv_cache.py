"""KV cache rollback: regenerating after a rollback gives identical logits, also after the
sliding window (512) has wrapped."""

import pytest
import torch


def _greedy(model, cache, first, n):
    toks, logits = [first], []
    for _ in range(n):
        out = model.forward(torch.tensor([toks[-1]]), cache)
        logits.append(out.logits[0])
        toks.append(int(out.logits[0].argmax()))
    return toks, logits


@pytest.mark.parametrize("prompt_len", [20, 600])
@pytest.mark.parametrize("k", [1, 5, 16])
def test_rollback_regenerates_identically(engine, prompt_len, k):
    model = engine.model
    ids = ([2] + list(range(1000, 1000 + prompt_len - 1)))[:prompt_len]
    cache = model.new_cache(1024)
    out = model.forward(torch.tensor(ids), cache)
    first = int(out.logits[0].argmax())
    toks, logits = _greedy(model, cache, first, 20)
    assert cache.length == prompt_len + 20
    cache.rollback(cache.length - k)
    toks2, logits2 = _greedy(model, cache, toks[20 - k], k)
    assert toks2 == toks[20 - k:]
    for a, b in zip(logits[20 - k:], logits2, strict=True):
        assert torch.equal(a, b)


def test_multi_token_step_then_rollback_matches_single_steps(engine):
    """A 5-token forward (a verify step) rolled back by 3 leaves the cache as 2 single steps would."""
    model = engine.model
    ids = [2] + list(range(2000, 2000 + 509))  # 510 tokens: the step crosses the 512 window edge
    a, b = model.new_cache(1024), model.new_cache(1024)
    model.forward(torch.tensor(ids), a)
    model.forward(torch.tensor(ids), b)
    step = [11, 12, 13, 14, 15]
    model.forward(torch.tensor(step), a, all_logits=True)
    a.rollback(len(ids) + 2)
    for t in step[:2]:
        model.forward(torch.tensor([t]), b)
    la = model.forward(torch.tensor([99]), a).logits[0]
    lb = model.forward(torch.tensor([99]), b).logits[0]
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-4)


def test_rollback_beyond_length_is_an_error(engine):
    cache = engine.model.new_cache(64, max_rollback=4)  # 64 < window: no ring, any rollback within length
    engine.model.forward(torch.tensor([2, 5, 6, 7, 8, 9, 10]), cache)
    with pytest.raises(ValueError, match="cannot roll back to 8: cache holds 7"):
        cache.rollback(8)
    cache.rollback(3)
    assert cache.length == 3


def test_ring_rollback_limit_after_the_wrap(engine):
    """A real ring (capacity 1024 > window 512 + max_rollback 4) run past its wrap: undoing 5 positions
    is refused and leaves the cache as it was; undoing 4 regenerates bit-identical logits."""
    model, k_max = engine.model, 4
    cache = model.new_cache(1024, max_rollback=k_max)
    assert cache.ring_rows == cache.window + k_max < cache.capacity
    ids = [2] + list(range(3000, 3000 + 599))  # 600 tokens: the 516-row ring has wrapped
    first = int(model.forward(torch.tensor(ids), cache).logits[0].argmax())
    toks, logits = _greedy(model, cache, first, 8)
    end = len(ids) + 8
    assert cache.length == end
    with pytest.raises(ValueError, match=f"cannot roll back {k_max + 1} positions"):
        cache.rollback(end - k_max - 1)
    assert cache.length == end
    cache.rollback(end - k_max)
    toks2, logits2 = _greedy(model, cache, toks[8 - k_max], k_max)
    assert toks2 == toks[8 - k_max:]
    for a, b in zip(logits[8 - k_max:], logits2, strict=True):
        assert torch.equal(a, b)


def test_context_overflow_is_an_error(engine):
    cache = engine.model.new_cache(8)
    with pytest.raises(ValueError, match="exceed the context"):
        engine.model.forward(torch.tensor(list(range(2, 12))), cache)



_LAZY_KV = """
import sys
from gemmaspec.loading.engine import load_engine

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

engine = load_engine(sys.argv[1], ctx_size=4096, device="cpu")
before = rss()
caches = [engine.model.new_cache(4096, 16) for _ in range(3)]  # 3 x 39.5 MiB
print((rss() - before) / 2**20)
"""


def test_an_unused_kv_cache_is_not_resident(model_path):
    """A KV cache costs memory only as positions fill it: three more -c 4096 caches of the default
    model (3 x 39.5 MiB) made after loading add less than 4 MiB to the RSS. (From ``calloc`` they
    took the heap's free chunks left by loading and zeroed them: 14 MiB resident before any token.)"""
    import os
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    env = dict(os.environ, GEMMASPEC_REGROUP="first-use")  # no background copies growing meanwhile
    res = subprocess.run([sys.executable, "-c", _LAZY_KV, str(model_path)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert float(res.stdout.split()[-1]) < 4, res.stdout
