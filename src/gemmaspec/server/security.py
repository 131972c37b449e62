"""Safe by default: what a web page the user visits must not be able to do to a server on 127.0.0.1.

:class:`Guard` is an ASGI middleware in front of the app that refuses, with an OpenAI-style error:

- a ``Host`` that is neither an IP literal, ``localhost``, nor a name in ``--allowed-hosts`` (400):
  a DNS-rebinding page reaches the server under its own domain name, never under an IP literal;
- a cross-origin request (an ``Origin`` other than the server's own) from an origin not given with
  ``--cors-origin`` (403); allowed origins get CORS headers and preflight answers
  (Starlette's ``CORSMiddleware``, added in :func:`gemmaspec.server.api.create_app`);
- a POST whose ``Content-Type`` is not JSON (415): a page can send ``text/plain`` or a form without a
  CORS preflight, never ``application/json``;
- a body above ``max_body`` bytes (413), by ``Content-Length`` and by counting what arrives.

API keys are compared as SHA-256 digests with :func:`hmac.compare_digest` (:func:`key_matches`):
constant time, and the key's length does not leak either.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from urllib.parse import urlsplit

MAX_BODY_BYTES = 8 * 1024 * 1024
"""Default request body limit: far above any prompt a context holds as JSON."""


def key_matches(given: str, key: str) -> bool:
    """Whether ``given`` equals ``key``, in time independent of where they differ and of their lengths."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(key.encode()).digest())


def _host_name(host: str) -> str:
    """``Host`` header → the name or address without port or IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def normalize_origin(origin: str) -> str:
    """``--cors-origin`` text → the origin as a browser writes it in ``Origin`` (``scheme://host[:port]``,
    lower case, no trailing slash, no default port); ``*`` and ``null`` as they are.

    Raises:
        InputError: text that is not an origin (no scheme or host, or a path, query or fragment).
    """
    from ..errors import InputError

    o = origin.strip()
    if o in ("*", "null"):
        return o
    parts = urlsplit(o)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
            or parts.query or parts.fragment or parts.username or parts.password:
        raise InputError(f"--cors-origin {origin!r} is not an origin: write it as the browser sends it, "
                         "scheme://host[:port], e.g. https://app.example or http://localhost:3000")
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        raise InputError(f"--cors-origin {origin!r}: the port is not a number in 0..65535") from None
    default = {"http": 80, "https": 443}[parts.scheme.lower()]
    return f"{parts.scheme.lower()}://{host}" + (f":{port}" if port is not None and port != default else "")


def host_allowed(host: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's ``Host`` may be served: an IP literal, ``localhost``, or a name in
    ``allowed`` (``*`` allows every name). A missing Host (HTTP/1.0) is allowed: browsers always send one."""
    if not host or "*" in allowed:
        return True
    name = _host_name(host)
    if name in allowed or name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


WILDCARD_BINDS = ("0.0.0.0", "::", "")


def host_names(bind: str, allowed=()) -> tuple[str, ...]:
    """The ``Host`` names a server bound to ``bind`` answers to, besides IP literals and ``localhost``
    (always accepted): the ``--allowed-hosts`` names and the bound name; for a wildcard bind
    (``0.0.0.0``, ``::``: every interface) also the machine's own names (host name and FQDN), so
    ``http://MACHINE:PORT`` works from the network while a DNS-rebinding name still gets a 400."""
    import socket

    names = tuple(allowed) + (bind,)
    if bind in WILDCARD_BINDS:
        names += (socket.gethostname(), socket.getfqdn())
    # a name given with a port or in brackets ("box:8085", "[::1]") is matched as a Host header's name
    return tuple(_host_name(n) for n in names if n and n not in WILDCARD_BINDS)


def _error(status: int, message: str, type_: str) -> tuple[dict, bytes]:
    body = json.dumps({"error": {"message": message, "type": type_, "code": status}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, body


class Guard:
    """ASGI middleware applying the checks above to every HTTP request (see the module docstring).

    Args:
        app: the wrapped ASGI app.
        allowed_hosts: extra ``Host`` names to accept (lower case; ``*`` accepts all).
        cors_origins: origins allowed to call cross-origin (``*`` allows every origin).
        max_body: largest request body in bytes.
    """

    def __init__(self, app, allowed_hosts=(), cors_origins=(), max_body: int = MAX_BODY_BYTES):
        self.app = app
        self.allowed = frozenset(_host_name(h) for h in allowed_hosts)
        self.origins = frozenset(normalize_origin(o) for o in cors_origins)
        self.max_body = max_body

    async def _refuse(self, send, status: int, message: str, type_: str = "invalid_request_error") -> None:
        start, body = _error(status, message, type_)
        await send(start)
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host")
        if not host_allowed(host, self.allowed):
            return await self._refuse(send, 400, f"Host '{host}' is not allowed (DNS rebinding protection): use the "
                                                 f"server's address, or start it with --allowed-hosts {_host_name(host)}")
        origin = headers.get("origin")
        if origin and origin != "null" and "*" not in self.origins and origin.rstrip("/").lower() not in self.origins:
            own = urlsplit(origin).netloc.lower()
            if own != (host or "").lower():
                return await self._refuse(send, 403, f"cross-origin request from {origin} refused: start the server "
                                                     f"with --cors-origin {origin} to allow it", "permission_error")
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json" and not ctype.endswith("+json"):
                return await self._refuse(send, 415, f"Content-Type must be application/json (got "
                                                     f"'{ctype or 'none'}')", "invalid_request_error")
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                return await self._refuse(send, 413, f"the request body is {int(length)} bytes, the limit is "
                                                     f"{self.max_body}")
            chunks, seen = [], 0
            while True:  # read the body here (up to the limit), then hand it to the app in one piece
                msg = await receive()
                if msg["type"] != "http.request":
                    return  # the client left before sending its body
                chunks.append(msg.get("body", b""))
                seen += len(chunks[-1])
                if seen > self.max_body:
                    return await self._refuse(send, 413, f"the request body is over the limit of {self.max_body} bytes")
                if not msg.get("more_body", False):
                    break
            pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

            async def replay():
                return pending.pop() if pending else await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)
