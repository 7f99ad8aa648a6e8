"""Question routes: one record, its event stream, cancel, stream token."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncSession

from service.api.deps import DbSession, Tenant, database, parse_request_id
from service.api.errors import found
from service.api.routes_common import (
    SSE_RESPONSES,
    AfterParam,
    BearerTenant,
    StreamTokenParam,
    errors,
    resume_point,
    sse_response,
    stream_tenant,
    stream_token_response,
)
from service.api.schemas import MAX_INT32, RequestRecord, StreamToken
from service.api.sse import request_stream
from service.api.stream_tokens import request_stream_name
from service.store import events as events_store
from service.store.admission import cancel_request
from service.store.handoffs import set_pinned
from service.store.sessions import find_request, request_record_for

router = APIRouter(prefix="/v1/questions", tags=["questions"])


@router.get("/{request_id}", response_model=RequestRecord, responses=errors(401, 404, 422))
async def get_question(request_id: str, tenant: Tenant, tx: DbSession) -> JSONResponse:
    """One record: question, status, stage, answer, error, usage, context_info, timings."""
    return JSONResponse(found(await request_record_for(tx, tenant, parse_request_id(request_id)), "question"))


@router.post("/{request_id}/cancel", response_model=RequestRecord, responses=errors(401, 404, 422))
async def cancel_question(request_id: str, tenant: Tenant, tx: DbSession) -> JSONResponse:
    """Cancel a queued or running request; idempotent; a terminal request is returned unchanged."""
    async with tx.begin():
        record = await cancel_request(tx, tenant, parse_request_id(request_id))
    return JSONResponse(found(record, "question"))


@router.post("/{request_id}/pin", response_model=RequestRecord, responses=errors(401, 404, 409, 422))
async def pin_question(request_id: str, tenant: Tenant, tx: DbSession) -> JSONResponse:
    """Pin a succeeded side answer for the next hand-off (SPEC §11.1); idempotent; else 409."""
    return await _set_pinned(tx, tenant, request_id, True)


@router.delete("/{request_id}/pin", response_model=RequestRecord, responses=errors(401, 404, 422))
async def unpin_question(request_id: str, tenant: Tenant, tx: DbSession) -> JSONResponse:
    """Unpin a side answer; idempotent."""
    return await _set_pinned(tx, tenant, request_id, False)


async def _set_pinned(tx: AsyncSession, tenant: str, request_id: str, pinned: bool) -> JSONResponse:
    async with tx.begin():
        record = await set_pinned(tx, tenant, parse_request_id(request_id), pinned)
    return JSONResponse(found(record, "question"))


@router.post("/{request_id}/stream-token", response_model=StreamToken, responses=errors(401, 404, 422))
async def question_stream_token(
    request: Request, request_id: str, tenant: Tenant, tx: DbSession
) -> JSONResponse:
    """A 10-minute token for this request's event stream only (for EventSource, as `?token=`)."""
    rid = parse_request_id(request_id)
    found(await find_request(tx, tenant, rid), "question")
    url = request.url_for("question_events", request_id=str(rid))
    return stream_token_response(request, tenant, request_stream_name(str(rid)), str(url))


@router.get(
    "/{request_id}/events",
    name="question_events",
    response_class=Response,
    responses={
        **SSE_RESPONSES,
        204: {"description": "Resumed at or after the terminal event: nothing more will come."},
        **errors(400, 401, 404, 422),
    },
)
async def question_events(
    request: Request,
    request_id: str,
    bearer: BearerTenant,
    token: StreamTokenParam = None,
    after: AfterParam = None,
) -> Response:
    """SSE stream of one request: replays, then tails live; ends after the terminal event.

    Resume with `Last-Event-ID` (wins) or `?after=` (a per-request `seq`).
    """
    rid = parse_request_id(request_id)
    tenant = stream_tenant(request, bearer, token, request_stream_name(str(rid)))
    db = database(request)
    async with db.sessions() as tx:
        found(await find_request(tx, tenant, rid), "question")
        cursor, _resumed = resume_point(request, after)
        # seq is a 32-bit column: a larger cursor means "after everything" and must not reach SQL.
        cursor = min(cursor, MAX_INT32)
        last = await events_store.terminal_seq(tx, rid) if cursor > 0 else None
    if last is not None and cursor >= last:
        return Response(status_code=204)
    return sse_response(request, request_stream(db, request.app.state.hub, rid, cursor))
