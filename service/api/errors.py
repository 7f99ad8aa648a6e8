"""Every failure leaves as SPEC's error body, ``{"error": {"code": "…", "message": "…", "detail": {…}}}``,
by one set of handlers: our own errors (every :class:`~service.errors.SidequestError`: its ``status``,
``to_error()`` and ``headers``), request validation (422, or 400 for a body that is not JSON / not UTF-8),
unknown routes and methods, and, as a last resort that should never fire, unexpected exceptions (500
without internals)."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from service.errors import SidequestError
from service.store.db import DB_ERRORS, is_unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


class ApiError(SidequestError):
    """A refusal only the API makes (auth, limits, parameters), HTTP status first as the routes say it;
    every other refusal is the store's or the pipeline's own :class:`SidequestError`, reaching the one
    handler unchanged."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        detail: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, detail, code=code, status=status, headers=headers)


def not_found(what: str) -> ApiError:
    """The one 404 for anything missing, cleared, or another tenant's (never tells them apart)."""
    return ApiError(404, "not_found", f"{what} not found")


def found(value: T | None, what: str) -> T:
    """``value``; :func:`not_found` when it is None (the store's answer for "no such ``what``")."""
    if value is None:
        raise not_found(what)
    return value


def validation_error(loc: list[str], message: str) -> ApiError:
    """422 ``validation_error`` for one field a route checks itself, with the ``detail.errors`` every such
    refusal carries (docs/api.md; FastAPI's own refusals get the same body from :func:`_validation_error`)."""
    return ApiError(
        422,
        "validation_error",
        f"invalid request: {'.'.join(loc)}: {message}",
        {"errors": [{"loc": loc, "msg": message, "type": "value_error"}]},
    )


def error_response(error: SidequestError) -> JSONResponse:
    """The one mapping of the error protocol onto HTTP: status, SPEC's body, and any headers."""
    return JSONResponse({"error": error.to_error()}, status_code=error.status, headers=error.headers or None)


async def _sidequest_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SidequestError)
    return error_response(exc)


def media_type(content_type: bytes) -> bytes:
    return content_type.split(b";", 1)[0].strip().lower()


def is_json_media(content_type: bytes) -> bool:
    """Whether a body sent as ``content_type`` is JSON: FastAPI's own rule (``application/json`` or
    ``application/…+json``), so every body FastAPI parses as JSON is one StrictJsonBodies checks."""
    media = media_type(content_type)
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def undeclared_json(request: Request, errors: list[dict[str, Any]] | None = None) -> ApiError | None:
    """The one rule for a body that is not declared as JSON (:func:`is_json_media`): a 422
    ``validation_error`` that names the content type as the problem, or None when it is declared."""
    content_type = request.headers.get("content-type", "").encode("latin-1")
    if is_json_media(content_type):
        return None
    media = media_type(content_type).decode("latin-1")
    declared = f"Content-Type {media!r}" if media else "no Content-Type"
    message = f"invalid request: the body must be JSON, sent as Content-Type: application/json ({declared})"
    if errors is None:
        errors = [{"loc": ["header", "content-type"], "msg": message}]
    return ApiError(422, "validation_error", message, {"errors": errors})


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    # Without the offending input: it may be a 32 MiB snapshot, or a secret.
    errors = [{"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]} for err in exc.errors()]
    if any(e["type"] == "json_invalid" for e in errors):
        return error_response(ApiError(400, "malformed_json", "the request body is not valid JSON"))
    if any(tuple(e["loc"]) == ("body",) for e in errors):
        # The framework reads a body as JSON only when it is declared so; anything else arrives as
        # text and fails as "not a valid dictionary", which says nothing of the real cause.
        refused = undeclared_json(request, errors)
        if refused is not None:
            return error_response(refused)
    summary = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors[:5])
    return error_response(
        ApiError(422, "validation_error", f"invalid request: {summary}", {"errors": errors})
    )


# What the framework raises itself: routing's 404 and 405, FastAPI's 400 for a body it cannot decode
# (our own refusals are SidequestErrors, and HTTPBearer runs with auto_error=False).
_STATUS_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette's own 405 names only the first route's)."""
    routes = request.app.router.routes
    return sorted(
        method
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE")
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _STATUS_CODES.get(exc.status_code, "http_error")
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(allowed_methods(request))
    message = exc.detail if isinstance(exc.detail, str) else "request refused"
    if exc.status_code == 404:
        message = "not found"
    if code == "bad_request" and "parsing the body" in message:
        # FastAPI's answer to a body it cannot decode (e.g. invalid UTF-8).
        code = "malformed_json"
        message = (
            "the request body is not JSON this service reads: not UTF-8, not well formed, nested too"
            " deeply, or holding a number of more than 4300 digits"
        )
    return error_response(ApiError(exc.status_code, code, message, headers=headers))


# Seconds a client should wait before retrying while the database is away: pools reconnect on the
# next checkout, so a short wait is enough once PostgreSQL is back.
UNAVAILABLE_RETRY_AFTER_S = 2


def service_unavailable() -> ApiError:
    """SPEC §8's 503: the database cannot be reached; retry after a short wait."""
    return ApiError(
        503,
        "service_unavailable",
        "the database cannot be reached; retry shortly",
        {"retry_after_s": UNAVAILABLE_RETRY_AFTER_S},
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
    )


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    # One handler for every driver / OS error: unreachable → 503, anything else is a bug (500).
    if is_unavailable(exc):
        log.warning("database unavailable on %s %s: %s", request.method, request.url.path, type(exc).__name__)
        return error_response(service_unavailable())
    return await _unexpected(request, exc)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Log the route, never the query string (it may carry a stream token).
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(ApiError(500, "internal_error", "internal error"))


def install_error_handlers(app: FastAPI) -> None:
    # Every error of ours, whichever layer raised it (store refusals, archive errors, ApiError).
    app.add_exception_handler(SidequestError, _sidequest_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for db_type in DB_ERRORS:
        app.add_exception_handler(db_type, _database_error)
    app.add_exception_handler(Exception, _unexpected)
