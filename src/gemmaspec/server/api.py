"""The HTTP API: OpenAI-compatible endpoints plus llama-server's native ones (``/completion``,
``/tokenize``, ``/detokenize``, ``/apply-template``, ``/health``, ``/props``, ``/slots``, ``/metrics``),
on FastAPI. See ``docs/server.md`` for usage and the conformance table.

:func:`create_app` puts the pieces together: the state (:mod:`.state`), the API key check
(:mod:`.deps`), the routes (:mod:`.openai_routes`, :mod:`.llama_routes`) and the job runner they
share (:mod:`.jobs`). Request bodies are read in :mod:`.parse` and :mod:`.translate`, responses
shaped in :mod:`.responses`. Errors are OpenAI-style: 400 for malformed JSON, missing, invalid or
unsupported fields and prompts longer than the context, 401 for a wrong or missing API key,
403/400/415/413 from :mod:`.security` (foreign origin, foreign Host, a body that is not JSON, a body
too large), 404 for an unknown path, 503 while the model loads. Generation runs on the
:class:`~gemmaspec.server.scheduler.Scheduler` thread; each request gets its events through an
asyncio queue.
"""

from __future__ import annotations

import asyncio

from fastapi import Depends, FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from . import llama_routes, openai_routes
from .apierror import APIError
from .config import ServeConfig
from .deps import require_key
from .security import Guard, normalize_origin
from .state import ServerState, new_state

__all__ = ["ServeConfig", "create_app"]


def create_app(cfg: ServeConfig, on_ready=None, on_load_error=None) -> FastAPI:
    """The FastAPI application; the model loads on the scheduler thread when the app starts.

    The app's :class:`~gemmaspec.server.state.ServerState` is ``app.state.server``; every route checks
    the API key first (:func:`~gemmaspec.server.deps.require_key`).

    Args:
        cfg: the server's settings.
        on_ready: called once the model is loaded (scheduler thread).
        on_load_error: called with the exception if loading fails (scheduler thread).
    """
    st = new_state(cfg, on_ready, on_load_error)

    async def lifespan(app):
        st.scheduler.start()
        yield
        await asyncio.to_thread(st.scheduler.close)

    app = FastAPI(title="gemmaspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(require_key)])
    app.state.server = st
    if cfg.cors_origins:  # as browsers write Origin (a trailing slash or upper case in the flag would never match)
        app.add_middleware(CORSMiddleware, allow_origins=[normalize_origin(o) for o in cfg.cors_origins],
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           allow_credentials="*" not in cfg.cors_origins)
    app.add_middleware(Guard, allowed_hosts=cfg.allowed_hosts, cors_origins=cfg.cors_origins, max_body=cfg.max_body)
    _add_error_handlers(app, st)
    app.include_router(llama_routes.router)
    app.include_router(openai_routes.router)
    return app


def _add_error_handlers(app: FastAPI, st: ServerState) -> None:
    """OpenAI-style errors for :class:`APIError` (a failed generation request counts in the metrics)
    and for Starlette's own (404 / 405 for an unknown path or method)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        path = request.url.path
        if path.endswith(("completions", "completion")):
            st.metrics.failed("chat" if "chat" in path else "completions" if path.startswith("/v1/") else "completion")
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = f"no such endpoint: {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return APIError(exc.status_code, msg).response()
