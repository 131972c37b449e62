"""Image content parts of chat requests (OpenAI's ``image_url``, with a ``data:`` URL), for a server
started with ``--mmproj``: the bytes taken out of the request, decoded and preprocessed for the
vision tower (:mod:`gemmaspec.images`). Remote URLs are not fetched (send the image inline);
audio parts are refused by name."""

from __future__ import annotations

import base64
import binascii

from ..errors import InputError
from .apierror import APIError

IMAGE_PARTS = ("image_url", "input_image")
AUDIO_PARTS = ("input_audio", "audio_url")


def refused_part(kind: str, where: str, vision: bool) -> APIError:
    """The 400 for a content part that cannot be used (audio; images without ``--mmproj``; others)."""
    if kind in AUDIO_PARTS:
        return APIError(400, f"{where}: '{kind}' parts are not supported: gemmaspec takes no audio input")
    if kind in IMAGE_PARTS and not vision:
        return APIError(400, f"{where}: '{kind}' parts are not supported by gemmaspec without a vision projector "
                             "(start the server with --mmproj FILE); only text content parts")
    return APIError(400, f"{where}: '{kind}' parts are not supported by gemmaspec: only text and image_url parts")


def image_bytes(part: dict, where: str) -> bytes:
    """The image of an ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` part
    (the URL may also be given as a plain string).

    Raises:
        APIError: 400 for a missing URL, a remote (``http``/``https``) URL, another scheme, or a data URL
            that is not base64.
    """
    url = part.get("image_url", part.get("url"))
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{where}.image_url.url must be a string: a data URL (data:image/png;base64,...)")
    if url.startswith(("http://", "https://")):
        raise APIError(400, f"{where}: remote image URLs are not fetched; send the image inline as a data URL "
                            "(data:image/png;base64,...)")
    if not url.startswith("data:"):
        raise APIError(400, f"{where}: image URLs must be data URLs (data:image/png;base64,...)")
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise APIError(400, f"{where}: the data URL must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: the data URL's base64 is malformed") from None


def prepare_images(raw: list[tuple[str, bytes]], vision) -> list:
    """Decode and preprocess ``(where, bytes)`` pairs for ``vision`` (a loaded tower).

    Raises:
        APIError: 400 for a corrupt, huge or unsupported image (naming the part).
    """
    from ..images import prepare

    try:
        return [prepare(data, vision.config, where=where) for where, data in raw]
    except InputError as exc:
        raise APIError(400, str(exc)) from None
