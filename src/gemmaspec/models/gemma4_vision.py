"""Gemma 4 vision tower: the variable-resolution ViT encoder and the multimodal embedder (llama.cpp
projector type ``gemma4v``, an ``mmproj`` GGUF with ``general.architecture = "clip"``).

References: transformers ``models/gemma4/modeling_gemma4.py`` (``Gemma4VisionPatchEmbedder``,
``Gemma4VisionEncoder`` and its layers, ``Gemma4VisionRotaryEmbedding``, ``Gemma4VisionPooler``,
``Gemma4VisionModel``, ``Gemma4MultimodalEmbedder``), ``image_processing_pil_gemma4.py`` and
``processing_gemma4.py``; llama.cpp ``tools/mtmd/models/gemma4v.cpp`` and its converter's
``Gemma4VisionAudioModel`` (tensor names from ``gguf-py``'s ``TensorNameMap`` for ``MODEL_ARCH.MMPROJ``).

An image keeps its aspect ratio: it is resized so that its patch grid (``patch_size`` pixels a patch)
has at most ``max_soft_tokens * pooling_kernel**2`` patches and both sides are multiples of
``pooling_kernel`` patches (:func:`gemmaspec.images.patchify`). Each patch (its pixels in [0, 1],
row-major, RGB last) is mapped to [-1, 1] and projected to the vision width; learned x- and
y-position embeddings are added. ``num_layers`` encoder blocks follow: RMSNorm (Gemma 4's: times the
weight) → attention (q/k RMSNorm, weightless v RMSNorm, 2-D rotary embedding: the first half of each
head rotates by the patch's column, the second by its row, base ``rope_theta``; scale 1;
bidirectional) → RMSNorm → residual; RMSNorm → GELU-tanh gated MLP → RMSNorm → residual. The pooler
averages ``pooling_kernel`` x ``pooling_kernel`` patches into one soft token and multiplies by
sqrt(vision width); optional standardisation ``(x - std_bias) * std_scale``; the embedder applies a
weightless RMSNorm and projects to the text width. An image thus gives
``(rows / k) * (cols / k)`` soft tokens, written in the prompt as ``<|image>`` + that many
``<|image|>`` + ``<image|>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import gguf
import torch
import torch.nn.functional as F

from ..errors import ModelFileError
from .base import linear, rms_norm
from .config import VisionJSON, hf_vision_parts

BOI, EOI, IMAGE_TOKEN = "<|image>", "<image|>", "<|image|>"
"""Gemma 4's image tokens: transformers' ``Gemma4Processor`` replaces each ``<|image|>`` marker the chat
template writes with ``BOI + IMAGE_TOKEN * soft tokens + EOI``."""

HEAD_COUNT_KV_KEY = "clip.vision.attention.head_count_kv"
HEAD_DIM_KEY = "clip.vision.attention.head_dim"
"""llama.cpp's keys for a tower whose KV heads or head size are not the default (n_head, hidden / n_head);
written only then."""
ROPE_THETA_KEY = "clip.vision.rope.freq_base"
MAX_TOKENS_KEY = "clip.vision.max_soft_tokens"
"""Keys of our own, written only when a checkpoint differs from the released ones (RoPE base 100, a
280-soft-token budget): llama.cpp's layout has no key for either (it fixes the base at 100 and sizes
images by its own rule, 70 to 1120 tokens unless ``--image-max-tokens``; docs/usage.md)."""


@dataclass(frozen=True)
class Gemma4VisionConfig(VisionJSON):
    """The vision tower's hyper-parameters (transformers ``Gemma4VisionConfig`` and the image
    processor's ``max_soft_tokens``; GGUF keys ``clip.vision.*`` in comments)."""

    patch_size: int  # patch_size
    hidden_size: int  # embedding_length
    intermediate_size: int  # feed_forward_length
    num_layers: int  # block_count
    num_heads: int  # attention.head_count
    text_hidden_size: int  # projection_dim
    head_dim: int = 64  # from attn_q_norm's shape
    num_kv_heads: int | None = None  # from attn_k's shape
    pooling_kernel: int = 3  # projector.scale_factor
    position_embedding_size: int = 10240  # from position_embd's shape
    rms_norm_eps: float = 1e-6  # attention.layer_norm_epsilon
    rope_theta: float = 100.0  # llama.cpp: fixed at 100
    max_soft_tokens: int = 280  # transformers' default budget (llama.cpp: no key)
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)  # image_mean (the model scales by itself)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)  # image_std
    architecture: str = "gemma4v"
    preprocessing: ClassVar[str] = "patches"
    """How :func:`gemmaspec.images.prepare` cuts an image for this tower: aspect-preserving patches."""

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim % 4 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"vision head dim {self.head_dim} (must be a multiple of 4 for 2-D RoPE) or "
                             f"{self.num_heads} heads over {self.num_kv_heads} KV heads do not fit")

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel ** 2

    @classmethod
    def from_hf(cls, cfg: dict, preprocessor: dict | None = None) -> "Gemma4VisionConfig":
        """From a ``Gemma4ForConditionalGeneration`` ``config.json`` dict (``vision_config``,
        ``text_config.hidden_size``) and ``preprocessor_config.json`` (``max_soft_tokens``).

        Raises:
            ValueError: no ``vision_config``, a required key missing, or a setting not implemented.
        """
        v, t = hf_vision_parts(cfg, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size"))
        act = v.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
        pre = preprocessor or {}
        pre = pre.get("image_processor", pre)
        rope = v.get("rope_parameters") or {}
        heads = int(v["num_attention_heads"])
        return cls(patch_size=int(v["patch_size"]), hidden_size=int(v["hidden_size"]),
                   intermediate_size=int(v["intermediate_size"]), num_layers=int(v["num_hidden_layers"]),
                   num_heads=heads, text_hidden_size=int(t["hidden_size"]),
                   head_dim=int(v.get("head_dim") or v["hidden_size"] // heads),
                   num_kv_heads=int(v.get("num_key_value_heads") or heads),
                   pooling_kernel=int(v.get("pooling_kernel_size", 3)),
                   position_embedding_size=int(v.get("position_embedding_size", 10240)),
                   rms_norm_eps=float(v.get("rms_norm_eps", 1e-6)), rope_theta=float(rope.get("rope_theta", 100.0)),
                   max_soft_tokens=int(pre.get("max_soft_tokens", 280)),
                   image_mean=tuple(float(x) for x in pre.get("image_mean", (0.0,) * 3)),
                   image_std=tuple(float(x) for x in pre.get("image_std", (1.0,) * 3)))

    @classmethod
    def from_gguf(cls, meta) -> "Gemma4VisionConfig":
        """From an mmproj GGUF's metadata and tensor shapes, as llama.cpp's converter writes them (head
        dim from ``v.blk.0.attn_q_norm``, KV heads from ``v.blk.0.attn_k``, the position table's size
        from ``v.position_embd``).

        Raises:
            ModelFileError: a required key or tensor is missing.
        """
        def need(key):
            v = meta.get(key)
            if v is None:
                raise ModelFileError(f"{meta.path}: required metadata key {key} is missing")
            return v

        shapes = meta.tensor_shapes
        for name in ("v.blk.0.attn_q_norm.weight", "v.blk.0.attn_k.weight", "v.position_embd.weight"):
            if name not in shapes:
                raise ModelFileError(f"{meta.path}: tensor {name} that the gemma4v projector needs is missing")
        k = gguf.Keys.ClipVision
        head_dim = int(shapes["v.blk.0.attn_q_norm.weight"][-1])
        return cls(patch_size=int(need(k.PATCH_SIZE)), hidden_size=int(need(k.EMBEDDING_LENGTH)),
                   intermediate_size=int(need(k.FEED_FORWARD_LENGTH)), num_layers=int(need(k.BLOCK_COUNT)),
                   num_heads=int(need(k.Attention.HEAD_COUNT)), text_hidden_size=int(need(k.PROJECTION_DIM)),
                   head_dim=head_dim, num_kv_heads=int(shapes["v.blk.0.attn_k.weight"][0]) // head_dim,
                   pooling_kernel=int(meta.get(k.Projector.SCALE_FACTOR, 3) or 3),
                   position_embedding_size=int(shapes["v.position_embd.weight"][-2]),
                   rms_norm_eps=float(meta.get(k.Attention.LAYERNORM_EPS, 1e-6)),
                   rope_theta=float(meta.get(ROPE_THETA_KEY, 100.0)),
                   max_soft_tokens=int(meta.get(MAX_TOKENS_KEY, 280)),
                   image_mean=tuple(float(x) for x in meta.get(k.IMAGE_MEAN, (0.0,) * 3)),
                   image_std=tuple(float(x) for x in meta.get(k.IMAGE_STD, (1.0,) * 3)))

    def gguf_extra(self) -> dict:
        """Metadata beyond the ``clip.vision.*`` keys every tower writes: ``{key: (kind, value)}``."""
        k = gguf.Keys.ClipVision
        out = {k.PROJECTOR_TYPE: ("string", self.architecture), k.Projector.SCALE_FACTOR: ("uint32", self.pooling_kernel)}
        if self.rope_theta != 100.0:
            out[ROPE_THETA_KEY] = ("float32", self.rope_theta)
        if self.max_soft_tokens != 280:
            out[MAX_TOKENS_KEY] = ("uint32", self.max_soft_tokens)
        # llama.cpp reads these (clip.cpp, any tower) and otherwise takes n_head KV heads of
        # hidden / n_head: its converter leaves them out because the released towers fit that
        if self.num_kv_heads != self.num_heads:
            out[HEAD_COUNT_KV_KEY] = ("uint32", self.num_kv_heads)
        if self.head_dim * self.num_heads != self.hidden_size:
            out[HEAD_DIM_KEY] = ("uint32", self.head_dim)
        return out


def hf_to_gguf_name(name: str, num_layers: int) -> str | None:
    """A ``Gemma4ForConditionalGeneration`` tensor name → llama.cpp's mmproj name (``v.blk.3.attn_q.weight``,
    ``v.blk.3.attn_q.input_min`` for a clipped linear's bound, ``mm.input_projection.weight``), renamed
    as llama.cpp's converter does; None for text-model and audio tensors."""
    if not name.startswith(("model.vision_tower.", "model.embed_vision.")):
        return None
    name = name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight", ".weight")
    if name.endswith("position_embedding_table"):
        name += ".weight"
    base, _, suffix = name.rpartition(".")
    if name.endswith(("std_bias", "std_scale")):
        base, suffix = name, ""
    mapped = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, num_layers).get_name(base)
    if mapped is None:
        return None
    return f"{mapped}.{suffix}" if suffix else mapped


def hf_to_gguf_value(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The patch projection [width, p*p*3] (pixels row-major, RGB last) → llama.cpp's convolution
    kernel [width, 3, p, p]; a clipped linear's scalar bound → 1 element. Others as stored."""
    if name == "v.patch_embd.weight" and tensor.dim() == 2:
        width, cols = tensor.shape
        p = math.isqrt(cols // 3)
        return tensor.reshape(width, p, p, 3).permute(0, 3, 1, 2).contiguous()
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


_BLOCK = ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up", "ffn_down")
_NORMS = ("ln1", "attn_post_norm", "ln2", "ffn_post_norm", "attn_q_norm", "attn_k_norm")


def required_tensors(config: Gemma4VisionConfig) -> list[str]:
    """GGUF names of every tensor the tower needs (std_bias/std_scale and clipping bounds are optional)."""
    names = ["v.patch_embd.weight", "v.position_embd.weight", "mm.input_projection.weight"]
    return names + [f"v.blk.{i}.{n}.weight" for i in range(config.num_layers) for n in _BLOCK + _NORMS]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Gemma4Vision:
    """The vision tower: patches → soft-token embeddings for the text model.

    Args:
        config: :class:`Gemma4VisionConfig`.
        weights: GGUF tensor name → float32 tensor (matrices may be block-quantized weights, run through
            :func:`~gemmaspec.models.base.linear`).
        device: where the weights live.

    Raises:
        KeyError: a tensor is missing; ValueError: a shape disagrees with the config.
    """

    def __init__(self, config: Gemma4VisionConfig, weights: dict, device: torch.device | str = "cpu"):
        self.config, self.weights, self.device = config, weights, torch.device(device)
        missing = [n for n in required_tensors(config) if n not in weights]
        if missing:
            raise KeyError(missing[0])
        c = config
        want = {"v.patch_embd.weight": (c.hidden_size, 3, c.patch_size, c.patch_size),
                "v.position_embd.weight": (2, c.position_embedding_size, c.hidden_size),
                "mm.input_projection.weight": (c.text_hidden_size, c.hidden_size)}
        for name, shape in want.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"{name} has shape {tuple(weights[name].shape)}, expected {shape} from the metadata")
        conv = weights["v.patch_embd.weight"]
        self.patch_proj = conv.permute(0, 2, 3, 1).reshape(c.hidden_size, -1).float()  # HF's [width, p*p*3]
        half = c.head_dim // 2
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))

    def to(self, device) -> "Gemma4Vision":
        return Gemma4Vision(self.config, {k: v.to(device) for k, v in self.weights.items()}, device)

    @property
    def tokens_per_image(self) -> int:
        """The most soft tokens an image gets (``max_soft_tokens``); each image's own count is
        :meth:`image_tokens`."""
        return self.config.max_soft_tokens

    def image_tokens(self, image) -> int:
        """Soft tokens of one prepared image (:class:`~gemmaspec.images.Image`): patches / kernel²."""
        return image.pixels.shape[0] // self.config.pooling_kernel ** 2

    @staticmethod
    def image_text(n: int) -> str:
        """The text that stands for an image of ``n`` soft tokens, as transformers' ``Gemma4Processor``
        writes it in place of the chat template's ``<|image|>``: BOI, ``n`` image tokens, EOI."""
        return f"{BOI}{IMAGE_TOKEN * n}{EOI}"

    @staticmethod
    def placeholders() -> tuple[str, str]:
        """``(marker, image token)``: both ``<|image|>`` (the template's marker is expanded into the
        image tokens themselves)."""
        return IMAGE_TOKEN, IMAGE_TOKEN

    def embed(self, images: list) -> list[torch.Tensor]:
        """Prepared images → one float32 [soft tokens, text width] per image (each encoded alone: no
        padding to mask)."""
        return [self.encode(im.pixels, im.positions) for im in images]

    @torch.inference_mode()
    def encode(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One image's patches float32 [P, 3 * patch²] (values in [0, 1]) and their (column, row)
        int64 [P, 2] → soft-token embeddings float32 [P / kernel², text width], row-major over the
        pooled grid.

        Raises:
            ValueError: shapes that do not fit the config, or a grid that does not pool evenly.
        """
        c, w = self.config, self.weights
        k = c.pooling_kernel
        if patches.dim() != 2 or patches.shape[1] != 3 * c.patch_size ** 2 or positions.shape != (patches.shape[0], 2):
            raise ValueError(f"patches of shape {tuple(patches.shape)}, expected [P, {3 * c.patch_size ** 2}] "
                             "with positions [P, 2]")
        cols, rows = int(positions[:, 0].max()) + 1, int(positions[:, 1].max()) + 1
        if cols * rows != patches.shape[0] or cols % k or rows % k:
            raise ValueError(f"a {cols}x{rows} patch grid does not pool by {k}")
        pos = positions.to(self.device, torch.long)
        x = (2.0 * patches.to(self.device, torch.float32) - 1.0) @ self.patch_proj.T
        x = x + w["v.position_embd.weight"][0][pos[:, 0]] + w["v.position_embd.weight"][1][pos[:, 1]]
        freqs = pos[..., None].float() * self.inv_freq.to(self.device)  # [P, 2, head_dim / 4]
        cos = torch.cat([freqs[:, 0].cos()] * 2 + [freqs[:, 1].cos()] * 2, dim=-1)[:, None]  # [P, 1, head_dim]
        sin = torch.cat([freqs[:, 0].sin()] * 2 + [freqs[:, 1].sin()] * 2, dim=-1)[:, None]
        for i in range(c.num_layers):
            x = self._block(x, f"v.blk.{i}.", cos, sin)
        grid = x.T.reshape(1, c.hidden_size, rows, cols)
        pooled = F.avg_pool2d(grid, k, k).flatten(2)[0].T * math.sqrt(c.hidden_size)  # [tokens, width]
        if "v.std_bias" in w and "v.std_scale" in w:
            pooled = (pooled - w["v.std_bias"]) * w["v.std_scale"]
        return linear(w["mm.input_projection.weight"], rms_norm(pooled, None, c.rms_norm_eps))

    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """A (possibly clipped) linear: ``Gemma4ClippableLinear`` clamps its input and output to stored
        bounds when the checkpoint has them."""
        w = self.weights
        if name + ".input_min" in w:
            x = torch.clamp(x, w[name + ".input_min"], w[name + ".input_max"])
        y = linear(w[name + ".weight"], x)
        if name + ".output_min" in w:
            y = torch.clamp(y, w[name + ".output_min"], w[name + ".output_max"])
        return y

    def _block(self, x: torch.Tensor, p: str, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, w, eps = self.config, self.weights, self.config.rms_norm_eps
        n, d, half = x.shape[0], c.head_dim, c.head_dim // 2
        h = rms_norm(x, w[p + "ln1.weight"], eps)
        q = rms_norm(self._lin(p + "attn_q", h).view(n, c.num_heads, d), w[p + "attn_q_norm.weight"], eps)
        k = rms_norm(self._lin(p + "attn_k", h).view(n, c.num_kv_heads, d), w[p + "attn_k_norm.weight"], eps)
        v = rms_norm(self._lin(p + "attn_v", h).view(n, c.num_kv_heads, d), None, eps)
        q = torch.cat([_rotate(q[..., :half], cos[..., :half], sin[..., :half]),
                       _rotate(q[..., half:], cos[..., half:], sin[..., half:])], dim=-1)
        k = torch.cat([_rotate(k[..., :half], cos[..., :half], sin[..., :half]),
                       _rotate(k[..., half:], cos[..., half:], sin[..., half:])], dim=-1)
        rep = c.num_heads // c.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # [1, heads, P, head_dim]: a 4-D call takes PyTorch's fused (flash) CPU kernel; a 3-D one falls
        # back to the math path, which writes out [heads, P, P] scores (4-8x slower at 2,520 patches)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, scale=1.0)[0]
        a = self._lin(p + "attn_out", a.transpose(0, 1).reshape(n, c.num_heads * d))
        x = x + rms_norm(a, w[p + "attn_post_norm.weight"], eps)
        h = rms_norm(x, w[p + "ln2.weight"], eps)
        f = self._lin(p + "ffn_down", F.gelu(self._lin(p + "ffn_gate", h), approximate="tanh") * self._lin(p + "ffn_up", h))
        return x + rms_norm(f, w[p + "ffn_post_norm.weight"], eps)
