"""Session settings (SPEC §11.2) and hand-offs (SPEC §11.1): parse, call the store, map (the rules are
:mod:`service.archive.model`'s, :mod:`service.store.handoffs`' and :mod:`service.budget.handoff`'s)."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse

from service.api.deps import DbSession, Tenant
from service.api.errors import found
from service.api.routes_common import ParentId, errors
from service.api.routes_sessions import IdempotencyKey
from service.api.schemas import (
    Handoff,
    HandoffIn,
    HandoffPage,
    SessionSettingsOut,
)
from service.archive.model import SessionSettingsIn
from service.store.handoffs import HandoffAsk, create_handoff, list_handoffs
from service.store.settings import read_settings, update_settings
from service.vocabulary import content_hash

router = APIRouter(prefix="/v1/sessions", tags=["hand-offs and settings"])


@router.put("/{parent_id}/settings", response_model=SessionSettingsOut, responses=errors(400, 401, 422))
async def put_settings(
    parent_id: ParentId, body: SessionSettingsIn, tenant: Tenant, tx: DbSession
) -> JSONResponse:
    """Change the named settings (`null` clears one); creates the session if needed.

    Returns the whole settings object, unset fields null. A refused PUT writes nothing.
    """
    async with tx.begin():
        settings = await update_settings(tx, tenant, parent_id, body)
    return JSONResponse(settings)


@router.get("/{parent_id}/settings", response_model=SessionSettingsOut, responses=errors(401, 404, 422))
async def get_settings(parent_id: ParentId, tenant: Tenant, tx: DbSession) -> JSONResponse:
    """The session's settings (unset fields null)."""
    return JSONResponse(found(await read_settings(tx, tenant, parent_id), "session"))


@router.post(
    "/{parent_id}/handoffs",
    status_code=201,
    response_model=Handoff,
    responses={
        200: {
            "model": Handoff,
            "description": "Nothing to hand off (`ordinals: []`, nothing recorded), or an idempotent replay.",
        },
        **errors(400, 401, 404, 409, 422),
    },
)
async def post_handoff(
    request: Request,
    parent_id: ParentId,
    tenant: Tenant,
    tx: DbSession,
    idempotency_key: IdempotencyKey = None,
    body: Annotated[HandoffIn | None, Body()] = None,
) -> JSONResponse:
    """Hand side findings back to the main conversation: one deterministic user message (201).

    `Idempotency-Key`: same key + same body → the original hand-off (200); other body → 409.
    """
    body = body or HandoffIn()
    body_hash = None
    if idempotency_key is not None:
        raw = await request.body()
        # The vocabulary's content hash (key order and whitespace aside), as an admission's body has.
        body_hash = content_hash(json.loads(raw if raw.strip() else b"{}"))
    ask = HandoffAsk(
        format=body.format,
        max_tokens=body.max_tokens,
        include=body.include,
        ordinals=tuple(sorted(set(body.ordinals))) if body.ordinals is not None else None,
        idempotency_key=idempotency_key,
        body_hash=body_hash,
    )
    async with tx.begin():
        outcome = found(await create_handoff(tx, tenant, parent_id, ask), "session")
    return JSONResponse(outcome.handoff, status_code=201 if outcome.created else 200)


@router.get("/{parent_id}/handoffs", response_model=HandoffPage, responses=errors(400, 401, 404, 422))
async def get_handoffs(
    parent_id: ParentId,
    tenant: Tenant,
    tx: DbSession,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    before: Annotated[
        str | None,
        Query(
            description="`next_before` of the previous page (a hand-off id); anything else → 400 "
            "`invalid_cursor`, an id of no hand-off here → an empty page.",
            json_schema_extra={"format": "uuid"},
        ),
    ] = None,
) -> JSONResponse:
    """Earlier hand-offs, newest first, paginated like history."""
    page = await list_handoffs(tx, tenant, parent_id, limit=limit, before=before)
    return JSONResponse(found(page, "session"))
