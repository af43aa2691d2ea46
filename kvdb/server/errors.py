"""Errors as the OpenAI API sends them: ``{"error": {"message", "type", "param", "code"}}``.

kvdb's typed errors keep their message (it says what to do) and get the status of what went
wrong; an error of no known kind is a bug in kvdb, answered 500 "internal error" and logged.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvdb.errors import (
    AmbiguousSession,
    ArchiveError,
    Busy,
    ContextTooLong,
    KvdbError,
    SessionNotFound,
    UpstreamError,
    UpstreamTimeout,
)

log = logging.getLogger("kvdb.serve")

# most specific first: (error class, status, code)
STATUSES = (
    (ContextTooLong, 400, "context_length_exceeded"),
    (SessionNotFound, 404, "session_not_found"),
    (AmbiguousSession, 400, "ambiguous_session"),
    (Busy, 429, "queue_full"),
    (ArchiveError, 503, "archive_unavailable"),
    (UpstreamTimeout, 504, "upstream_timeout"),
    (UpstreamError, 502, "upstream_unreachable"),
    (KvdbError, 400, None),
)
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class HttpError(Exception):
    """What only HTTP can get wrong: a missing key, an oversized or unreadable body, an unknown path."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code


def describe(exc: BaseException) -> tuple[int, dict]:
    """(status, body) of any error, as the client is to see it."""
    if isinstance(exc, HttpError):
        return exc.status, _body(exc.status, str(exc), exc.code)
    for kind, status, code in STATUSES:
        if isinstance(exc, kind):
            return status, _body(status, str(exc), code)
    log.error("internal error", exc_info=exc)
    return 500, _body(500, "internal error", None)


def _body(status: int, message: str, code: str | None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": None, "code": code}}


def _respond(exc: BaseException) -> JSONResponse:
    status, body = describe(exc)
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    async def known(request: Request, exc: Exception) -> JSONResponse:
        return _respond(exc)

    async def starlette(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)  # registered for HTTPException only
        message = (
            f"no route {request.method} {request.url.path}; "
            "see GET /v1/models, POST /v1/chat/completions, GET /api/sessions"
            if exc.status_code == 404
            else str(exc.detail)
        )
        return _respond(HttpError(exc.status_code, message, "not_found" if exc.status_code == 404 else None))

    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)  # registered for RequestValidationError only
        problems = "; ".join(
            f"{'.'.join(map(str, e.get('loc', ())[1:])) or 'request'}: {e.get('msg')}" for e in exc.errors()
        )
        return _respond(HttpError(400, f"invalid request: {problems}", "invalid_request"))

    app.add_exception_handler(KvdbError, known)
    app.add_exception_handler(HttpError, known)
    app.add_exception_handler(HTTPException, starlette)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(Exception, known)
