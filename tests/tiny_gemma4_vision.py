"""A tiny random Gemma 4 multimodal checkpoint (transformers' ``Gemma4ForConditionalGeneration``) in the
real layout, with a word-level tokenizer that knows Gemma 4's image tokens."""

import json

import torch

from tiny_gemma4 import TARGET, randomize

VOCAB = 300
BOI, EOI, IMG = 296, 297, 298  # <|image>, <image|>, <|image|>
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=64, rms_norm_eps=1e-6,
              standardize=True, use_clipped_linears=True)
MAX_SOFT_TOKENS = 70  # transformers' smallest budget: 630 patches of 4 x 4 pixels


def tiny_multimodal(path, seed=11, bidirectional=True, text=None, image_ids=(BOI, EOI, IMG), tok=None,
                    max_soft_tokens=MAX_SOFT_TOKENS):
    """Save a random Gemma4ForConditionalGeneration at ``path`` (config, safetensors, tokenizer.json,
    preprocessor_config.json); returns the transformers model (float32, eval). ``bidirectional``:
    ``use_bidirectional_attention="vision"`` (images attend both ways on sliding layers). ``text``
    (overrides of the text config, e.g. a real vocabulary's size), ``image_ids`` (BOI, EOI, image
    token), ``tok`` (a ``tokenizers.Tokenizer``) and ``max_soft_tokens`` (the processor's budget)
    replace the defaults (benchmarks/mmproj_check.py: Gemma's real vocabulary, llama.cpp's layers)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig

    torch.manual_seed(seed)
    boi, eoi, img = image_ids
    text = Gemma4TextConfig(**(TARGET | (text or {})), use_bidirectional_attention="vision" if bidirectional else None)
    cfg = Gemma4Config(text_config=text, vision_config=Gemma4VisionConfig(**VISION), audio_config=None,
                       boi_token_id=boi, eoi_token_id=eoi, image_token_id=img, video_token_id=299,
                       boa_token_id=295, audio_token_id=294, eoa_token_index=293)
    ref = randomize(Gemma4ForConditionalGeneration(cfg).eval(), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in ref.named_buffers():
            if name.endswith(("input_min", "output_min")):
                b.fill_(-1.5 - float(torch.rand((), generator=g)))
            elif name.endswith(("input_max", "output_max")):
                b.fill_(1.5 + float(torch.rand((), generator=g)))
            elif name.endswith("std_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("std_scale"):
                b.copy_(1.0 + 0.2 * torch.randn(b.shape, generator=g))
            elif name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    ref.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Gemma4ImageProcessor", "patch_size": 4, "pooling_kernel_size": 3,
         "max_soft_tokens": max_soft_tokens, "image_mean": [0.0] * 3, "image_std": [1.0] * 3}))
    (tok or tokenizer()).save(str(path / "tokenizer.json"))
    return ref


def tokenizer():
    """A ``tokenizers`` word-level tokenizer over w3..w292 with Gemma's control and image tokens."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    special = {"<|image>": BOI, "<image|>": EOI, "<|image|>": IMG, "<|video|>": 299, "<|audio|>": 294,
               "<|audio>": 295, "<audio|>": 293}
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {f"w{i}": i for i in range(3, 293)} | special
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", "<eos>", "<bos>", *special)])
    return tok
