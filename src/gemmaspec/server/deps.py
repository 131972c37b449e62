"""The routes' FastAPI dependencies: the API key (one check, on every route of the app), the server's
state, and the state once the model has loaded."""

from __future__ import annotations

from fastapi import Request

from .apierror import APIError
from .security import key_matches
from .state import ServerState

PUBLIC_PATHS = frozenset({"/", "/health", "/v1/health", "/v1/models", "/models"})
"""Paths answered without the API key: llama-server's public set, and the chat page (with its files,
every path under :data:`PUBLIC_PREFIX`)."""
PUBLIC_PREFIX = "/static/"


def given_key(headers) -> str:
    """The API key a request carries: ``Authorization: Bearer KEY`` (the scheme in any case), else
    ``X-Api-Key: KEY``; "" for none."""
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")


def key_required(api_key: str | None, path: str, headers) -> bool:
    """Whether a request to ``path`` with ``headers`` is refused for its key: the server has one
    (``--api-key``), the path is not public, and the request carries no key or another one."""
    if not api_key or path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIX):
        return False
    given = given_key(headers)
    return not given or not key_matches(given, api_key)


async def require_key(request: Request) -> None:
    """The app-wide dependency that checks the API key (before anything else a route does).

    Raises:
        APIError: 401 for a missing or wrong key on a path outside :data:`PUBLIC_PATHS`.
    """
    st: ServerState = request.app.state.server
    if key_required(st.cfg.api_key, request.url.path, request.headers):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'")


async def server_state(request: Request) -> ServerState:
    """The app's :class:`~gemmaspec.server.state.ServerState`, loaded or not."""
    return request.app.state.server


async def loaded(request: Request) -> ServerState:
    """The app's state once the model has loaded.

    Raises:
        APIError: 503 ``Loading model`` before that.
    """
    st: ServerState = request.app.state.server
    st.require_model()
    return st
