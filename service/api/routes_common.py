"""Pieces shared by the question and session routes: path parameters, error responses, SSE plumbing."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import Depends, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from service.api.deps import bearer_tenant, unauthorized
from service.api.errors import ApiError, validation_error
from service.api.event_hub import EventHub
from service.api.schemas import ErrorBody
from service.api.sse_response import SEND_TIMEOUT_S, StreamResponse
from service.api.stream_tokens import check_token, issue_token
from service.archive.model import NO_NUL
from service.vocabulary import MAX_PARENT_ID_CHARS, UNSTORABLE_TEXT, unstorable_reason, utc_iso

MAX_INT64 = 2**63 - 1


def path_id(name: str, value: str) -> str:
    """A path id: ``.`` and ``..`` (also sent as ``%2E``) → 404 ``not_found``, as the URL they stand for
    matches no route (docs/api.md): clients (browsers, httpx, curl without --path-as-is) resolve dot
    segments away, so a session under one could not be reached; text PostgreSQL cannot store → 422."""
    if value in (".", ".."):
        raise ApiError(404, "not_found", f"no such path: {value!r} is not a {name}")
    if unstorable_reason(value) is not None:
        raise validation_error(["path", name], UNSTORABLE_TEXT)
    return value


# async although it never awaits: a plain def dependency runs in a worker thread (see deps.py).
async def _parent_id(
    parent_id: Annotated[str, Path(min_length=1, max_length=MAX_PARENT_ID_CHARS, json_schema_extra=NO_NUL)],
) -> str:
    return path_id("parent_id", parent_id)


ParentId = Annotated[str, Depends(_parent_id)]


ERROR_DESCRIPTIONS = {
    400: "Malformed request (not JSON, not UTF-8, bad Last-Event-ID)",
    401: "Missing or invalid bearer token",
    404: "Not found (or another tenant's)",
    409: "Conflict",
    413: "Too large",
    422: "Invalid input",
    429: "Too many queued requests in this session",
    503: "The database cannot be reached (service_unavailable; retry after Retry-After seconds)",
}


def errors(
    *statuses: int, descriptions: dict[int, str] = ERROR_DESCRIPTIONS
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for SPEC's error body."""
    return {s: {"model": ErrorBody, "description": descriptions.get(s, "Error")} for s in statuses}


def stream_tenant(request: Request, bearer: str | None, token: str | None, stream: str) -> str:
    """The tenant of a stream request: a valid bearer token, or a ``?token=`` for this very stream."""
    if bearer is not None:
        return bearer
    if token:
        tenant = check_token(request.app.state.stream_secret, token, stream)
        if tenant is not None:
            return tenant
        raise unauthorized("the stream token is invalid, expired, or for another stream")
    raise unauthorized()


BearerTenant = Annotated[str | None, Depends(bearer_tenant)]
StreamTokenParam = Annotated[
    str | None,
    Query(
        description="A stream token from POST …/stream-token (for browsers; valid on this stream only).",
        max_length=2000,
    ),
]
AfterParam = Annotated[
    int | None,
    Query(ge=0, le=MAX_INT64, description="Resume after this event id (ignored when Last-Event-ID is sent)."),
]


def stream_token_response(request: Request, tenant: str, stream: str, url: str) -> JSONResponse:
    """Issue a 10-minute token for one stream and answer ``{token, expires_at, url}`` (SPEC §4)."""
    token, expires = issue_token(request.app.state.stream_secret, tenant, stream)
    return JSONResponse(
        {
            "token": token,
            "expires_at": utc_iso(datetime.fromtimestamp(expires, UTC)),
            "url": f"{url}?token={token}",
        },
        headers={"Cache-Control": "no-store"},
    )


def resume_point(request: Request, after: int | None) -> tuple[int, bool]:
    """The cursor to resume after, and whether the client resumes (``Last-Event-ID`` wins)."""
    header = request.headers.get("last-event-id", "").strip()
    if header:
        try:
            value = int(header)
        except ValueError:
            raise ApiError(400, "invalid_last_event_id", "Last-Event-ID must be an event id") from None
        if value < 0 or value > MAX_INT64:
            raise ApiError(400, "invalid_last_event_id", "Last-Event-ID is out of range")
        return value, True
    return (after, True) if after is not None else (0, False)


def sse_response(request: Request, content: Any) -> Response:
    """An EventSourceResponse (with the cheaper send timeout) and this app's ping interval."""
    hub: EventHub = request.app.state.hub
    return StreamResponse(
        content,
        ping=hub.ping_s,
        send_timeout=SEND_TIMEOUT_S,
        watchdog=hub.send_watchdog,
        headers={"Cache-Control": "no-store"},
    )


EVENT_TYPES = ["status", "progress", "delta", "usage", "done", "error", "memory", "handoff"]

# One server-sent event, as parsed by a client (comments such as pings are not events).
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "id": {
            "type": "string",
            "pattern": "^[0-9]+$",
            "description": "Per-request seq on a request stream, global event id on a session stream.",
        },
        "event": {"type": "string", "enum": EVENT_TYPES},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "description": "JSON: request_id, ordinal, seq, at, and the fields of the event type (SPEC §4).",
        },
        "retry": {"type": "integer"},
    },
}

SSE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Server-Sent Events (SPEC §4): `id:`, `event:` (status, progress, delta, usage, "
        "done, error), `data:` JSON; a `retry:` hint first and comment pings while idle.",
        "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
    },
}
