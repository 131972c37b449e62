"""Gemma 3 vision tower: the SigLIP encoder and Gemma 3's multimodal projector (llama.cpp projector
type ``gemma3``, an ``mmproj`` GGUF with ``general.architecture = "clip"``).

References: transformers ``models/siglip/modeling_siglip.py`` (``SiglipVisionTransformer``) and
``models/gemma3/modeling_gemma3.py`` (``Gemma3MultiModalProjector``, ``Gemma3Model.forward``);
llama.cpp ``tools/mtmd/clip.cpp`` (``PROJECTOR_TYPE_GEMMA3``) and its converter's
``Gemma3VisionModel`` (tensor names from ``gguf-py``'s ``TensorNameMap`` for ``MODEL_ARCH.MMPROJ``).

An image of ``image_size`` x ``image_size`` RGB pixels (896 for the released models) is cut into
``patch_size`` patches (14: 64 x 64 = 4096 of them) by a strided convolution, plus learned position
embeddings; ``num_layers`` pre-LayerNorm encoder blocks (bidirectional attention with biases, a
GELU-tanh MLP) and a final LayerNorm follow. The projector average-pools the 64 x 64 grid to
``tokens_per_image`` soft tokens (16 x 16 = 256, kernel 4), applies Gemma's RMSNorm (the stored
weight already holds Gemma's ``1 +``, as llama.cpp's converter writes it) and multiplies by
``mm.input_projection`` [vision width, text width]. Those rows replace the text embeddings of the
image's placeholder tokens in the target (not scaled by sqrt(width)), and the image's tokens attend
to each other bidirectionally there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf
import torch
import torch.nn.functional as F

from ..errors import ModelFileError
from ..kernels import BlockWeight
from .base import linear
from .config import VisionJSON, hf_vision_parts

BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
"""Gemma 3's image tokens: transformers' ``Gemma3Processor`` writes each image as
``"\\n\\n" + BOI + IMAGE_TOKEN * tokens_per_image + EOI + "\\n\\n"`` in place of the chat template's BOI."""


