"""The Gemma 4 MTP assistant drafter against transformers' reference, on tiny random checkpoints."""


import pytest
import torch

from gemmaspec.engine import Engine, RequestStats
from gemmaspec.errors import InputError
from gemmaspec.loading import load_checkpoint
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.drafters import DraftContext, MTPDrafter, check_mtp_pair

pytestmark = pytest.mark.reference

from tiny_gemma4 import ASSISTANT_TEXT, TARGET, VOCAB, WINDOW, randomize as _randomize, tiny_assistant


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ref target, ref assistant, ref clustered assistant, our target, our assistant, our clustered)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    root = tmp_path_factory.mktemp("mtp")
    target = Gemma4ForCausalLM(Gemma4TextConfig(**TARGET)).eval()
    _randomize(target, 1)
    target.save_pretrained(root / "target")
    out = [target]
    for clustered in (False, True):
        asst = tiny_assistant(clustered)
        d = root / f"assistant_{clustered}"
        asst.save_pretrained(d)
        out.append(asst)
    ours = load_checkpoint(root / "target").model
    out += [ours, load_checkpoint(root / "assistant_False").model, load_checkpoint(root / "assistant_True").model]
    return out


def _ref_drafts(ref_target, ref_asst, ids, k):
    with torch.no_grad():
        out = ref_target(torch.tensor([ids]), output_hidden_states=True, return_shared_kv_states=True)
        p = len(ids)
        pending = int(out.logits[0, -1].argmax())
        kv = out.shared_kv_states
        shared = {"full_attention": (kv["full_attention"][0][:, :, :p], kv["full_attention"][1][:, :, :p]),
                  "sliding_attention": tuple(t[:, :, max(0, p - WINDOW + 1):p] for t in kv["sliding_attention"])}
        h = out.hidden_states[-1][:, -1:]
        tok = torch.tensor([[pending]])
        drafts = []
        for _ in range(k):
            emb = ref_target.get_input_embeddings()(tok)
            o = ref_asst(inputs_embeds=torch.cat([emb, h], -1), position_ids=torch.tensor([[p]]),
                         shared_kv_states=shared)
            tok = o.logits.argmax(-1)
            h = o.last_hidden_state
            drafts.append(int(tok))
    return pending, drafts


@pytest.mark.parametrize("clustered", [False, True])
@pytest.mark.parametrize("prompt_len", [10, 40])  # 40 crosses the 16-token window
def test_drafts_equal_reference(pair, clustered, prompt_len):
    ref_t, ref_a, ref_ac, ours_t, ours_a, ours_ac = pair
    ids = torch.randint(3, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    cache = ours_t.new_cache(128)
    out = ours_t.forward(torch.tensor(ids), cache)
    pending = int(out.logits[0].argmax())
    drafter = MTPDrafter(ours_ac if clustered else ours_a, ours_t, cache)
    for k in (1, 2, 3, 4):
        want_pending, want = _ref_drafts(ref_t, ref_ac if clustered else ref_a, ids, k)
        assert pending == want_pending
        got = drafter.propose(DraftContext(ids + [pending], out.hidden[-1]), k).tokens
        assert got == want, (k, got, want)


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from gemmaspec.tokenizer import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    return GemmaTokenizer(Tokenizer(WordLevel(vocab, unk_token="<pad>")), 2, 1, True, None)


@pytest.mark.parametrize("prompt_len", [8, 30])
def test_greedy_draft_mtp_equals_plain_and_reference(pair, prompt_len):
    ref_t, ref_a, _, ours_t, ours_a, _ = pair
    ids = torch.randint(3, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(7)).tolist()
    engine = Engine(ours_t, _tokenizer(), ctx_size=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [t for ev in engine.generate(ids, params) for t in ev.tokens]
    st = RequestStats()
    drafter = MTPDrafter(ours_a, ours_t, engine.cache)
    spec = [t for ev in engine.generate(ids, params, drafter, n_max=2, stats=st) for t in ev.tokens]
    assert spec == plain
    assert st.spec.drafted > 0
    with torch.no_grad():
        ref = ref_t.generate(torch.tensor([ids]), assistant_model=ref_a, max_new_tokens=24, min_new_tokens=24,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, prompt_len:].tolist()
    assert spec == ref


def test_no_hidden_state_no_draft(pair):
    _, _, _, ours_t, ours_a, _ = pair
    drafter = MTPDrafter(ours_a, ours_t, ours_t.new_cache(32))
    assert drafter.propose(DraftContext([2, 5], None), 3).tokens == []


def test_mismatched_pair_refused(pair, tmp_path):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    _, _, _, ours_t, _, _ = pair
    cfg = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**ASSISTANT_TEXT), backbone_hidden_size=48)
    Gemma4AssistantForCausalLM(cfg).save_pretrained(tmp_path / "wrong")
    with pytest.raises(InputError, match="width 48"):
        check_mtp_pair(ours_t, load_checkpoint(tmp_path / "wrong").model)


