"""Gemma 3 from a Hugging Face checkpoint directory (the registry's ``gemma3`` entry, HF side) against
transformers' ``Gemma3ForCausalLM`` on tiny random checkpoints saved in the real layout."""

import json

import pytest
import torch

from gemmaspec.loading import load_checkpoint

pytestmark = pytest.mark.reference

CFG = dict(vocab_size=300, hidden_size=64, num_hidden_layers=7, intermediate_size=96, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
           max_position_embeddings=256)


def _tiny(tmp_path, **over):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(7)
    ref = Gemma3ForCausalLM(Gemma3TextConfig(**{**CFG, **over})).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # norms get non-trivial weights, so a missing +1 (transformers' 1 + weight) cannot pass
            p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.08))
    ref.save_pretrained(tmp_path / "g3")
    return ref, tmp_path / "g3"


@pytest.mark.parametrize("over", [{}, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}],
                         ids=["plain", "linear-rope"])
def test_gemma3_checkpoint_matches_reference(tmp_path, over):
    ref, path = _tiny(tmp_path, **over)
    loaded = load_checkpoint(path)
    assert loaded.arch.name == "gemma3" and loaded.tokenizer is None  # no tokenizer.json saved
    model = loaded.model
    ids = torch.randint(0, CFG["vocab_size"], (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    cache = model.new_cache(64)
    got = torch.cat([model.forward(ids[:25], cache, all_logits=True).logits,
                     model.forward(ids[25:], cache, all_logits=True).logits])  # past the 8-token window
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-5, rel


def test_gemma3_target_without_tokenizer_is_refused(tmp_path):
    from gemmaspec.errors import ModelFileError

    _, path = _tiny(tmp_path)
    with pytest.raises(ModelFileError, match="no tokenizer.json"):
        load_checkpoint(path, role="target")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["head_dim"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="lacks head_dim"):
        load_checkpoint(path)
