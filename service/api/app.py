"""The FastAPI application factory. Tests build their own app with ``create_app(settings, url)``."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import (
    routes_archive,
    routes_handoffs,
    routes_inspector,
    routes_questions,
    routes_sessions,
)
from service.api.deps import TokenFirst
from service.api.errors import (
    UNAVAILABLE_RETRY_AFTER_S,
    ApiError,
    error_response,
    install_error_handlers,
    service_unavailable,
)
from service.api.event_hub import EventHub
from service.api.fast_admission import AdmissionFastPath
from service.api.in_process import InProcessWorker
from service.api.metrics import Metrics
from service.api.routes_common import errors
from service.api.stream_tokens import stream_secret
from service.api.strict_input import StrictJsonBodies, Utf8Paths
from service.archive.schema import OPENAPI_REFS, storable_json_defs
from service.config import Settings
from service.store.db import connect
from service.store.listener import Listener
from service.store.schema import head_revision, readiness

# Slack above the snapshot + question limits for the JSON around them; the precise per-field
# limits (413 with the field's own message) are checked by the routes.
BODY_SLACK_BYTES = 1024 * 1024
DRAIN_LIMIT_BYTES = 256 * 1024 * 1024


class BodyLimit:
    """Refuse (413) a request body beyond ``limit`` bytes before reading it all into memory."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send, drain=True)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(more=bool(message.get("more_body", False)))
            return message

        try:
            await self.app(scope, counting_receive, send)
        except BodyTooLarge as refused:
            # Drain only a body still coming: after its last chunk, another receive() would wait for
            # the client to go away, and the 413 would never be sent.
            await self._refuse(scope, receive, send, drain=refused.more)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, *, drain: bool) -> None:
        # Read and discard the rest (bounded) so the client gets the 413 instead of a connection
        # reset while it is still sending.
        drained = 0
        while drain and drained < DRAIN_LIMIT_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                break
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        too_large = f"the request body exceeds {self.limit} bytes"
        close = {"Connection": "close"}
        refusal = ApiError(413, "payload_too_large", too_large, {"limit_bytes": self.limit}, headers=close)
        await error_response(refusal)(scope, receive, send)


@dataclass(eq=False)
class BodyTooLarge(Exception):
    """Raised from inside ``receive`` when a streamed body passes the limit."""

    more: bool  # the chunk that passed it was not the body's last


class RedactStreamTokens(logging.Filter):
    """Defence in depth: if an access log is ever enabled, ``?token=`` values never reach it."""

    _pattern = re.compile(r"(token=)[^&\s\"]+")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, Mapping):  # logging's "%(name)s" style: keep it a mapping
            record.args = {k: self._redact(v) for k, v in record.args.items()}
        elif record.args:
            record.args = tuple(self._redact(a) for a in record.args)
        record.msg = self._redact(record.msg)
        return True

    def _redact(self, value: object) -> object:
        return self._pattern.sub(r"\1[redacted]", value) if isinstance(value, str) else value


def _add_storable_json_components(app: FastAPI) -> None:
    """Put the NUL-free JSON definitions the snapshot and archive schemas refer to into the OpenAPI
    components (pydantic cannot generate a recursive schema for fields typed as plain JSON)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(storable_json_defs(OPENAPI_REFS))
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class SpecErrorCors(CORSMiddleware):
    """Starlette's CORS, but a refused preflight gets SPEC's error body (it answered plain text)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        reason = bytes(response.body).decode("utf-8", "replace")  # "Disallowed CORS origin, method"
        headers = {
            k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")
        }
        return error_response(ApiError(400, "bad_request", f"preflight refused: {reason}", headers=headers))


def _not_ready(message: str, detail: dict[str, Any], **facts: str | None) -> JSONResponse:
    """SPEC §9's 503 ``service_unavailable``, with the error body every route has (SPEC §3) and the
    readiness facts beside it for an operator."""
    error = ApiError(503, "service_unavailable", message, detail)
    return JSONResponse(
        {"error": error.to_error(), "status": "unavailable", **facts},
        status_code=503,
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
    )


def create_app(settings: Settings, database_url: str) -> FastAPI:
    """Build the app. The worker is not part of it: ``sidequest serve`` adds one (``service.serve``)."""
    hub = EventHub()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.db = db = connect(database_url, pooler=settings.database_pooler)
        app.state.listener = listener = Listener(settings.listen_url(database_url), on_connect=db.node_gone)
        hub.attach(listener)
        await listener.start()
        try:
            yield
        finally:
            hub.detach()
            await listener.stop()
            await db.dispose()

    app = FastAPI(
        title="Sidequest",
        version="0.1.0",
        description="Side questions beside a running agent task (see docs/api.md).",
        lifespan=lifespan,
    )
    # Built here rather than in the lifespan so that they exist for any request path.
    app.state.settings = settings
    app.state.hub = hub
    app.state.in_process_worker = InProcessWorker()
    app.state.stream_secret = stream_secret(settings)
    app.state.metrics = Metrics(lambda: hub.streams, calibration_on=settings.calibration_on)
    install_error_handlers(app)
    access_log = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactStreamTokens) for f in access_log.filters):
        access_log.addFilter(RedactStreamTokens())

    # Every route of these routers needs the database: each may answer 503 service_unavailable.
    for router in (routes_sessions.router, routes_questions.router, routes_handoffs.router):
        app.include_router(router, responses=errors(503))
    app.include_router(routes_archive.router, responses=errors(401, 404, 503))
    app.include_router(routes_inspector.router)

    # Innermost of ours: the body limit (and CORS) apply to the fast path too, and only strict JSON
    # bodies reach it or a route.
    app.add_middleware(AdmissionFastPath)
    app.add_middleware(StrictJsonBodies)
    app.add_middleware(Utf8Paths)
    app.add_middleware(
        BodyLimit, limit=settings.max_snapshot_bytes + settings.max_question_bytes + BODY_SLACK_BYTES
    )
    # Outermost of ours (inside CORS): no token, no answer about the input.
    app.add_middleware(TokenFirst, settings=settings)
    origins = settings.cors_origin_list()
    if origins:
        app.add_middleware(
            SpecErrorCors,
            allow_origins=origins,
            allow_methods=["GET", "POST", "PUT", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID"],
            # Retry-After: a browser client must see how long to wait after a 503 or a 429.
            expose_headers=["Location", "Retry-After"],
            max_age=600,
        )

    _add_storable_json_components(app)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"description": "Not ready"}})
    async def readyz() -> JSONResponse:
        """Readiness: the database answers and its schema is at the head revision."""
        head = head_revision()
        try:
            current, writable = await readiness(app.state.db)
        except Exception as exc:  # any driver error means "not ready", never a 500
            unavailable = service_unavailable()
            detail = {**unavailable.detail, "cause": str(exc)[:200]}
            return _not_ready(unavailable.message, detail, database="unreachable")
        if not writable:
            # A standby, or a primary demoted in a failover: reads work, every write would fail.
            message = "the database is read-only (a standby, or a failover in progress)"
            return _not_ready(message, {"read_only": True}, database="read-only", schema=current)
        if current != head:
            message = f"the database schema is at {current}, not at {head}: run `sidequest migrate`"
            detail = {"schema": current, "head": head}
            return _not_ready(message, detail, database="reachable", schema=current, head=head)
        return JSONResponse({"status": "ok", "schema": current})

    @app.get(
        "/metrics",
        tags=["health"],
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus"}
        },
    )
    async def metrics(request: Request) -> Response:
        """Prometheus metrics (no tenant data)."""
        exporter: Metrics = request.app.state.metrics
        body = await exporter.render(request.app.state.db)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
