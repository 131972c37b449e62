"""Images in requests, for a server started with ``--mmproj``: OpenAI's ``image_url`` content parts
(a ``data:`` URL, or an ``http(s)`` URL fetched only with ``--allow-image-urls``) and llama-server's
``multimodal_data`` (base64 images, each standing at a ``<__media__>`` marker of the prompt); the bytes
taken out of the request, decoded and preprocessed for the vision tower (:mod:`gemmaspec.images`).
Audio parts are refused by name."""

from __future__ import annotations

import base64
import binascii
import logging

from ..errors import InputError
from .apierror import APIError

log = logging.getLogger(__name__)

IMAGE_PARTS = ("image_url", "input_image")
AUDIO_PARTS = ("input_audio", "audio_url")
MEDIA_MARKER = "<__media__>"
"""llama-server's marker (mtmd's ``mtmd_default_marker()``): where each ``multimodal_data`` image goes."""
URL_MAX_BYTES = 10 << 20
"""The largest image fetched from a URL (llama-server's cap: 10 MiB)."""
URL_TIMEOUT_S = 10.0
"""Seconds a URL fetch may take to connect, and between two reads (llama-server's: 10)."""
URL_MAX_REDIRECTS = 3


def no_projector(where: str) -> APIError:
    """The 400 for images sent to a server without a vision tower."""
    return APIError(400, f"{where}: images need a vision projector: this server was started without one "
                         "(start it with --mmproj FILE)")


def refused_part(kind: str, where: str, vision: bool) -> APIError:
    """The 400 for a content part that cannot be used (audio; images without ``--mmproj``; others)."""
    if kind in AUDIO_PARTS:
        return APIError(400, f"{where}: '{kind}' parts are not supported: gemmaspec takes no audio input")
    if kind in IMAGE_PARTS and not vision:
        return APIError(400, f"{where}: '{kind}' parts are not supported by gemmaspec without a vision projector "
                             "(start the server with --mmproj FILE); only text content parts")
    return APIError(400, f"{where}: '{kind}' parts are not supported by gemmaspec: only text and image_url parts")


def image_bytes(part: dict, where: str, allow_urls: bool = False) -> bytes:
    """The image of an ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` part
    (the URL may also be given as a plain string); an ``http(s)`` URL is fetched when ``allow_urls``
    (``--allow-image-urls``), see :func:`fetch_image`.

    Raises:
        APIError: 400 for a missing URL, a remote (``http``/``https``) URL without ``allow_urls`` or one
            that cannot be fetched, another scheme, or a data URL that is not base64.
    """
    url = part.get("image_url", part.get("url"))
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{where}.image_url.url must be a string: a data URL (data:image/png;base64,...)")
    if url.startswith(("http://", "https://")):
        if allow_urls:
            return fetch_image(url, where)
        raise APIError(400, f"{where}: remote image URLs are not fetched unless the server is started with "
                            "--allow-image-urls; send the image inline as a data URL (data:image/png;base64,...)")
    if not url.startswith("data:"):
        raise APIError(400, f"{where}: image URLs must be data URLs (data:image/png;base64,...)")
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise APIError(400, f"{where}: the data URL must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: the data URL's base64 is malformed") from None


def fetch_image(url: str, where: str, max_bytes: int = URL_MAX_BYTES, timeout: float = URL_TIMEOUT_S) -> bytes:
    """GET an image URL (``--allow-image-urls``) with httpx: at most ``max_bytes`` read (a larger
    ``Content-Length`` is refused before reading), ``timeout`` seconds to connect and per read, at most
    :data:`URL_MAX_REDIRECTS` redirects, each to an ``http(s)`` URL; the answer must be a 2xx whose
    ``Content-Type`` (when given) is ``image/*`` or ``application/octet-stream``. Blocking: call it off
    the event loop.

    Raises:
        APIError: 400 naming the part and what went wrong (never the fetch's traceback).
    """
    import httpx

    def refuse(why: str) -> APIError:
        return APIError(400, f"{where}: cannot use the image at {url[:200]}: {why}")

    try:
        with httpx.Client(timeout=timeout, follow_redirects=True, max_redirects=URL_MAX_REDIRECTS) as client, client.stream("GET", url) as r:
            if not 200 <= r.status_code < 300:
                raise refuse(f"the server answered HTTP {r.status_code}")
            kind = r.headers.get("content-type", "").split(";")[0].strip().lower()
            if kind and not (kind.startswith("image/") or kind == "application/octet-stream"):
                raise refuse(f"its Content-Type is {kind}, not an image")
            size = r.headers.get("content-length", "")
            if size.isdigit() and int(size) > max_bytes:
                raise refuse(f"{int(size)} bytes is more than the {max_bytes >> 20} MiB a fetched image may have")
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise refuse(f"more than the {max_bytes >> 20} MiB a fetched image may have")
    except httpx.TooManyRedirects:
        raise refuse(f"more than {URL_MAX_REDIRECTS} redirects") from None
    except httpx.TimeoutException:
        raise refuse(f"no answer within {timeout:g} s") from None
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
        raise refuse(f"the fetch failed ({type(exc).__name__}: {exc})") from None
    log.info("%s: fetched %d bytes from %s", where, len(data), url[:200])
    return bytes(data)


def media_data(items, where: str) -> list[tuple[str, bytes]]:
    """llama-server's ``multimodal_data``: a list of base64 strings → ``(where[i], bytes)`` pairs
    (whitespace in the base64 is ignored; a ``data:...;base64,`` prefix is accepted too).

    Raises:
        APIError: 400 for something else than a list of strings, or malformed base64.
    """
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise APIError(400, f"{where} must be an array of base64-encoded images (strings)")
    out = []
    for i, item in enumerate(items):
        payload = item.partition(",")[2] if item.startswith("data:") else item
        try:
            out.append((f"{where}[{i}]", base64.b64decode("".join(payload.split()), validate=True)))
        except (binascii.Error, ValueError):
            raise APIError(400, f"{where}[{i}]: malformed base64") from None
    return out


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
