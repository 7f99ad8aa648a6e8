"""Session routes: the tenant's sessions, admit a question, history, clear, snapshots, one session's
overview, its stream."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from service.api.deps import DbSession, Tenant, database, settings_of
from service.api.errors import ApiError, found, validation_error
from service.api.in_process import in_process_worker
from service.api.metrics import Metrics
from service.api.routes_common import (
    SSE_RESPONSES,
    AfterParam,
    BearerTenant,
    ParentId,
    StreamTokenParam,
    errors,
    path_id,
    resume_point,
    sse_response,
    stream_tenant,
    stream_token_response,
)
from service.api.schemas import (
    MAX_INT32,
    Cleared,
    HistoryPage,
    QuestionIn,
    RequestRecord,
    SessionOut,
    SessionPage,
    Snapshot,
    SnapshotStored,
    StreamToken,
)
from service.api.sse import session_stream
from service.api.stream_tokens import session_stream_name
from service.archive.model import NO_NUL
from service.budget.prepared import EncodedSnapshot, PreparedSnapshot
from service.store import events as events_store
from service.store.admission import Admission, admit, clear_session
from service.store.session_list import Cursor, sessions_page
from service.store.sessions import (
    SnapshotJobPolicy,
    encode_or_refuse,
    find_session,
    history_page,
    lock_or_create_session,
    prepare_or_refuse,
    session_overview,
    store_snapshot,
)
from service.vocabulary import MAX_SNAPSHOT_ID_CHARS, content_hash

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


@router.get("", response_model=SessionPage, responses=errors(400, 401, 422))
async def list_sessions(
    tenant: Tenant,
    tx: DbSession,
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
    # InvalidCursor: 400 invalid_cursor, through the one handler.
    cursor = Cursor.decode(before) if before is not None else None
    return JSONResponse(await sessions_page(tx, tenant, limit=limit, before=cursor))


IDEMPOTENCY_KEY_MAX = 300

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=IDEMPOTENCY_KEY_MAX,
        description="Same key + same body → the original record (200); same key + other body → 409.",
    ),
]


def _too_large(code: str, what: str, size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        code,
        f"{what} is {size} bytes of UTF-8; the limit is {limit} bytes",
        {"size_bytes": size, "limit_bytes": limit},
    )


@router.post(
    "/{parent_id}/questions",
    status_code=202,
    response_model=RequestRecord,
    responses={
        200: {"model": RequestRecord, "description": "Idempotent replay: the original record."},
        **errors(400, 401, 404, 409, 413, 422, 429),
    },
)
async def post_question(
    request: Request,
    parent_id: ParentId,
    body: QuestionIn,
    tenant: Tenant,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    """Admit a question → 202 with the record (`status: queued`). Never waits for a worker.

    A `snapshot_id` the session does not have → 404 `snapshot_missing`. `on_busy` (or the session's
    setting) decides what happens while the session has queued or running requests: `enqueue`
    (default), `reject` (409 `session_busy`) or `interrupt` (they end `cancelled`, code `superseded`).
    """
    return await admit_question(request, parent_id, body, tenant, idempotency_key)


async def admit_question(
    request: Request,
    parent_id: str,
    body: QuestionIn,
    tenant: str,
    idempotency_key: str | None,
    parsed: dict[str, Any] | None = None,
) -> JSONResponse:
    """The admission itself, once the parameters are valid: the route's body, and what
    :mod:`service.api.fast_admission` calls for a request it could validate without FastAPI. ``parsed``:
    the body's JSON when the caller parsed it already, strictly (no NaN, no Infinity)."""
    settings = settings_of(request)
    size = len(body.question.encode("utf-8"))
    if size > settings.max_question_bytes:
        raise _too_large("question_too_large", "the question", size, settings.max_question_bytes)
    if body.snapshot_id is not None and body.snapshot is not None:
        raise validation_error(
            ["body", "snapshot"], "send either snapshot_id or an inline snapshot, not both"
        )
    # The JSON FastAPI already parsed (Starlette caches it), not a second parse of the bytes.
    if parsed is None:
        parsed = await request.json()
    # A dict: QuestionIn validated it as a Snapshot.
    inline = parsed["snapshot"] if body.snapshot is not None else None
    encoded, prepared = _prepare_snapshot(request, inline) if inline is not None else (None, None)
    options = {
        name: value
        for name in ("model", "context_window", "max_output_tokens", "main_max_output_tokens")
        if (value := getattr(body, name)) is not None
    }
    admission = Admission(
        question=body.question,
        snapshot_id=body.snapshot_id,
        snapshot=inline,
        snapshot_encoding=encoded,
        snapshot_prepared=prepared,
        options=options,
        idempotency_key=idempotency_key,
        # Key-sorted compact JSON: the same body in another key order or spacing hashes the same.
        body_hash=content_hash(parsed) if idempotency_key is not None else None,
        on_busy=body.on_busy,
        snapshot_jobs=_snapshot_jobs(request),
    )
    admitted = await admit(
        database(request), tenant, parent_id, admission, max_queued=settings.max_queued_per_session
    )
    if admitted.created:
        metrics: Metrics = request.app.state.metrics
        metrics.admitted.inc()
    return JSONResponse(
        admitted.record,
        status_code=202 if admitted.created else 200,
        headers={"Location": f"/v1/questions/{admitted.record['id']}"},
    )


