"""Gemma 4 targets and assistants through GGUF: `gemmaspec convert` writes llama.cpp's layout, and
the files load back into the same models."""

import copy

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from conftest import run_cli
from gemmaspec.errors import InputError
from gemmaspec.loading.convert import convert
from gemmaspec.loading.gguf import load_gguf
from gemmaspec.loading import load_checkpoint
from gemmaspec.speculative.drafters import DraftContext, MTPDrafter
from test_gemma4 import CONFIGS, _ids, _tiny

pytestmark = pytest.mark.reference


class _SmallBPE:
    """A 300-token Gemma-style BPE tokenizer for the tiny checkpoints (a 262k vocabulary makes every
    GGUF open take ~15 s in gguf.GGUFReader)."""

    def __init__(self):
        from tokenizers import Tokenizer, decoders, normalizers
        from tokenizers.models import BPE

        letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
        vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
        for t in letters + ["\u2581"]:
            vocab[t] = len(vocab)
        merges = [("\u2581", c) for c in letters] + [(a, b) for a in letters for b in letters]
        merges = merges[: 300 - len(vocab)]
        for a, b in merges:
            vocab[a + b] = len(vocab)
        self.backend = Tokenizer(BPE(vocab, merges, unk_token="<unk>"))
        self.backend.normalizer = normalizers.Replace(" ", "\u2581")
        self.backend.decoder = decoders.Replace("\u2581", " ")


@pytest.fixture(scope="module")
def tok():
    return _SmallBPE()


def _with_tokenizer(path, tok):
    tok.backend.save(str(path / "tokenizer.json"))
    return path


def _rounded(ref, qtype):
    """The reference with its 2-D weights rounded exactly as the GGUF stores them."""
    r = copy.deepcopy(ref)
    with torch.no_grad():
        for name, p in r.named_parameters():
            a = p.detach().numpy().astype(np.float32)
            if a.ndim < 2 or "norm" in name:
                continue
            if qtype == T.Q8_0 and a.shape[-1] % 32:
                p.copy_(torch.from_numpy(a.astype(np.float16).astype(np.float32)))
            else:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).reshape(a.shape)))
    return r


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_f32_gguf_matches_reference(kind, tmp_path, tok):
    ref, path = _tiny(kind, tmp_path)
    out = tmp_path / "m.gguf"
    convert(_with_tokenizer(path, tok), out, "f32")
    model = load_gguf(out, use_cache=False).model
    ids = _ids(40)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got = model.forward(ids, model.new_cache(128), all_logits=True).logits
    assert ((got - want).norm() / want.norm()).item() < 1e-4