def test_truncated_assistant_is_a_clear_error(pair, tmp_path):
    from gemmaspec.errors import ModelFileError

    _, ref_a, _, _, _, _ = pair
    ref_a.save_pretrained(tmp_path / "a")
    f = tmp_path / "a" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ModelFileError, match="not a readable safetensors"):
        load_checkpoint(tmp_path / "a").model


def test_roles_are_checked(pair, tmp_path):
    """A target given where an assistant is wanted (or the reverse) is refused by role, naming the fix."""
    from gemmaspec.errors import InputError

    ref_t, ref_a, _, _, _, _ = pair
    ref_t.save_pretrained(tmp_path / "t")
    ref_a.save_pretrained(tmp_path / "a")
    with pytest.raises(InputError, match="is a target model .*not an assistant"):
        load_checkpoint(tmp_path / "t", role="assistant")
    with pytest.raises(InputError, match="is an assistant .*pass it as -md"):
        load_checkpoint(tmp_path / "a", role="target")
    assert load_checkpoint(tmp_path / "a", role="assistant").arch.role == "assistant"


def test_qat_mismatch_warning(pair):
    from gemmaspec.quant.qat import looks_qat
    from gemmaspec.speculative.plan import qat_mismatch_warning

    _, _, _, ours_t, ours_a, _ = pair
    assert not looks_qat(ours_t.weights["blk.0.attn_q.weight"])
    assert qat_mismatch_warning(ours_t, ours_a) is None
    # snap the assistant's weights to a 4-bit grid per 32-value block, as QAT checkpoints are
    w = ours_a.weights["blk.0.attn_q.weight"]
    blocks = w.reshape(-1, 32)
    step = blocks.abs().amax(1, keepdim=True) / 8
    snapped = (torch.clamp(torch.round(blocks / step), -8, 7) * step).reshape(w.shape)
    qat = dict(ours_a.weights)
    qat["blk.0.attn_q.weight"] = snapped
    from gemmaspec.models.gemma4_assistant import Gemma4Assistant

    qat_asst = Gemma4Assistant(ours_a.full_config, qat)
    assert looks_qat(snapped)
    msg = qat_mismatch_warning(ours_t, qat_asst)
    assert msg and "non-QAT" in msg and "QAT (4-bit grid)" in msg


def test_unified_assistant_loads_and_drafts_like_reference(pair, tmp_path):
    """Gemma4UnifiedAssistantForCausalLM (the 12B family's assistant class) is the same drafter."""
    from transformers import Gemma4UnifiedAssistantConfig, Gemma4UnifiedAssistantForCausalLM
    from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedTextConfig

    ref_t, _, _, ours_t, _, _ = pair
    text = {k: v for k, v in ASSISTANT_TEXT.items() if k not in ("hidden_size_per_layer_input", "vocab_size_per_layer_input")}
    cfg = Gemma4UnifiedAssistantConfig(text_config=Gemma4UnifiedTextConfig(**text), backbone_hidden_size=64)
    ref_a = Gemma4UnifiedAssistantForCausalLM(cfg).eval()
    _randomize(ref_a, 4)
    ref_a.save_pretrained(tmp_path / "u")
    ours_a = load_checkpoint(tmp_path / "u").model
    ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = ours_t.new_cache(64)
    out = ours_t.forward(torch.tensor(ids), cache)
    pending = int(out.logits[0].argmax())
    _, want = _ref_drafts(ref_t, ref_a, ids, 3)
    assert MTPDrafter(ours_a, ours_t, cache).propose(DraftContext(ids + [pending], out.hidden[-1]), 3).tokens == want


@pytest.mark.parametrize("kind", ["e2b_like", "k_eq_v", "moe"])
def test_assistant_on_every_target_family(kind, tmp_path):
    """Drafts equal the reference's and greedy draft-mtp output equals plain output, for targets with
    per-layer embeddings and KV sharing, with K as V on full layers, and with experts."""
    from test_gemma4 import _tiny

    ref_t, path = _tiny(kind, tmp_path)
    ours_t = load_checkpoint(path).model
    asst = tiny_assistant(seed=11)
    asst.save_pretrained(tmp_path / "a")
    ours_a = load_checkpoint(tmp_path / "a").model
    ids = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(12)).tolist()
    cache = ours_t.new_cache(128)
    out = ours_t.forward(torch.tensor(ids), cache)
    pending = int(out.logits[0].argmax())
    _, want = _ref_drafts(ref_t, asst, ids, 4)
    assert MTPDrafter(ours_a, ours_t, cache).propose(DraftContext(ids + [pending], out.hidden[-1]), 4).tokens == want
    engine = Engine(ours_t, _tokenizer(), ctx_size=128)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = [t for ev in engine.generate(ids, params) for t in ev.tokens]
    st = RequestStats()
    spec = [t for ev in engine.generate(ids, params, MTPDrafter(ours_a, ours_t, engine.cache), n_max=3, stats=st) for t in ev.tokens]
    assert spec == plain and len(spec) == 20
    assert st.spec.drafted > 0
