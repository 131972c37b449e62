"""A Gemma 4 decode or verify step's layers in one C call (``models/decode_step4.py``,
``kernels/layers4.h``) give the per-op path's bits (``Gemma4Model._layer``): logits, hidden states and
the KV cache, on tiny random models with every feature (per-layer inputs, KV sharing, attention_k_eq_v
with fewer global KV heads, double-wide MLPs, layer output scales) and without them, in Q4_0, Q8_0 and
mixed weights, both activation modes, 1 and 2 kernel threads, 1- to 16-row steps, through the sliding
window's ring before and after it wraps; the call declines what it cannot run; and greedy draft-mtp
generation on a tiny target/assistant pair equals plain generation."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from gemmaspec import kernels
from gemmaspec.kernels import StoredWeight
from gemmaspec.models import decode_step4, gemma4
from gemmaspec.models.config import Gemma4Config
from gemmaspec.models.footprint import tensor_shapes

BASE = dict(vocab_size=300, hidden_size=64, num_layers=7, intermediate_size=96, num_heads=4, num_kv_heads=2,
            head_dim=16, global_head_dim=32, sliding_window=8,
            layer_types=("sliding", "sliding", "full", "sliding", "full", "sliding", "full"))
CONFIGS = {
    # shared layers 4-6 read layers 2 (full, k_eq_v, 1 KV head) and 3 (sliding); layers 4-6 MLPs double-wide
    "every_feature": dict(hidden_size_per_layer_input=32, vocab_size_per_layer_input=300, num_kv_shared_layers=3,
                          use_double_wide_mlp=True, attention_k_eq_v=True, num_global_kv_heads=1),
    "plain": dict(),  # no per-layer inputs, no sharing, q|k|v everywhere, no output scales
}

pytestmark = pytest.mark.skipif(kernels.load_library() is None, reason="no C compiler: no C step")


def _weights(cfg: Gemma4Config, fmt: str, seed: int = 0) -> dict:
    """Random weights for every tensor of ``cfg``: norms and scales around 1, matrices ~ 1/sqrt(K) as
    float32 (``f32``), Q4_0, Q8_0 or both by turns (``mixed``: fused products join the two formats)."""
    rng = np.random.default_rng(seed)
    out, turn = {}, 0
    for name, shape in sorted(tensor_shapes(cfg).items()):
        if len(shape) != 2 or "norm" in name:
            out[name] = torch.from_numpy((1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32))
            continue
        a = (rng.standard_normal(shape) * (0.7 / shape[1] ** 0.5)).astype(np.float32)
        if fmt == "f32" or shape[1] % 32:
            out[name] = torch.from_numpy(a)
            continue
        qtype = {"q4_0": T.Q4_0, "q8_0": T.Q8_0}.get(fmt) or (T.Q4_0, T.Q8_0)[turn % 2]
        turn += 1
        out[name] = StoredWeight(torch.from_numpy(gguf.quants.quantize(a, qtype)), qtype.name, shape[1])
    return out


def _model(kind: str, fmt: str, **over) -> gemma4.Gemma4Model:
    cfg = Gemma4Config(**(BASE | CONFIGS[kind] | over))
    w = _weights(cfg, fmt)
    if kind == "plain":
        w = {k: v for k, v in w.items() if "layer_output_scale" not in k}
    return gemma4.Gemma4Model(cfg, w)


def _forward(model, cache, tokens, fast: bool, monkeypatch):
    """model.forward through the one-call step (``fast``, spied: [whether it ran]) or the per-op path."""
    calls = []

    def spy(*a):
        got = decode_step4.run_layers4(*a)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(gemma4, "run_layers4", spy if fast else (lambda *a: None))
    out = model.forward(torch.tensor(tokens), cache, all_logits=True)
    monkeypatch.undo()
    return out, calls


def _same_steps(model, caches, steps, monkeypatch, small=kernels.SMALL_M):
    ids = torch.randint(3, 300, (sum(steps),), generator=torch.Generator().manual_seed(5)).tolist()
    at, used = 0, []
    for n in steps:
        a, calls = _forward(model, caches[0], ids[at:at + n], True, monkeypatch)
        b, _ = _forward(model, caches[1], ids[at:at + n], False, monkeypatch)
        at += n
        assert calls == [n <= small], (n, calls)
        used.append(calls[0])
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden), (n, at)
        assert float(a.logits.abs().max()) > 1e-3
    assert caches[0].length == caches[1].length == at
    for la, lb in zip(caches[0].layers, caches[1].layers):
        assert (la is None) == (lb is None)
        if la is not None:
            assert torch.equal(la.k, lb.k) and torch.equal(la.v, lb.v)
    return used


# a 5-row prefill, decode rows, 4-row verifies, a per-op 20-row chunk, a 16-row step: the 24-row ring of
# the 8-token window wraps three times
STEPS = [5, 1, 4, 1, 1, 4, 20, 1, 16, 4, 1, 3, 1, 4, 1]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("act", ["none", "q8_0"])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "mixed"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_one_call_step_equals_the_per_op_step(kind, fmt, act, threads, monkeypatch):
    model = _model(kind, fmt)
    before, t_before = kernels.act_quant(), torch.get_num_threads()
    kernels.set_act_quant(act)
    torch.set_num_threads(threads)
    try:
        caches = [model.new_cache(128), model.new_cache(128)]
        assert caches[0].ring_rows == 24
        _same_steps(model, caches, STEPS, monkeypatch)
    finally:
        kernels.set_act_quant(before)
        torch.set_num_threads(t_before)


def test_without_a_ring_and_with_gathered_keys(monkeypatch):
    """Sliding layers that keep every position (prefix reads under a window mask), and a ring so short
    that a 4-row step gathers its keys: the call declines that step and runs the others."""
    model = _model("every_feature", "mixed")
    _same_steps(model, [model.new_cache(96, ring=False), model.new_cache(96, ring=False)], STEPS, monkeypatch)
    caches = [model.new_cache(96, max_rollback=2), model.new_cache(96, max_rollback=2)]  # 10-row ring
    used = _same_steps(model, caches, [1] * 12 + [4, 1, 2, 1], monkeypatch, small=3)
    assert used == [True] * 12 + [False, True, True, True]


def test_declines_what_it_cannot_run(monkeypatch):
    """float32 matrices (no kernel format), more than SMALL_M rows, autograd and mixture-of-experts
    models leave the step to the per-op path."""
    dense = _model("every_feature", "f32")
    _, calls = _forward(dense, dense.new_cache(32), [5, 6], True, monkeypatch)
    assert calls == [False]
    q = _model("every_feature", "q8_0")
    cache = q.new_cache(64)
    run = decode_step4.run_layers4

    def args(t):
        plans = {"sliding": cache.plan(0, t, 8), "full": cache.plan(0, t, None)}
        return torch.zeros(t, 64), torch.zeros(t, 7, 32), cache, 0, plans, gemma4.rope_rows(q.config, 0, t)

    with torch.no_grad():
        assert run(q, *args(kernels.SMALL_M)) is not None
        assert run(q, *args(kernels.SMALL_M + 1)) is None
        x, ple, *rest = args(2)
        assert run(q, x, ple[:, :6], *rest) is None  # the per-layer inputs' shape
        moe = _model("plain", "q8_0", enable_moe_block=True, num_experts=2, top_k_experts=1, moe_intermediate_size=32)
        assert run(moe, x, None, moe.new_cache(64), *rest[1:]) is None
    with torch.enable_grad():
        assert run(q, *args(2)) is None


def test_gelu_times_a_strided_vector():
    """gelu_mul_by (gs_gelu_mul2, the per-layer input's gate) is gelu_mul's arithmetic on [g | u], bit
    for bit, with u a column of [T, layers, dim] per-layer inputs, and PyTorch's gelu_tanh(g) * u to
    float rounding."""
    from gemmaspec.models.base import gelu_mul, gelu_mul_by

    gen = torch.Generator().manual_seed(3)
    g, ple = 3 * torch.randn(5, 32, generator=gen), torch.randn(5, 7, 32, generator=gen)
    u = ple[:, 4]
    got = gelu_mul_by(g, u)
    assert torch.equal(got, gelu_mul(torch.cat([g, u], dim=-1)))
    want = torch.nn.functional.gelu(g.double(), approximate="tanh") * u.double()
    assert float((got.double() - want).abs().max()) <= 1e-6 * float(want.abs().max())


@pytest.mark.parametrize("n_max", [1, 3])
def test_greedy_draft_mtp_equals_plain(tmp_path, monkeypatch, n_max):
    """A tiny E2B-like target (per-layer inputs, KV sharing, double-wide MLP; Q8_0 matrices) with a
    random MTP assistant: greedy draft-mtp generation gives plain generation's tokens, with the target's
    decode and verify steps in the one-call path, and plain generation is the per-op path's."""
    from test_mtp import _tokenizer
    from tiny_gemma4 import tiny_assistant

    from gemmaspec.engine import Engine, RequestStats
    from gemmaspec.loading import load_checkpoint
    from gemmaspec.sampling import SamplingParams
    from gemmaspec.speculative.drafters import MTPDrafter

    tiny_assistant().save_pretrained(tmp_path / "a")
    assistant = load_checkpoint(tmp_path / "a").model
    target = _model("every_feature", "q8_0", attention_k_eq_v=False, num_global_kv_heads=None)
    rows = []
    real = decode_step4.run_layers4

    def spy(model, x, *a):
        got = real(model, x, *a)
        rows.append((x.shape[0], got is not None))
        return got

    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = Engine(target, _tokenizer(), ctx_size=128)
    monkeypatch.setattr(gemma4, "run_layers4", lambda *a: None)
    per_op = [t for ev in engine.generate(ids, params) for t in ev.tokens]
    monkeypatch.setattr(gemma4, "run_layers4", spy)
    plain = [t for ev in engine.generate(ids, params) for t in ev.tokens]
    st = RequestStats()
    drafter = MTPDrafter(assistant, target, engine.cache)
    spec = [t for ev in engine.generate(ids, params, drafter, n_max=n_max, stats=st) for t in ev.tokens]
    assert spec == plain == per_op
    assert len(set(plain)) > 3 and st.spec.drafted > 0
    assert all(ran for _, ran in rows) and {1, n_max + 1} <= {n for n, _ in rows}
