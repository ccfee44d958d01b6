"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, for every
status the server sends: its own checks, FastAPI's validation, unknown routes and bugs.
Messages never echo the request's input back (a 1 MB prompt must not become a 1 MB error)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("specdec.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "server_busy_error", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple", "literal"}


def _param(loc: tuple[int | str, ...]) -> str:
    """The field path of an error, without pydantic's union tags such as 'str' or 'list[int]'."""
    parts = []
    for p in loc:
        if p == "body":
            continue
        p = str(p)
        if p.lower() in _TYPE_TAGS or any(c in p for c in "[(-"):
            break
        parts.append(p)
    return ".".join(parts)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line per problem (at most 5), naming the field, without the offending input."""
    lines, param = [], None
    for err in exc.errors()[:5]:
        where = _param(err.get("loc", ()))
        param = param or where or None
        msg = str(err.get("msg", "invalid value"))
        if err.get("type") == "json_invalid":
            msg = "the body is not valid JSON"
        elif err.get("type") == "finite_number":
            msg = "must be a finite number (not NaN or infinity)"
        lines.append(f"{where}: {_short(msg)}" if where else _short(msg))
    if len(exc.errors()) > 5:
        lines.append(f"... and {len(exc.errors()) - 5} more")
    return "; ".join(lines) or "invalid request", param


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, _short(str(exc.detail)), None, code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", None, "internal_error")