@dataclass(frozen=True)
class Gemma3VisionConfig(VisionJSON):
    """The vision tower's hyper-parameters (transformers ``SiglipVisionConfig`` + ``Gemma3Config``'s
    ``mm_tokens_per_image``; GGUF keys ``clip.vision.*`` in comments).

    Pixel values are RGB, resized to ``image_size`` square, scaled to [0, 1], then normalised as
    ``(x - image_mean) / image_std`` per channel (the checkpoint's ``preprocessor_config.json``).
    """

    image_size: int  # image_size
    patch_size: int  # patch_size
    hidden_size: int  # embedding_length
    intermediate_size: int  # feed_forward_length
    num_layers: int  # block_count
    num_heads: int  # attention.head_count
    text_hidden_size: int  # projection_dim
    layer_norm_eps: float = 1e-6  # attention.layer_norm_epsilon
    tokens_per_image: int = 256  # (image_size / patch_size / projector.scale_factor) ** 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)  # image_mean
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)  # image_std
    gelu_tanh: bool = True  # hidden_act gelu_pytorch_tanh (llama.cpp: use_gelu, ggml's tanh GELU)
    architecture: str = "gemma3"

    def __post_init__(self) -> None:
        side, per_side = self.image_size // self.patch_size, math.isqrt(self.tokens_per_image)
        if self.image_size % self.patch_size or per_side * per_side != self.tokens_per_image or side % per_side:
            raise ValueError(f"image size {self.image_size}, patch {self.patch_size} and {self.tokens_per_image} "
                             "tokens per image do not tile: the patch grid must pool evenly to a square")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision width {self.hidden_size} is not a multiple of {self.num_heads} heads")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:
        """The average-pooling kernel (and stride) over the patch grid (4 for the released models)."""
        return self.patches_per_side // math.isqrt(self.tokens_per_image)

    def gguf_extra(self) -> dict:
        """Metadata beyond the common ``clip.vision.*`` keys: ``{key: (kind, value)}`` (the pooling
        factor, written only when it is not 4, as llama.cpp's converter does)."""
        return {} if self.pool == 4 else {gguf.Keys.ClipVision.Projector.SCALE_FACTOR: ("uint32", self.pool)}

    @classmethod
    def from_hf(cls, cfg: dict, preprocessor: dict | None = None) -> "Gemma3VisionConfig":
        """From a multimodal ``config.json`` dict (its ``vision_config``, ``text_config.hidden_size``,
        ``mm_tokens_per_image``) and the checkpoint's ``preprocessor_config.json`` (mean, std).

        Raises:
            ValueError: no ``vision_config`` (a text-only checkpoint) or a required key missing.
        """
        v, t = hf_vision_parts(cfg, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                "patch_size"))
        pre = preprocessor or {}
        return cls(image_size=int(v["image_size"]), patch_size=int(v["patch_size"]), hidden_size=int(v["hidden_size"]),
                   intermediate_size=int(v["intermediate_size"]), num_layers=int(v["num_hidden_layers"]),
                   num_heads=int(v["num_attention_heads"]), text_hidden_size=int(t["hidden_size"]),
                   layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
                   tokens_per_image=int(cfg.get("mm_tokens_per_image", 256)),
                   image_mean=tuple(float(x) for x in pre.get("image_mean", (0.5,) * 3)),
                   image_std=tuple(float(x) for x in pre.get("image_std", (0.5,) * 3)),
                   gelu_tanh=v.get("hidden_act", "gelu_pytorch_tanh") != "gelu")

    @classmethod
    def from_gguf(cls, meta) -> "Gemma3VisionConfig":
        """From an mmproj GGUF's ``clip.*`` metadata (llama.cpp's converter: the projector scale
        factor is written only when it is not 4).

        Raises:
            ModelFileError: a required key is missing.
        """
        def need(key):
            v = meta.get(key)
            if v is None:
                raise ModelFileError(f"{meta.path}: required metadata key {key} is missing")
            return v

        k = gguf.Keys.ClipVision
        size, patch = int(need(k.IMAGE_SIZE)), int(need(k.PATCH_SIZE))
        scale = int(meta.get(k.Projector.SCALE_FACTOR, 4) or 4)
        return cls(image_size=size, patch_size=patch, hidden_size=int(need(k.EMBEDDING_LENGTH)),
                   intermediate_size=int(need(k.FEED_FORWARD_LENGTH)), num_layers=int(need(k.BLOCK_COUNT)),
                   num_heads=int(need(k.Attention.HEAD_COUNT)), text_hidden_size=int(need(k.PROJECTION_DIM)),
                   layer_norm_eps=float(meta.get(k.Attention.LAYERNORM_EPS, 1e-6)),
                   tokens_per_image=(size // patch // scale) ** 2,
                   image_mean=tuple(float(x) for x in meta.get(k.IMAGE_MEAN, (0.5,) * 3)),
                   image_std=tuple(float(x) for x in meta.get(k.IMAGE_STD, (0.5,) * 3)))


_HF_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def hf_to_gguf_name(name: str, num_layers: int) -> str | None:
    """A Gemma 3 multimodal checkpoint's tensor name → llama.cpp's mmproj name (``v.blk.3.attn_q.weight``,
    ``mm.input_projection.weight``) through ``gguf.TensorNameMap``; None for text-model tensors."""
    if not name.startswith(_HF_PREFIXES):
        return None
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower."):]  # transformers 5 saves it flat
    name = name.replace("_weight", ".weight")  # mm_input_projection_weight, a bare parameter
    base, _, suffix = name.rpartition(".")
    mapped = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, num_layers).get_name(base)
    return f"{mapped}.{suffix}" if mapped else None


