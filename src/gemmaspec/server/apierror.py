"""The server's error answer: ``{"error": {"message", "type", "code"}}`` with an HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP ``status``; ``extra`` adds fields to it."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}

    def __init__(self, status: int, message: str, type_: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type_ or self.TYPES.get(status, "invalid_request_error")
        self.extra = extra

    def response(self) -> JSONResponse:
        err = {"message": self.message, "type": self.type, "code": self.status, **self.extra}
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse({"error": err}, status_code=self.status, headers=headers)
