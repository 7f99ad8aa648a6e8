"""Session routes: admit a question, history, clear, snapshots, session overview, session stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from service.api.deps import DbSession, Tenant, database, settings_of
from service.api.errors import ApiError, not_found, validation_error
from service.api.in_process import in_process_worker
from service.api.metrics import Metrics
from service.api.routes_common import (
    MAX_INT32,
    SSE_RESPONSES,
    AfterParam,
    BearerTenant,
    ParentId,
    StreamTokenParam,
    errors,
    hub_of,
    path_id,
    resume_point,
    sse_response,
    stream_tenant,
    stream_token_response,
)
from service.api.schemas import (
    NO_NUL,
    Cleared,
    HistoryPage,
    QuestionIn,
    RequestRecord,
    SessionOut,
    Snapshot,
    SnapshotStored,
    StreamToken,
    check_text,
)
from service.api.sse import database_now, session_stream
from service.api.stream_tokens import session_stream as session_stream_name
from service.budget.prepared import EncodedSnapshot, PreparedSnapshot
from service.store.admission import Admission, admit, clear_session
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
from service.vocabulary import content_hash

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

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
    :mod:`service.api.fast_admission` calls for a request it could validate without FastAPI.

    ``parsed``: the body's JSON when the caller parsed it already, strictly (no NaN, no Infinity);
    else it is read from the request (:func:`_parsed_body`)."""
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
        parsed = await _parsed_body(request)
    inline: dict[str, Any] | None = None
    encoded: EncodedSnapshot | None = None
    prepared: PreparedSnapshot | None = None
    if body.snapshot is not None:
        inline = parsed["snapshot"]
        assert isinstance(inline, dict)
        encoded = encode_or_refuse(inline)
        if encoded.size > settings.max_snapshot_bytes:
            raise _too_large("snapshot_too_large", "the snapshot", encoded.size, settings.max_snapshot_bytes)
        prepared = _prepare_and_share(request, inline, encoded)
    if idempotency_key is not None:
        check_text(idempotency_key)
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
        snapshot_jobs=SnapshotJobPolicy.of(settings, expecting=_summary_expected(request)),
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


async def _parsed_body(request: Request) -> Any:
    """The request's JSON as sent (key order kept). Strict already: a body Python's parser reads but
    JSON is not (NaN, UTF-16, a BOM) never gets here (:class:`service.api.strict_input.StrictJsonBodies`)."""
    return await request.json()


@router.get("/{parent_id}/questions", response_model=HistoryPage, responses=errors(401, 404, 422))
async def get_history(
    parent_id: ParentId,
    tenant: Tenant,
    session: DbSession,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    before: Annotated[int | None, Query(ge=1, le=MAX_INT32, description="Only ordinals below this.")] = None,
) -> JSONResponse:
    """History page: the newest `limit` requests with ordinal < `before`, in ascending ordinal."""
    page = await history_page(session, tenant, parent_id, limit=limit, before=before)
    if page is None:
        raise not_found("session")
    return JSONResponse(page)


@router.delete("/{parent_id}/questions", response_model=Cleared, responses=errors(401, 404, 422))
async def clear_questions(parent_id: ParentId, tenant: Tenant, session: DbSession) -> JSONResponse:
    """Clear: cancel queued/running requests, delete history and memory, bump `clear_version`."""
    async with session.begin():
        result = await clear_session(session, tenant, parent_id)
    if result is None:
        raise not_found("session")
    return JSONResponse(result)


async def _snapshot_id(
    snapshot_id: Annotated[str, Path(min_length=1, max_length=500, json_schema_extra=NO_NUL)],
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
    session: DbSession,
) -> JSONResponse:
    """Store a main snapshot: 201 when stored, 200 when the same content was already there.

    Immutable: the same id with other content → 409 `snapshot_conflict`. Content is compared by
    its key-sorted JSON, so key order and whitespace do not matter.
    """
    del body  # validated; the stored content is the raw JSON as sent
    settings = settings_of(request)
    content = await _parsed_body(request)
    assert isinstance(content, dict)
    encoded = encode_or_refuse(content)
    if encoded.size > settings.max_snapshot_bytes:
        raise _too_large("snapshot_too_large", "the snapshot", encoded.size, settings.max_snapshot_bytes)
    prepared = _prepare_and_share(request, content, encoded)
    owner = await lock_or_create_session(session, tenant, parent_id)
    stored = await store_snapshot(
        session,
        owner.id,
        snapshot_id,
        content,
        session_row=owner,
        jobs=SnapshotJobPolicy.of(settings, expecting=_summary_expected(request)),
        encoded=encoded,
        prepared=prepared,
    )
    await session.commit()
    return JSONResponse(stored.public(), status_code=201 if stored.created else 200)


def _prepare_and_share(
    request: Request, content: dict[str, Any], encoded: EncodedSnapshot
) -> PreparedSnapshot:
    """Prepare a snapshot once and hand the preparation to a worker in this process at once
    (``sidequest serve`` sets :attr:`InProcessWorker.snapshot_prepared`), so the question it came
    with, and its background job, need not read 600 KB back from PostgreSQL — even when the worker claims that
    question before this request's own code resumes after the commit. Safe before the commit: the
    worker keys it by content hash, and a preparation is a pure function of the content."""
    prepared = prepare_or_refuse(content, encoded)
    hook = in_process_worker(request.app).snapshot_prepared
    if hook is not None:
        hook(encoded.content_hash, prepared)
    return prepared


def _summary_expected(request: Request) -> Callable[[PreparedSnapshot], None] | None:
    """Whom to tell that a snapshot's background summary will be queued (``sidequest serve`` sets
    :attr:`InProcessWorker.snapshot_job_expected`: its worker renders the summary's material meanwhile)."""
    return in_process_worker(request.app).snapshot_job_expected


@router.get("/{parent_id}", response_model=SessionOut, responses=errors(401, 404, 422))
async def get_session(parent_id: ParentId, tenant: Tenant, session: DbSession) -> JSONResponse:
    """Session: counts, `clear_version`, `next_ordinal`, memory overview."""
    overview = await session_overview(session, tenant, parent_id)
    if overview is None:
        raise not_found("session")
    return JSONResponse(overview)


@router.post("/{parent_id}/stream-token", response_model=StreamToken, responses=errors(401, 404, 422))
async def session_stream_token(
    request: Request, parent_id: ParentId, tenant: Tenant, session: DbSession
) -> JSONResponse:
    """A 10-minute token for this session's event stream only (for EventSource, as `?token=`)."""
    if await find_session(session, tenant, parent_id) is None:
        raise not_found("session")
    return stream_token_response(
        request,
        tenant,
        session_stream_name(parent_id),
        # The id percent-encoded: a "#", "?" or space in it would otherwise end the path early.
        str(request.url_for("session_events", parent_id=quote(parent_id, safe=""))),
    )


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
    async with db.sessions() as session:
        owner = await find_session(session, tenant, parent_id)
    if owner is None:
        raise not_found("session")
    cursor, resumed = resume_point(request, after)
    opened_at = await database_now(db)
    return sse_response(
        request,
        session_stream(
            db,
            hub_of(request),
            owner.id,
            cursor,
            resumed=resumed,
            opened_at=opened_at,
            ever_cleared=owner.cleared_at is not None,
        ),
    )
