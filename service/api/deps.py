"""FastAPI dependencies: the tenant behind a bearer token, and a database session per request; and
:class:`TokenFirst`, which answers 401 before anything else looks at a request."""

from __future__ import annotations

import hmac
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.errors import ApiError, error_response, not_found
from service.config import Settings
from service.store.db import Database

DEFAULT_TENANT = "default"

bearer_scheme = HTTPBearer(
    auto_error=False,
    description="`Authorization: Bearer <token>`; tokens map to tenants (SIDEQUEST_API_TOKENS). "
    "Not required when no tokens are configured.",
)


def unauthorized(message: str = "a valid bearer token is required") -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def tenant_for_token(settings: Settings, token: str | None) -> str | None:
    """The tenant of ``token`` (constant-time compare), DEFAULT_TENANT when auth is off, else None."""
    tokens = settings.tenant_tokens()
    if not tokens:
        return DEFAULT_TENANT
    if not token:
        return None
    found = None
    for known, tenant in tokens.items():
        if hmac.compare_digest(known.encode(), token.encode()):
            found = tenant
    return found


# Dependencies are ``async def`` although they never await: FastAPI runs a plain ``def`` dependency
# in a worker thread, and that hand-off cost a third of admission's CPU (docs/benchmarks.md).
async def bearer_tenant(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> str | None:
    """The tenant of the bearer token if one is sent and valid, else None (the caller decides)."""
    token = credentials.credentials if credentials is not None else None
    return tenant_for_token(request.app.state.settings, token)


async def require_tenant(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> str:
    """The caller's tenant; 401 when tokens are configured and none valid was sent. Calls
    :func:`bearer_tenant` rather than depending on it: every level of dependencies costs FastAPI a
    resolution per request, and this one is on every route (admission's hot path included)."""
    tenant = await bearer_tenant(request, credentials)
    if tenant is None:
        raise unauthorized()
    return tenant


Tenant = Annotated[str, Depends(require_tenant)]


class TokenFirst:
    """ASGI middleware: with tokens configured, a ``/v1`` request without a valid bearer token gets 401
    before its path, query or body is looked at, so an unauthenticated client learns nothing of the
    input rules. A stream's ``?token=`` is left to its route; a CORS preflight never carries a token.
    The routes keep their own check (:data:`Tenant`); the rule's one home is :func:`tenant_for_token`."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.on = bool(settings.tenant_tokens())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and str(scope.get("path", "")).startswith("/v1/")
            and self.on
            and not self._stream_token(scope)
            and tenant_for_token(self.settings, self._bearer(scope)) is None
        ):
            await error_response(unauthorized())(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _bearer(scope: Scope) -> str | None:
        values = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
        if len(values) != 1:
            return None
        scheme, token = get_authorization_scheme_param(values[0].decode("latin-1"))
        return token if scheme.lower() == "bearer" and token else None

    @staticmethod
    def _stream_token(scope: Scope) -> bool:
        """An event stream asked for with ``?token=`` (its route decides whether the token is good)."""
        query = scope.get("query_string", b"").split(b"&")
        return str(scope.get("path", "")).endswith("/events") and any(q.startswith(b"token=") for q in query)


def database(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


async def db_session(request: Request) -> AsyncIterator[AsyncSession]:
    """One AsyncSession for the request, closed (and rolled back if uncommitted) afterwards."""
    async with database(request).sessions() as tx:
        yield tx


DbSession = Annotated[AsyncSession, Depends(db_session)]


def parse_request_id(value: str) -> uuid.UUID:
    """A request id from a path; anything that is not a UUID cannot exist → 404."""
    try:
        return uuid.UUID(value)
    except ValueError:
        raise not_found("question") from None


def settings_of(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings
