"""Drafter training (``gemmaspec train-drafter``) on a tiny random Gemma 3 target saved in the real
Hugging Face layout: the loss falls, the exported GGUF loads as a ``draft-mtp`` drafter that drafts what
the trained module computes, greedy output with it equals plain output, and a resumed run continues
with the losses of the uninterrupted one."""

import pytest
import torch

from gemmaspec.engine import Engine, RequestStats
from gemmaspec.loading import load_checkpoint
from gemmaspec.sampling import SamplingParams
from gemmaspec.speculative.drafters import DraftContext, MTPDrafter, check_mtp_pair
from gemmaspec.loading.assistant_gguf import export_gguf
from gemmaspec.training.teacher import Chunk, build_chunks
from gemmaspec.training.train import TrainSettings, train

VOCAB = 300
CFG = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=7, intermediate_size=96, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
           max_position_embeddings=256)
SETTINGS = dict(width=32, layers=2, heads=4, ffn=64, draft_vocab=96, draft_steps=3, lr=3e-3, warmup=4,
                ckpt_every=1000, eval_every=10)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(7)
    ref = Gemma3ForCausalLM(Gemma3TextConfig(**CFG)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.15))
    d = tmp_path_factory.mktemp("g3")
    ref.save_pretrained(d)
    return load_checkpoint(d).model


@pytest.fixture(scope="module")
def chunks(target, tmp_path_factory):
    """Teacher chunks of the target's own greedy text (what a drafter must predict)."""
    seqs = []
    for s in range(6):
        ids = torch.randint(3, VOCAB, (4,), generator=torch.Generator().manual_seed(s)).tolist()
        cache = target.new_cache(64)
        out = target.forward(torch.tensor(ids), cache)
        for _ in range(44):
            ids.append(int(out.logits[-1].argmax()))
            out = target.forward(torch.tensor(ids[-1:]), cache)
        seqs.append(ids)
    return build_chunks(target, seqs, tmp_path_factory.mktemp("chunks"), length=48)


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from gemmaspec.tokenizer import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    return GemmaTokenizer(Tokenizer(WordLevel(vocab, unk_token="<pad>")), 2, 1, True, None)


def test_chunks_hold_the_targets_signals(target, chunks):
    c = Chunk.load(chunks[0])
    assert c.tokens.shape == (48,) and c.hidden.shape == (48, 64)
    assert set(c.kv) == {"sliding", "full"} and c.kv["full"][0].shape == (48, 2, 16)
    out = target.forward(c.tokens, target.new_cache(64), all_logits=True)
    assert torch.equal(c.top_ids[:, 0].long(), out.logits.argmax(-1))  # position i predicts token i+1
    assert torch.allclose(c.hidden.float(), out.hidden, atol=2e-2, rtol=1e-2)  # float16 storage


def test_training_lowers_the_loss_and_the_export_drafts_losslessly(target, chunks, tmp_path):
    model, hist = train(target, chunks, tmp_path / "run", TrainSettings(steps=40, **SETTINGS), progress=False)
    losses = [h["loss"] for h in hist]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    out = tmp_path / "a.gguf"
    export_gguf(model.config, model.gguf_weights(), out, "f32")
    assistant = load_checkpoint(out, role="assistant").model
    check_mtp_pair(target, assistant)  # same width, vocabulary (through the map), head dims
    # the loaded assistant drafts exactly what the trained module computes
    ids = Chunk.load(chunks[1]).tokens[:20].tolist()
    cache = target.new_cache(64)
    fwd = target.forward(torch.tensor(ids[:-1]), cache)
    drafter = MTPDrafter(assistant, target, cache)
    got = drafter.propose(DraftContext(ids, fwd.hidden[-1]), 3).tokens
    x, h, want = target.embed_row(ids[-1])[None], fwd.hidden[-1][None], []
    p = len(ids) - 1
    kv = {kind: (k, v, torch.ones(1, k.shape[0], dtype=torch.bool) if m is None else m)
          for kind, (k, v, m) in drafter.target_kv(p).items()}  # what the runtime reads (a ring for sliding)
    with torch.no_grad():
        for _ in range(3):
            logits, h = model.step(x, h, torch.tensor([p]), kv)
            tok = int(model.token_map[logits[0].argmax()])
            want.append(tok)
            x = target.embed_row(tok)[None]
    assert got == want
    # greedy output with the drafter equals plain greedy output
    engine = Engine(target, _tokenizer(), ctx_size=128)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = Chunk.load(chunks[2]).tokens[:6].tolist()
    plain = [t for ev in engine.generate(prompt, params) for t in ev.tokens]
    st = RequestStats()
    spec = [t for ev in engine.generate(prompt, params, MTPDrafter(assistant, target, engine.cache), n_max=3, stats=st)
            for t in ev.tokens]
    assert spec == plain
    assert st.spec.drafted > 0 and st.spec.accepted > 0  # trained on this target's text: it does accept


