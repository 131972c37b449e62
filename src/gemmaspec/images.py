"""Images in: decoding and preprocessing with Pillow, for a vision tower loaded with ``--mmproj``.

:func:`load_image` decodes bytes (PNG, JPEG, WebP, GIF's first frame, BMP: what Pillow reads) with a
pixel cap, and :func:`preprocess` does what transformers' Gemma 3 image processor does: RGB, resize
to the tower's square size (bilinear), scale to [0, 1], normalise with the checkpoint's mean and std.
:class:`Image` carries the pixels and a hash of them, which keys prompt-cache reuse.
"""

from __future__ import annotations

import hashlib
import io
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
    """One decoded image: ``pixels`` float32 [3, size, size] (normalised for the tower) and ``key``, the
    sha256 of those pixel values (hex): equal keys mean equal embeddings."""

    pixels: torch.Tensor
    key: str


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


def prepare(data: bytes, config, where: str = "image") -> Image:
    """Bytes → :class:`Image` for a tower whose config has ``image_size``, ``image_mean``, ``image_std``.

    Raises:
        InputError: see :func:`load_image`.
    """
    pixels = preprocess(load_image(data, where), config.image_size, config.image_mean, config.image_std)
    return Image(pixels, hashlib.sha256(pixels.numpy().tobytes()).hexdigest())