@router.get("/{parent_id}/questions", response_model=HistoryPage, responses=errors(401, 404, 422))
async def get_history(
    parent_id: ParentId,
    tenant: Tenant,
    tx: DbSession,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    before: Annotated[int | None, Query(ge=1, le=MAX_INT32, description="Only ordinals below this.")] = None,
) -> JSONResponse:
    """History page: the newest `limit` requests with ordinal < `before`, in ascending ordinal."""
    page = await history_page(tx, tenant, parent_id, limit=limit, before=before)
    return JSONResponse(found(page, "session"))


@router.delete("/{parent_id}/questions", response_model=Cleared, responses=errors(401, 404, 422))
async def clear_questions(parent_id: ParentId, tenant: Tenant, tx: DbSession) -> JSONResponse:
    """Clear: cancel queued/running requests, delete history and memory, bump `clear_version`."""
    async with tx.begin():
        result = await clear_session(tx, tenant, parent_id)
    return JSONResponse(found(result, "session"))


async def _snapshot_id(
    snapshot_id: Annotated[
        str, Path(min_length=1, max_length=MAX_SNAPSHOT_ID_CHARS, json_schema_extra=NO_NUL)
    ],
) -> str:
    return path_id("snapshot_id", snapshot_id)


@router.put(
    "/{parent_id}/snapshots/{snapshot_id}",
    response_model=SnapshotStored,
    responses={
        201: {"model": SnapshotStored, "description": "Stored."},
        **errors(400, 401, 409, 413, 422),
    },
)
async def put_snapshot(
    request: Request,
    parent_id: ParentId,
    snapshot_id: Annotated[str, Depends(_snapshot_id)],
    body: Snapshot,
    tenant: Tenant,
    tx: DbSession,
) -> JSONResponse:
    """Store a main snapshot: 201 when stored, 200 when the same content was already there.

    Immutable: the same id with other content → 409 `snapshot_conflict`. Content is compared by
    its key-sorted JSON, so key order and whitespace do not matter.
    """
    del body  # validated; the stored content is the JSON as sent (key order kept; strict_input.py)
    content = await request.json()
    encoded, prepared = _prepare_snapshot(request, content)
    async with tx.begin():
        session_row = await lock_or_create_session(tx, tenant, parent_id)
        stored = await store_snapshot(
            tx,
            session_row,
            snapshot_id,
            content,
            jobs=_snapshot_jobs(request),
            encoded=encoded,
            prepared=prepared,
        )
    return JSONResponse(asdict(stored), status_code=201 if stored.created else 200)


def _prepare_snapshot(request: Request, content: dict[str, Any]) -> tuple[EncodedSnapshot, PreparedSnapshot]:
    """A snapshot's encoding (413 beyond the limit) and its preparation, made once and handed at once to a
    worker in this process (:attr:`InProcessWorker.snapshot_prepared`: no read back from PostgreSQL), even
    if it claims the question before this request resumes after the commit. Safe before the commit: the
    worker keys it by content hash, and a preparation is a pure function of the content."""
    limit = settings_of(request).max_snapshot_bytes
    encoded = encode_or_refuse(content)
    if encoded.size > limit:
        raise _too_large("snapshot_too_large", "the snapshot", encoded.size, limit)
    prepared = prepare_or_refuse(content, encoded)
    hook = in_process_worker(request.app).snapshot_prepared
    if hook is not None:
        hook(encoded.content_hash, prepared)
    return encoded, prepared


def _snapshot_jobs(request: Request) -> SnapshotJobPolicy:
    """The settings' policy for snapshot summary jobs; a worker in this process is told when one will
    be queued (:attr:`InProcessWorker.snapshot_job_expected`), to render its material meanwhile."""
    expecting = in_process_worker(request.app).snapshot_job_expected
    return SnapshotJobPolicy.of(settings_of(request), expecting=expecting)


@router.get("/{parent_id}", response_model=SessionOut, responses=errors(401, 404, 422))
async def get_session(parent_id: ParentId, tenant: Tenant, tx: DbSession) -> JSONResponse:
    """Session: counts, `clear_version`, `next_ordinal`, memory overview."""
    return JSONResponse(found(await session_overview(tx, tenant, parent_id), "session"))


@router.post("/{parent_id}/stream-token", response_model=StreamToken, responses=errors(401, 404, 422))
async def session_stream_token(
    request: Request, parent_id: ParentId, tenant: Tenant, tx: DbSession
) -> JSONResponse:
    """A 10-minute token for this session's event stream only (for EventSource, as `?token=`)."""
    found(await find_session(tx, tenant, parent_id), "session")
    # The id percent-encoded: a "#", "?" or space in it would otherwise end the path early.
    url = request.url_for("session_events", parent_id=quote(parent_id, safe=""))
    return stream_token_response(request, tenant, session_stream_name(parent_id), str(url))


@router.get(
    "/{parent_id}/events",
    name="session_events",
    response_class=Response,
    responses={**SSE_RESPONSES, **errors(400, 401, 404, 422)},
)
async def session_events(
    request: Request,
    parent_id: ParentId,
    bearer: BearerTenant,
    token: StreamTokenParam = None,
    after: AfterParam = None,
) -> Response:
    """SSE stream of every request of the session (ids are global event ids); never ends by itself.

    Resume with `Last-Event-ID` (wins) or `?after=`.
    """
    tenant = stream_tenant(request, bearer, token, session_stream_name(parent_id))
    db = database(request)
    async with db.sessions() as tx:
        session_row = found(await find_session(tx, tenant, parent_id), "session")
        cursor, resumed = resume_point(request, after)
        opened_at = await events_store.database_now(tx)
    return sse_response(
        request,
        session_stream(
            db,
            request.app.state.hub,
            session_row.id,
            cursor,
            resumed=resumed,
            opened_at=opened_at,
            ever_cleared=session_row.cleared_at is not None,
        ),
    )
