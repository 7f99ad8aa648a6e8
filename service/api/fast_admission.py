"""The admission's fast path: a plain, valid ``POST /v1/sessions/{parent_id}/questions`` without FastAPI's
per-request machinery (docs/architecture.md, "Data flow", step 1). It accepts only what the route would
accept and runs the route's own body, :func:`~service.api.routes_sessions.admit_question`, so the contract
has one home, the route; anything else (any doubt, any error, a repeated header) it declines, and the app
handles the request from the body read here and replayed."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api import routes_sessions
from service.api.deps import bearer_scheme, bearer_tenant
from service.api.errors import media_type
from service.api.routes_common import path_id
from service.api.routes_sessions import IDEMPOTENCY_KEY_MAX, admit_question
from service.api.schemas import QuestionIn
from service.api.strict_input import read_body, replaying
from service.vocabulary import MAX_PARENT_ID_CHARS


def _route_path() -> re.Pattern[str]:
    """The route's own path (its router's prefix included), with Starlette's ``str`` convertor."""
    (path,) = {
        route.path
        for route in routes_sessions.router.routes
        if isinstance(route, APIRoute) and route.endpoint is routes_sessions.post_question
    }
    return re.compile(re.escape(path).replace(re.escape("{parent_id}"), "(?P<parent_id>[^/]+)"))


_PATH = _route_path()


class AdmissionFastPath:
    """ASGI middleware; see the module docstring. Sits inside BodyLimit (the size limit comes first)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.taken = 0  # requests answered here (the tests read both counters)
        self.declined = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = None
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            match = _PATH.fullmatch(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client went away while sending
            return
        replay = replaying(body, receive)
        if await self._admit(scope, replay, send, match["parent_id"], body):
            self.taken += 1
            return
        self.declined += 1
        await self.app(scope, replay, send)

    async def _admit(self, scope: Scope, receive: Receive, send: Send, parent_id: str, body: bytes) -> bool:
        """Answer the request and return True, or return False (having sent nothing) to decline."""
        try:
            accepted = _accept(scope, parent_id, body)
        except Exception:  # any doubt at all: the app's to answer
            return False
        if accepted is None:
            return False
        question, parsed, key = accepted
        request = Request(scope, receive)
        # The route's own scheme and rule: None where the route would answer 401.
        tenant = await bearer_tenant(request, await bearer_scheme(request))
        if tenant is None:
            return False
        try:
            response: Response = await admit_question(request, parent_id, question, tenant, key, parsed)
        except Exception as exc:
            response = await _handled(scope["app"], request, exc)
        await response(scope, receive, send)
        return True


def _accept(
    scope: Scope, parent_id: str, body: bytes
) -> tuple[QuestionIn, dict[str, Any], str | None] | None:
    """The route's arguments when the route would accept the request as it is; None, or an exception,
    when not (the caller declines either way)."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in headers:
            return None  # a repeated header: the app decides what it means
        headers[name] = value
    if media_type(headers.get(b"content-type", b"")) != b"application/json":
        return None  # another JSON media type: the route's own parsing
    if not 1 <= len(parent_id) <= MAX_PARENT_ID_CHARS:
        return None
    path_id("parent_id", parent_id)  # raises where the route refuses the id: the caller declines
    key: str | None = None
    if b"idempotency-key" in headers:
        key = headers[b"idempotency-key"].decode("latin-1")  # as Starlette decodes header values
        if not 1 <= len(key) <= IDEMPOTENCY_KEY_MAX:
            return None
    # Strict JSON already (StrictJsonBodies sits outside): Python's parser reads it the same. A body
    # QuestionIn refuses (a non-object among them), or one nested too deep to parse, raises.
    parsed = json.loads(body)
    return QuestionIn.model_validate(parsed), parsed, key


async def _handled(app: Any, request: Request, exc: Exception) -> Response:
    """The app's own exception handler for ``exc`` (the nearest registered class in its MRO)."""
    for cls in type(exc).__mro__:
        handler = app.exception_handlers.get(cls)
        if handler is not None:
            response: Response = await handler(request, exc)
            return response
    raise exc


def fast_path_of(app: Any) -> AdmissionFastPath | None:
    """The app's fast path, once its middleware stack is built (its first request)."""
    layer = getattr(app, "middleware_stack", None)
    while layer is not None:
        if isinstance(layer, AdmissionFastPath):
            return layer
        layer = getattr(layer, "app", None)
    return None
