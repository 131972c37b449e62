"""The MTP assistant's draft step in one C call (models/assistant_step.py, kernels/assistant.h) gives
the bits of its per-op path, on the real default model and its shipped assistant, in both activation
modes, before and after the target's sliding window fills (keys masked by position)."""

import pytest
import torch

from gemmaspec import kernels
from gemmaspec.speculative.config import SpecConfig
from gemmaspec.speculative.plan import load_drafter
from gemmaspec.models import assistant_step
from gemmaspec.sampling import SamplingParams


@pytest.fixture(scope="module")
def mtp(engine):
    if kernels.load_library() is None:
        pytest.skip("no C kernel on this machine")
    return load_drafter(SpecConfig("draft-mtp", p_min=0.0), engine)  # p-min 0: every draft through draft_step


@pytest.mark.parametrize("act", ["none", "q8_0"])
def test_c_step_equals_the_per_op_step(engine, mtp, act, monkeypatch):
    a = mtp.assistant
    orig = a.draft_step
    seen = {"calls": 0, "masked": 0, "positions": set()}

    def spy(x_embed, h, position, kv, rope=None):
        rope = a.rope_at(position) if rope is None else rope
        got = assistant_step.run_step(a, x_embed, h, kv, rope, token=True)
        assert got is not None and got[2] is not None  # the C step applies, head included
        with monkeypatch.context() as m:
            m.setattr(assistant_step, "run_step", lambda *args, **kw: None)
            hidden, next_h = a.step_hidden(x_embed, h, position, kv, rope)  # the per-op path
        assert torch.equal(got[0], hidden) and torch.equal(got[1], next_h), position
        assert got[2][0] == a.draft_token(hidden) == int(a.logits(hidden).argmax())
        from gemmaspec.models.base import linear

        p_ref = float(torch.softmax(linear(a.head, hidden[None])[0].double(), -1).max())
        assert abs(got[2][1] - p_ref) < 1e-6 * max(1.0, p_ref), (got[2][1], p_ref)  # the draft's probability
        seen["calls"] += 1
        seen["masked"] += any(m is not None and not bool(m.all()) for _, _, m in kv.values())
        seen["positions"].add(position)
        return orig(x_embed, h, position, kv, rope)

    monkeypatch.setattr(a, "draft_step", spy)
    kernels.set_act_quant(act)
    try:
        words = " ".join(f"item{i}" for i in range(260))  # ~600 tokens: past the 512-token sliding window
        for prompt in ("def add(a, b):\n    return", "List: " + words):
            ids = engine.tokenizer.encode(prompt)
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            plain = [t for ev in engine.generate(ids, params) for t in ev.tokens]
            spec = [t for ev in engine.generate(ids, params, mtp, n_max=3) for t in ev.tokens]
            assert spec == plain
    finally:
        kernels.set_act_quant("none")
    assert seen["calls"] >= 6 and seen["masked"] >= 1 and max(seen["positions"]) > 512


def test_run_step_declines_what_it_cannot_read(engine, mtp):
    a = mtp.assistant
    p = 5
    kv = {kind: (k.transpose(0, 1).contiguous().transpose(0, 1), v, m) for kind, (k, v, m) in mtp.target_kv(p).items()}
    x = torch.zeros(a.backbone_hidden_size)
    assert assistant_step.run_step(a, x, x, kv, a.rope_at(p)) is None  # keys not contiguous
    with torch.enable_grad():
        assert assistant_step.run_step(a, x.requires_grad_(), x, mtp.target_kv(p), a.rope_at(p)) is None
    # keys with another KV-head count than the assistant's config (a target whose full layers have
    # num_global_kv_heads): the C step takes one count for every layer, so it declines
    kv = {kind: (torch.cat([k, k], 1), torch.cat([v, v], 1), m) for kind, (k, v, m) in mtp.target_kv(p).items()}
    assert assistant_step.run_step(a, x, x, kv, a.rope_at(p)) is None


def test_auto_drafts_with_int8_activations(engine, mtp):
    """Under ``auto`` the assistant's C step multiplies int8 activations whatever the target's mode (its
    products are bound by arithmetic: weights in cache): the bits of an explicit ``q8_0`` step, not
    those of fp32; an explicit mode applies to it too; output stays the plain output."""
    a = mtp.assistant
    g = torch.Generator().manual_seed(0)
    x, h = torch.randn(a.backbone_hidden_size, generator=g), torch.randn(a.backbone_hidden_size, generator=g)
    steps = {}
    try:
        kernels.set_act_quant("auto")
        ids = engine.tokenizer.encode("The three primary colours are")
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        plain = [t for ev in engine.generate(ids, params) for t in ev.tokens]
        assert [t for ev in engine.generate(ids, params, mtp, n_max=3) for t in ev.tokens] == plain
        p = 9  # a position of the cache just filled
        kv, rope = mtp.target_kv(p), a.rope_at(p)
        for mode in ("q8_0", "none", "auto"):
            kernels.set_act_quant(mode)
            assert kernels.draft_act_quant() == ("q8_0" if mode == "auto" else mode)
            with torch.inference_mode():
                steps[mode] = assistant_step.run_step(a, x, h, kv, rope, token=True)
        assert torch.equal(steps["auto"][0], steps["q8_0"][0]) and torch.equal(steps["auto"][1], steps["q8_0"][1])
        assert not torch.equal(steps["auto"][0], steps["none"][0])
    finally:
        kernels.set_act_quant("none")
