"""Images in: decoding and preprocessing with Pillow, for a vision tower loaded with ``--mmproj``.

:func:`load_image` decodes bytes (PNG, JPEG, WebP, GIF's first frame, BMP: what Pillow reads) with a
pixel cap, and :func:`preprocess` does what transformers' Gemma 3 image processor does: RGB, resize
to the tower's square size (bilinear), scale to [0, 1], normalise with the checkpoint's mean and std;
:func:`patchify` does what Gemma 4's does (aspect-preserving resize within a patch budget, patches).
:class:`Image` carries the pixels and a hash of them, which keys prompt-cache reuse.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch

from .errors import InputError

MAX_PIXELS = 50_000_000
"""The most pixels (width x height) an input image may have; larger ones are refused before decoding
(Pillow's own decompression-bomb limit is ~89 M)."""
MAX_BYTES = 50 << 20
"""The largest encoded image accepted (50 MiB)."""


@dataclass(frozen=True)
class Image:
    """One decoded image: ``pixels`` (normalised for the tower: float32 [3, size, size] for a square
    tower; float32 [P, 3 * patch²] patches for a variable-resolution one, with ``positions`` int64
    [P, 2], each patch's column and row) and ``key``, the sha256 of those values (hex): equal keys mean
    equal embeddings."""

    pixels: torch.Tensor
    key: str
    positions: torch.Tensor | None = None


def load_image(data: bytes, where: str = "image"):
    """Decode image bytes into an RGB ``PIL.Image``.

    Raises:
        InputError: empty, too large (bytes or pixels), corrupt or not an image format Pillow reads;
            the message starts with ``where``.
    """
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if not data:
        raise InputError(f"{where}: empty image data")
    if len(data) > MAX_BYTES:
        raise InputError(f"{where}: {len(data)} bytes is more than the {MAX_BYTES >> 20} MiB an image may have")
    try:
        img = PILImage.open(io.BytesIO(data))
        w, h = img.size
        if w * h > MAX_PIXELS:
            raise InputError(f"{where}: {w}x{h} pixels is more than the {MAX_PIXELS:,} an image may have")
        img.load()
        return img.convert("RGB")
    except InputError:
        raise
    except UnidentifiedImageError:
        raise InputError(f"{where}: not an image format gemmaspec reads (PNG, JPEG, WebP, GIF, BMP)") from None
    except (OSError, ValueError, SyntaxError, PILImage.DecompressionBombError) as exc:
        raise InputError(f"{where}: the image is corrupt or truncated ({exc})") from None


def preprocess(img, size: int, mean, std) -> torch.Tensor:
    """An RGB ``PIL.Image`` → float32 [3, size, size]: bilinear resize to ``size`` x ``size``, x / 255,
    then (x - mean) / std per channel (transformers' ``Gemma3ImageProcessor`` without pan-and-scan)."""
    from PIL import Image as PILImage

    resized = img.resize((size, size), PILImage.Resampling.BILINEAR)
    arr = np.asarray(resized, dtype=np.float32) / 255.0
    arr = (arr - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def patch_grid(height: int, width: int, patch: int, max_patches: int, kernel: int) -> tuple[int, int]:
    """The size ``(height, width)`` in pixels that transformers' ``Gemma4ImageProcessor`` resizes an
    image to: the aspect ratio kept, at most ``max_patches`` patches of ``patch`` pixels, each side a
    multiple of ``kernel * patch`` (a thin image gets one ``kernel * patch`` strip, its long side
    capped at ``max_patches / kernel²`` strips).

    Raises:
        InputError: the image cannot fit (it would become 0 x 0).
    """
    factor = math.sqrt(max_patches * patch * patch / (height * width))
    side = kernel * patch
    h, w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
    if h == 0 and w == 0:
        raise InputError(f"a {width}x{height} image cannot be cut into {side}-pixel tiles within the patch budget")
    longest = (max_patches // kernel ** 2) * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    return h, w


def patchify(img, patch: int, max_patches: int, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An RGB ``PIL.Image`` → ``(patches float32 [P, patch * patch * 3], positions int64 [P, 2])`` as
    transformers' ``Gemma4ImageProcessorPil`` cuts it: bicubic resize to :func:`patch_grid`'s size,
    x / 255 (no mean/std: the model scales to [-1, 1] itself), patches row-major, each patch's pixels
    row-major with RGB last; positions are (column, row)."""
    from PIL import Image as PILImage

    h, w = patch_grid(img.height, img.width, patch, max_patches, kernel)
    if (w, h) != img.size:
        img = img.resize((w, h), PILImage.Resampling.BICUBIC)
    arr = np.asarray(img, dtype=np.float32) / 255.0  # [h, w, 3]
    rows, cols = h // patch, w // patch
    patches = arr.reshape(rows, patch, cols, patch, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, -1)
    yy, xx = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    positions = np.stack([xx.reshape(-1), yy.reshape(-1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(patches)), torch.from_numpy(positions.astype(np.int64))


def prepare(data: bytes, config, where: str = "image") -> Image:
    """Bytes → :class:`Image` for a tower's config: ``preprocessing == "patches"`` (variable resolution:
    ``patch_size``, ``max_patches``, ``pooling_kernel``; :func:`patchify`), else a square tower
    (``image_size``, ``image_mean``, ``image_std``; :func:`preprocess`).

    Raises:
        InputError: see :func:`load_image` and :func:`patch_grid`.
    """
    img = load_image(data, where)
    if getattr(config, "preprocessing", "square") == "patches":
        pixels, positions = patchify(img, config.patch_size, config.max_patches, config.pooling_kernel)
        digest = hashlib.sha256(pixels.numpy().tobytes() + positions.numpy().tobytes()).hexdigest()
        return Image(pixels, digest, positions)
    pixels = preprocess(img, config.image_size, config.image_mean, config.image_std)
    return Image(pixels, hashlib.sha256(pixels.numpy().tobytes()).hexdigest())