def test_resume_continues_with_the_same_losses(target, chunks, tmp_path):
    s = TrainSettings(steps=12, **SETTINGS)
    _, full = train(target, chunks, tmp_path / "a", s, progress=False)
    train(target, chunks, tmp_path / "b", s, progress=False, stop_after=5, log=lambda *a: None)
    _, resumed = train(target, chunks, tmp_path / "b", s, resume=True, progress=False)
    assert [h["step"] for h in resumed] == list(range(1, 13))
    for a, b in zip(full[5:], resumed[5:]):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * max(1.0, abs(a["loss"])), (a, b)


def test_a_reduced_head_map_outside_the_vocabulary_is_refused(target, chunks, tmp_path):
    from gemmaspec.errors import ModelFileError

    model, _ = train(target, chunks, tmp_path / "r", TrainSettings(steps=1, **SETTINGS), progress=False)
    w = model.gguf_weights()
    w["draft_token_map"] = w["draft_token_map"].clone()
    w["draft_token_map"][0] = VOCAB + 5
    export_gguf(model.config, w, tmp_path / "bad.gguf", "f32")
    with pytest.raises(ModelFileError, match="outside the target vocabulary"):
        load_checkpoint(tmp_path / "bad.gguf", role="assistant")


def test_qat_q4_0_run_exports_exact_q4_0(target, chunks, tmp_path):
    """``--qat q4_0``: every exported matrix lies on the Q4_0 grid, the Q4_0 GGUF holds the trained values
    bit for bit (the export checks it), and it drafts as the module does."""
    from gemmaspec.training.qat import q4_0_grid_report

    s = TrainSettings(steps=4, qat="q4_0", **SETTINGS)
    model, _ = train(target, chunks, tmp_path / "q", s, progress=False)
    w = model.gguf_weights()
    mats = {k: v for k, v in w.items() if v.dim() == 2}
    assert mats and all(q4_0_grid_report(v) == 1.0 for v in mats.values())
    res = export_gguf(model.config, w, tmp_path / "q.gguf", "q4_0")
    assert res["types"].get("Q4_0") == len(mats)
    loaded = load_checkpoint(tmp_path / "q.gguf", role="assistant").model
    for name, v in mats.items():
        assert torch.equal(loaded.weights[name].dequantize(), v), name


def test_q4_0_export_of_off_grid_weights_is_refused(target, chunks, tmp_path):
    from gemmaspec.errors import InputError

    model, _ = train(target, chunks, tmp_path / "f", TrainSettings(steps=1, **SETTINGS), progress=False)
    with pytest.raises(InputError, match="not on the Q4_0 grid"):
        export_gguf(model.config, model.gguf_weights(), tmp_path / "f.gguf", "q4_0")


def test_self_generation_records_the_teacher_signals_and_resumes(target, tmp_path):
    """Chunks written while generating hold what a separate teacher forward over the same tokens gives;
    greedy ones are the target's greedy continuation; a second call rewrites nothing."""
    from tokenizers.pre_tokenizers import Whitespace

    from gemmaspec.training.selfgen import generate_chunks
    from gemmaspec.training.teacher import teacher_chunk

    tok = _tokenizer()
    tok.backend.pre_tokenizer = Whitespace()
    prompts = [{"kind": "t", "text": f"w{5 + i} w{40 + 3 * i} w{90 + i}", "chat": False} for i in range(5)]
    paths = generate_chunks(target, tok, prompts, tmp_path, length=40, batch=3, sample_frac=0.4, seed=1)
    assert len(paths) == 5
    for p in paths:
        c = Chunk.load(p)
        ref = teacher_chunk(target, c.tokens.tolist())
        assert torch.equal(c.top_ids[:, 0], ref.top_ids[:, 0])
        assert torch.allclose(c.hidden.float(), ref.hidden.float(), atol=2e-2, rtol=1e-2)
        for kind in ref.kv:
            assert torch.allclose(c.kv[kind][0].float(), ref.kv[kind][0].float(), atol=2e-2, rtol=1e-2)
            assert torch.allclose(c.kv[kind][1].float(), ref.kv[kind][1].float(), atol=2e-2, rtol=1e-2)
        assert torch.allclose(c.top_logp.float(), ref.top_logp.float(), atol=2e-2)
    greedy = [Chunk.load(p) for p in paths]
    n_greedy = sum(bool(torch.equal(c.tokens[4:], c.top_ids[3:-1, 0].long())) for c in greedy)
    assert 1 <= n_greedy < 5  # sample_frac 0.4 of 5 with this seed: some sampled, some greedy
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert generate_chunks(target, tok, prompts, tmp_path, length=40, batch=3, sample_frac=0.4, seed=1) == paths
    assert [p.stat().st_mtime_ns for p in paths] == stamps
    with pytest.raises(ValueError, match="held-out"):
        generate_chunks(target, tok, prompts, tmp_path / "x", length=40, held=["w5 w40 w90 and more"])


