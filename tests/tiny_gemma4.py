"""Tiny random Gemma 4 checkpoints built with transformers' own classes (shared by tests and
benchmarks/llamacpp_compat.py)."""

import torch

VOCAB, WINDOW = 300, 16
TARGET = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=WINDOW,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                           "sliding_attention", "full_attention"],
              max_position_embeddings=512, final_logit_softcapping=30.0,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2)
ASSISTANT_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                      sliding_window=WINDOW, max_position_embeddings=512, hidden_size_per_layer_input=0,
                      vocab_size_per_layer_input=0,
                      layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])


def randomize(model, seed):
    """Every weight random (norms and scales around 1), so nothing in the model is trivially 1 or 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.7 / p.shape[-1] ** 0.5))
    return model


def tiny_assistant(clustered=False, seed=2, text=None, backbone=64):
    """A random Gemma4AssistantForCausalLM (clustered head: 10 centroids, top 3, shuffled ordering)."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    cfg = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**(text or ASSISTANT_TEXT)), backbone_hidden_size=backbone,
                                use_ordered_embeddings=clustered, num_centroids=10, centroid_intermediate_top_k=3)
    asst = randomize(Gemma4AssistantForCausalLM(cfg).eval(), seed)
    if clustered:
        v = cfg.get_text_config().vocab_size
        asst.masked_embedding.token_ordering.copy_(torch.randperm(v, generator=torch.Generator().manual_seed(seed + 1)))
    asst.generation_config.num_assistant_tokens = 3
    return asst
