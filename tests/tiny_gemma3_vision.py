"""A tiny random Gemma 3 multimodal checkpoint (transformers' ``Gemma3ForConditionalGeneration``) in
the real layout, with a word-level tokenizer that knows Gemma 3's image tokens."""

import json

import torch

VOCAB = 300
BOI, EOI, IMG = 297, 298, 299
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=7, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
            max_position_embeddings=512)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=56,
              patch_size=7, layer_norm_eps=1e-6)
TOKENS_PER_IMAGE = 4  # 8 x 8 patches pooled by 4
MEAN, STD = [0.48, 0.45, 0.41], [0.27, 0.26, 0.28]


def tiny_multimodal(path, seed=7, vocab=VOCAB, image_ids=(BOI, EOI, IMG), tok=None):
    """Save a random Gemma3ForConditionalGeneration at ``path`` (config, safetensors, tokenizer.json,
    preprocessor_config.json); returns the transformers model (float32, eval). ``vocab``,
    ``image_ids`` (BOI, EOI, image token) and ``tok`` (a ``tokenizers.Tokenizer``) replace the
    word-level vocabulary, e.g. by Gemma's real one (benchmarks/mmproj_check.py)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(seed)
    boi, eoi, img = image_ids
    cfg = Gemma3Config(text_config=Gemma3TextConfig(**(TEXT | {"vocab_size": vocab})),
                       vision_config=SiglipVisionConfig(**VISION), mm_tokens_per_image=TOKENS_PER_IMAGE,
                       boi_token_index=boi, eoi_token_index=eoi, image_token_index=img)
    ref = Gemma3ForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            scale = 0.5 if "norm" in name else (0.7 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1)
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if "layer_norm" in name and "weight" in name else 0))
    ref.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": MEAN, "image_std": STD, "size": {"height": 56, "width": 56}, "image_seq_length": TOKENS_PER_IMAGE}))
    (tok or tokenizer()).save(str(path / "tokenizer.json"))
    return ref


def tokenizer():
    """A ``tokenizers`` word-level tokenizer over w3..w296 with Gemma's control and image tokens."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {f"w{i}": i for i in range(3, BOI)}
    vocab |= {"<start_of_image>": BOI, "<end_of_image>": EOI, "<image_soft_token>": IMG}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", "<eos>", "<bos>", "<start_of_image>",
                                                                    "<end_of_image>", "<image_soft_token>")])
    return tok