def test_generated_prompts_avoid_held_out_and_are_prefix_stable():
    from gemmaspec.training.selfgen import generated_prompts

    a = generated_prompts(300, seed=3)
    assert generated_prompts(120, seed=3) == a[:120]
    assert len({p["kind"] for p in a}) >= 10 and any(p["chat"] for p in a) and not all(p["chat"] for p in a)
    held = [a[0]["text"] + " extra words", a[1]["text"][5:40]]
    b = generated_prompts(300, seed=3, held=held)
    assert all(p["text"] not in (a[0]["text"], a[1]["text"]) for p in b)


def test_init_starts_from_another_runs_weights(target, chunks, tmp_path):
    s = TrainSettings(steps=6, **SETTINGS)
    first, _ = train(target, chunks, tmp_path / "a", s, progress=False)
    other = TrainSettings(steps=6, **(SETTINGS | {"width": 48}))  # architecture comes from the checkpoint
    second, hist = train(target, chunks, tmp_path / "b", other, progress=False, stop_after=0,
                         init=tmp_path / "a" / "ckpt.pt", log=lambda *a: None)
    assert hist == []
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in first.state_dict().items())
    # a larger draft vocabulary: the shared tokens' head rows and every other weight carry over
    wider = TrainSettings(steps=6, **(SETTINGS | {"draft_vocab": 130}))
    third, _ = train(target, chunks, tmp_path / "c", wider, progress=False, stop_after=0,
                     init=tmp_path / "a" / "ckpt.pt", log=lambda *a: None)
    assert third.token_map.numel() == 130 and set(first.token_map.tolist()) < set(third.token_map.tolist())
    head = "params.token_embd__weight"
    for k, v in first.state_dict().items():
        if k not in (head, "token_map"):
            assert torch.equal(v, third.state_dict()[k]), k
    row = {t: i for i, t in enumerate(third.token_map.tolist())}
    for i, t in enumerate(first.token_map.tolist()):
        assert torch.equal(first.state_dict()[head][i], third.state_dict()[head][row[t]])
    # from an exported assistant GGUF (f32: exact), as from the checkpoint
    export_gguf(first.config, first.gguf_weights(), tmp_path / "a.gguf", "f32")
    fourth, _ = train(target, chunks, tmp_path / "d", other, progress=False, stop_after=0,
                      init=tmp_path / "a.gguf", log=lambda *a: None)
    assert all(torch.equal(v, fourth.state_dict()[k]) for k, v in first.state_dict().items())
    # q8_0: the dequantized matrices
    export_gguf(first.config, first.gguf_weights(), tmp_path / "a8.gguf", "q8_0")
    fifth, _ = train(target, chunks, tmp_path / "e", other, progress=False, stop_after=0,
                     init=tmp_path / "a8.gguf", log=lambda *a: None)
    from gemmaspec.training.train import load_init

    q8 = load_init(tmp_path / "a8.gguf")["model"]
    assert all(torch.equal(q8[k], fifth.state_dict()[k]) for k in q8 if k != head)
    w = first.state_dict()["params.blk__0__ffn_up__weight"]
    assert 0 < (q8["params.blk__0__ffn_up__weight"] - w).abs().max() <= w.abs().max() / 127
    import gguf
    import numpy as np

    other_arch = gguf.GGUFWriter(str(tmp_path / "g3.gguf"), "gemma3")  # not an assistant
    other_arch.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    other_arch.write_header_to_file(), other_arch.write_kv_data_to_file(), other_arch.write_tensors_to_file()
    other_arch.close()
    with pytest.raises(ValueError, match="reduced head.*'gemma3'"):
        load_init(tmp_path / "g3.gguf")