def hf_to_gguf_value(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The projector's RMSNorm multiplies by ``1 + weight`` in transformers; the mmproj GGUF stores
    ``weight + 1`` (llama.cpp's converter), which this model uses. SigLIP's LayerNorms are unchanged."""
    return tensor + 1.0 if name == "mm.soft_emb_norm.weight" else tensor


_BLOCK = ("attn_q", "attn_k", "attn_v", "attn_out", "ln1", "ln2", "ffn_up", "ffn_down")


def required_tensors(config: Gemma3VisionConfig) -> list[str]:
    """GGUF names of every tensor the tower needs."""
    names = ["v.patch_embd.weight", "v.patch_embd.bias", "v.position_embd.weight", "v.post_ln.weight",
             "v.post_ln.bias", "mm.input_projection.weight", "mm.soft_emb_norm.weight"]
    return names + [f"v.blk.{i}.{n}.{s}" for i in range(config.num_layers) for n in _BLOCK for s in ("weight", "bias")]


def _dense(w) -> torch.Tensor:
    """A block-quantized matrix as float32 (the projection is used as ``x @ W``, not as a product the
    kernels run), a dense one as it is."""
    return w.dequantize() if isinstance(w, BlockWeight) else w


class Gemma3Vision:
    """The vision tower: pixels → soft-token embeddings for the text model.

    Args:
        config: :class:`Gemma3VisionConfig`.
        weights: GGUF tensor name → float32 tensor (matrices may be block-quantized weights, run through
            :func:`~gemmaspec.models.base.linear`).
        device: where the weights live.

    Raises:
        KeyError: a tensor is missing; ValueError: a shape disagrees with the config (the loader turns
            both into a :class:`~gemmaspec.errors.ModelFileError`).
    """

    def __init__(self, config: Gemma3VisionConfig, weights: dict, device: torch.device | str = "cpu"):
        self.config, self.weights, self.device = config, weights, torch.device(device)
        missing = [n for n in required_tensors(config) if n not in weights]
        if missing:
            raise KeyError(missing[0])
        c = config
        want = {"v.patch_embd.weight": (c.hidden_size, 3, c.patch_size, c.patch_size),
                "v.position_embd.weight": (c.patches_per_side ** 2, c.hidden_size),
                "mm.input_projection.weight": (c.hidden_size, c.text_hidden_size)}
        for name, shape in want.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"{name} has shape {tuple(weights[name].shape)}, expected {shape} from the metadata")
        self.proj = _dense(weights["mm.input_projection.weight"])

    def to(self, device) -> "Gemma3Vision":
        return Gemma3Vision(self.config, {k: v.to(device) for k, v in self.weights.items()}, device)

    @property
    def tokens_per_image(self) -> int:
        return self.config.tokens_per_image

    def image_tokens(self, image=None) -> int:
        """Soft tokens of an image: always ``tokens_per_image`` (a square tower)."""
        return self.config.tokens_per_image

    def image_text(self, n: int | None = None) -> str:
        """The text that stands for one image (``n`` soft tokens, default ``tokens_per_image``) in a prompt,
        as transformers' ``Gemma3Processor`` writes it in place of the chat template's ``<start_of_image>``:
        blank lines, BOI, one ``<image_soft_token>`` per soft token, EOI, blank lines."""
        return f"\n\n{BOI}{IMAGE_TOKEN * (n or self.tokens_per_image)}{EOI}\n\n"

    def embed(self, images: list) -> list[torch.Tensor]:
        """Prepared images (:class:`~gemmaspec.images.Image`) → float32 [tokens_per_image, text width] each."""
        return list(self.encode(torch.stack([im.pixels for im in images])))

    @staticmethod
    def placeholders() -> tuple[str, str]:
        """``(marker, image token)``: the chat template's image marker and the token that holds the
        place of each soft token (its id is replaced by the image's embeddings)."""
        return BOI, IMAGE_TOKEN

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixel values float32 [N, 3, image_size, image_size] (normalised) → soft-token embeddings
        float32 [N, tokens_per_image, text width].

        Raises:
            ValueError: the pixels' shape is not what the config says.
        """
        c, w = self.config, self.weights
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (3, c.image_size, c.image_size):
            raise ValueError(f"pixels of shape {tuple(pixels.shape)}, expected [N, 3, {c.image_size}, {c.image_size}]")
        x = F.conv2d(pixels.to(self.device, torch.float32), w["v.patch_embd.weight"], w["v.patch_embd.bias"],
                     stride=c.patch_size)
        x = x.flatten(2).transpose(1, 2) + w["v.position_embd.weight"]  # [N, P, D]
        for i in range(c.num_layers):
            x = self._block(x, f"v.blk.{i}.")
        x = F.layer_norm(x, (c.hidden_size,), w["v.post_ln.weight"], w["v.post_ln.bias"], c.layer_norm_eps)
        n, side = x.shape[0], c.patches_per_side
        grid = x.transpose(1, 2).reshape(n, c.hidden_size, side, side)
        pooled = F.avg_pool2d(grid, c.pool, c.pool).flatten(2).transpose(1, 2)  # [N, tokens, D]
        normed = F.rms_norm(pooled, (c.hidden_size,), w["mm.soft_emb_norm.weight"], c.layer_norm_eps)
        return normed @ self.proj

    def _block(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c, w = self.config, self.weights
        n, t, d = x.shape
        heads = c.num_heads

        def lin(name, v):
            weight, bias, v2 = w[p + name + ".weight"], w[p + name + ".bias"], v.reshape(n * t, v.shape[-1])
            if isinstance(weight, torch.Tensor):  # dense: the bias added inside the product (one addmm)
                return F.linear(v2, weight, bias).view(n, t, -1)
            return (linear(weight, v2) + bias).view(n, t, -1)

        h = F.layer_norm(x, (d,), w[p + "ln1.weight"], w[p + "ln1.bias"], c.layer_norm_eps)
        q, k, v = (lin(nm, h).view(n, t, heads, d // heads).transpose(1, 2) for nm in ("attn_q", "attn_k", "attn_v"))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)
        x = x + lin("attn_out", a)
        h = F.layer_norm(x, (d,), w[p + "ln2.weight"], w[p + "ln2.bias"], c.layer_norm_eps)
        h = F.gelu(lin("ffn_up", h), approximate="tanh" if c.gelu_tanh else "none")
        return x + lin("ffn_down", h)
