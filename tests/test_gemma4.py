"""Gemma 4 text models against the transformers reference, on tiny random checkpoints saved in the
real layout (``save_pretrained``): an E2B-like model (per-layer embeddings, KV sharing, double-wide
MLP), a k_eq_v model (full layers without V) and a mixture-of-experts model."""

import json

import pytest
import torch

from gemmaspec.errors import ModelFileError, UnsupportedArchitectureError
from gemmaspec.loading import load_checkpoint

pytestmark = pytest.mark.reference

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
               "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=16, layer_types=LAYER_TYPES,
            max_position_embeddings=512, final_logit_softcapping=30.0, hidden_size_per_layer_input=0)
CONFIGS = {
    "e2b_like": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=300, num_kv_shared_layers=3,
                     use_double_wide_mlp=True),
    "k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    "moe": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24),
}
SEEDS = {"e2b_like": 1, "k_eq_v": 2, "moe": 3}  # constants: the same weights in every process


def _tiny(kind, tmp_path, multimodal_prefix=False):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(**(BASE | CONFIGS[kind]))
    torch.manual_seed(SEEDS[kind])
    model = Gemma4ForCausalLM(cfg).eval()
    with torch.no_grad():  # every weight random, norms and scalars around 1, so nothing is trivially 1
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    out = tmp_path / kind
    model.save_pretrained(out)
    return model, out


def _ids(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_logits_match_reference(kind, tmp_path):
    ref, path = _tiny(kind, tmp_path)
    ours = load_checkpoint(path).model
    ids = _ids(40)  # crosses the 16-token sliding window
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    cache = ours.new_cache(128)
    got = ours.forward(ids, cache, all_logits=True).logits
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_incremental_decode_matches_full_forward(kind, tmp_path):
    """Chunked prefill then single-token steps through the ring cache equal one full reference pass."""
    ref, path = _tiny(kind, tmp_path)
    ours = load_checkpoint(path).model
    ids = _ids(50, seed=1)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    cache = ours.new_cache(128)
    ours.forward(ids[:20], cache)
    steps = [ours.forward(ids[i:i + 1], cache).logits[0] for i in range(20, 50)]
    got = torch.stack(steps)
    rel = ((got - want[20:]).norm() / want[20:].norm()).item()
    assert rel < 1e-4, rel


def test_greedy_generation_matches_reference(tmp_path):
    ref, path = _tiny("e2b_like", tmp_path)
    ours = load_checkpoint(path).model
    ids = _ids(12, seed=2).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False, min_new_tokens=30,
                            eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
    cache = ours.new_cache(128)
    out = ours.forward(torch.tensor(ids), cache)
    got = []
    for _ in range(30):
        tok = int(out.logits[0].argmax())
        got.append(tok)
        out = ours.forward(torch.tensor([tok]), cache)
    assert got == want


def test_multimodal_prefix_and_extra_shared_kv_tensors(tmp_path):
    """Text weights under model.language_model.*, vision tensors beside them, and K/V tensors on
    KV-shared layers (non-QAT exports keep them) all load; the result is unchanged."""
    from safetensors.torch import load_file, save_file

    ref, path = _tiny("e2b_like", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.vision_tower.patch.weight"] = torch.zeros(3, 3)
    renamed["model.language_model.layers.7.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(renamed, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": cfg}))
    ours = load_checkpoint(path).model
    ids = _ids(20)
    with torch.no_grad():
        want = ref(ids[None]).logits[0, -1]
    got = ours.forward(ids, ours.new_cache(64)).logits[0]
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_k_eq_v_never_runs_without_v(tmp_path):
    """A checkpoint that needs V on a layer and lacks it is refused, naming the tensor."""
    from safetensors.torch import load_file, save_file

    _, path = _tiny("moe", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.self_attn.v_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelFileError, match=r"blk\.2\.attn_v\.weight"):
        load_checkpoint(path)


def test_bad_checkpoints(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match="has no config.json"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UnsupportedArchitectureError, match="llama"):
        load_checkpoint(tmp_path / "d")
    _, path = _tiny("k_eq_v", tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated .tensor model.layers"):
        load_checkpoint(path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelFileError, match="not a readable safetensors"):
        load_checkpoint(path)