@pytest.mark.parametrize("outtype,qtype", [("q8_0", T.Q8_0), ("bf16", T.BF16)])
def test_quantized_gguf_is_exact_to_its_stored_weights(outtype, qtype, tmp_path, tok):
    ref, path = _tiny("moe", tmp_path)
    out = tmp_path / "m.gguf"
    convert(_with_tokenizer(path, tok), out, outtype)
    reader = gguf.GGUFReader(out)
    types = {t.name: T(t.tensor_type) for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == qtype and types["blk.0.attn_norm.weight"] == T.F32
    assert types["blk.0.ffn_gate_up_exps.weight"] == qtype and types["rope_freqs.weight"] == T.F32
    model = load_gguf(out, use_cache=False).model
    ids = _ids(40)
    with torch.no_grad():
        want = _rounded(ref, qtype)(ids[None]).logits[0]
    got = model.forward(ids, model.new_cache(128), all_logits=True).logits
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_llamacpp_metadata(tmp_path, tok):
    _, path = _tiny("e2b_like", tmp_path)
    out = tmp_path / "m.gguf"
    convert(_with_tokenizer(path, tok), out, "f16")
    r = gguf.GGUFReader(out)
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert f["general.architecture"] == "gemma4"
    assert f["gemma4.attention.key_length"] == 32 and f["gemma4.attention.key_length_swa"] == 16
    assert f["gemma4.attention.shared_kv_layers"] == 3
    assert f["gemma4.embedding_length_per_layer_input"] == 8
    assert f["gemma4.attention.sliding_window_pattern"] == [True, True, False, True, True, False, True, False]
    assert f["gemma4.feed_forward_length"] == [96] * 5 + [192] * 3  # double-wide MLP on shared layers
    freqs = next(t for t in r.tensors if t.name == "rope_freqs.weight").data
    assert list(freqs[:4]) == [1.0] * 4 and all(v > 1e29 for v in freqs[4:])  # 0.25 of 16 frequencies rotate


def test_real_tokenizer_survives_the_round_trip(tmp_path, tokenizer):
    """The real Gemma vocabulary written by `convert` reads back with the same ids (Gemma 4 files add
    no BOS by default: transformers' reference leaves it to the chat template)."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    v = tokenizer.vocab_size
    text_cfg = Gemma4TextConfig(vocab_size=v, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                num_attention_heads=1, num_key_value_heads=1, head_dim=8, global_head_dim=8,
                                layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                                vocab_size_per_layer_input=0)
    Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text_cfg, backbone_hidden_size=8)).save_pretrained(
        tmp_path / "a")
    tokenizer.backend.save(str(tmp_path / "a" / "tokenizer.json"))
    convert(tmp_path / "a", tmp_path / "a.gguf", "f32")
    from gemmaspec.tokenizer import GemmaTokenizer

    back = GemmaTokenizer.from_gguf(tmp_path / "a.gguf")
    for text in ("Hello, world!", "def f(x):\n    return x", "日本語 😀  two  spaces", "<start_of_turn>user\nHi"):
        assert back.encode(text, add_bos=False) == tokenizer.encode(text, add_bos=False), text


@pytest.mark.parametrize("clustered", [False, True])
def test_assistant_gguf_drafts_like_the_checkpoint(clustered, tmp_path, tok):
    from tiny_gemma4 import TARGET, randomize, tiny_assistant
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    randomize(Gemma4ForCausalLM(Gemma4TextConfig(**TARGET)).eval(), 1).save_pretrained(tmp_path / "t")
    tiny_assistant(clustered).save_pretrained(tmp_path / "a")
    _with_tokenizer(tmp_path / "a", tok)
    convert(tmp_path / "a", tmp_path / "a.gguf", "f32")
    info = run_cli("inspect", str(tmp_path / "a.gguf"))
    assert info.returncode == 0, info.stderr
    assert ("clustered head: yes" if clustered else "clustered head: no") in info.stdout
    from_dir = load_checkpoint(tmp_path / "a").model
    from_gguf = load_gguf(tmp_path / "a.gguf", use_cache=False).model
    assert from_gguf.has_clustered_head == clustered
    t = load_checkpoint(tmp_path / "t").model
    ids = _ids(30).tolist()
    cache = t.new_cache(64)
    out = t.forward(torch.tensor(ids), cache)
    pending = int(out.logits[0].argmax())
    ctx = DraftContext(ids + [pending], out.hidden[-1])
    assert MTPDrafter(from_gguf, t, cache).propose(ctx, 4).tokens == MTPDrafter(from_dir, t, cache).propose(ctx, 4).tokens


def test_convert_refuses_to_overwrite_and_leaves_no_partial_file(tmp_path, tok):
    _, path = _tiny("k_eq_v", tmp_path)
    out = tmp_path / "m.gguf"
    out.write_text("precious")
    with pytest.raises(InputError, match="--force"):
        convert(_with_tokenizer(path, tok), out, "f32")
    assert out.read_text() == "precious"
    (path / "tokenizer.json").unlink()  # fails midway: after the header work, before any rename
    res = run_cli("convert", str(path), str(tmp_path / "new.gguf"), "--outtype", "f32")
    assert res.returncode == 1 and "tokenizer.json" in res.stderr
    assert not list(tmp_path.glob("*new.gguf*"))
