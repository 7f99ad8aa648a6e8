"""``GET /v1/sessions``: the tenant's sessions, most recently active first (SPEC §3)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from service.api.deps import DbSession, Tenant
from service.api.routes_common import errors
from service.api.schemas import SessionOut
from service.store.session_list import Cursor, sessions_page

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


class SessionPage(BaseModel):
    """A page of the tenant's sessions, most recently active first."""

    items: list[SessionOut]
    has_more: bool
    next_before: str | None


@router.get("", response_model=SessionPage, responses=errors(400, 401, 422))
async def list_sessions(
    tenant: Tenant,
    session: DbSession,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    before: Annotated[
        str | None,
        # No length bounds: an empty or overlong cursor is one this service did not issue, 400 as on
        # the hand-off list (the refusal quotes at most its first 100 characters).
        Query(description="`next_before` of the previous page (opaque)."),
    ] = None,
) -> JSONResponse:
    """The tenant's sessions, most recently active first: `{items, has_more, next_before}`.

    Each item is the same session object as `GET /v1/sessions/{parent_id}`. Pass `next_before` as
    `before` for the next (older) page; a cursor this service did not issue → 400 `invalid_cursor`.
    """
    cursor = None
    if before is not None:
        cursor = Cursor.decode(before)  # InvalidCursor: 400 invalid_cursor, through the one handler
    return JSONResponse(await sessions_page(session, tenant, limit=limit, before=cursor))
