"""Sessions, history pages, request lookups and main snapshots: the read side of the API.

A session is keyed by (tenant, parent_id); every lookup here takes the tenant, so another tenant's
session or request is simply "not found" (SPEC §3: 404, never 403). Requests hidden by a clear
(``deleted_at`` set) are not found either.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import JSON, Text, cast, func, literal, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from service.archive.model import SETTINGS_FIELDS
from service.budget import plan_window, positive_setting, resolve_output_cap, resolve_window
from service.budget.ladder import needs_summary, snapshot_room
from service.budget.messages import snapshot_shape_problem
from service.budget.prepared import (
    PREPARED_VERSION,
    EncodedSnapshot,
    PreparedSnapshot,
    UnstorableSnapshot,
    encode_snapshot,
    prepare_snapshot,
)
from service.config import Settings
from service.errors import SidequestError
from service.store.execute import json_text
from service.store.jobs import background_overviews, enqueue_job
from service.store.models import RequestRow, SessionRow, SnapshotRow
from service.store.records import request_record
from service.vocabulary import JobKind, Status, iso_or_none, masks_tool_results, utc_iso


class SnapshotConflict(SidequestError):
    """A snapshot id already holds other content (snapshots are immutable)."""

    code = "snapshot_conflict"
    status = 409

    def __init__(self, snapshot_id: str) -> None:
        super().__init__(
            f"snapshot {snapshot_id!r} already exists with other content", {"snapshot_id": snapshot_id}
        )
        self.snapshot_id = snapshot_id


class InvalidSnapshot(SidequestError):
    """The snapshot cannot be read as a main-session context (the pipeline could never use it)."""

    code = "invalid_snapshot"
    status = 422


def prepare_or_refuse(content: dict[str, Any], encoded: EncodedSnapshot | None = None) -> PreparedSnapshot:
    """Prepare a snapshot once (normalise, estimate, group, hash: :mod:`service.budget.prepared`).

    Raises :class:`InvalidSnapshot` when the snapshot does not normalise (e.g. a tool that is not an
    object) or is one no provider would take (:func:`snapshot_shape_problem`): refusing it at
    admission is better than failing the request later in the worker.
    """
    problem = snapshot_shape_problem(content)
    if problem is not None:
        raise InvalidSnapshot(f"snapshot is not a valid main-session context: {problem}")
    try:
        return prepare_snapshot(content, encoded)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise InvalidSnapshot(f"snapshot is not a valid main-session context: {exc}") from None


def encode_or_refuse(content: dict[str, Any]) -> EncodedSnapshot:
    """:func:`service.budget.prepared.encode_snapshot`, refusing (422 ``invalid_snapshot``) what
    PostgreSQL could not store or the pipeline could not use."""
    try:
        return encode_snapshot(content)
    except UnstorableSnapshot as exc:
        raise InvalidSnapshot(str(exc)) from None


async def find_session(session: AsyncSession, tenant: str, parent_id: str) -> SessionRow | None:
    """The tenant's session for ``parent_id``, or None."""
    return await session.scalar(
        select(SessionRow).where(SessionRow.tenant == tenant, SessionRow.parent_id == parent_id)
    )


async def lock_or_create_session(session: AsyncSession, tenant: str, parent_id: str) -> SessionRow:
    """Get-or-create the session and lock its row (``FOR NO KEY UPDATE``) for the caller's transaction.

    The lock serialises ordinal assignment, the queued-count check and idempotency lookups of one
    session; callers keep that transaction short. It is ``NO KEY UPDATE``, not ``UPDATE``: a worker
    appending an event holds the session's event advisory lock and then inserts a row whose foreign
    key takes ``KEY SHARE`` on this session row; ``FOR UPDATE`` would block that insert while this
    transaction waits for the same advisory lock (events of its own), a deadlock PostgreSQL breaks
    by failing one side (a 500 on admission).
    """
    await session.execute(
        pg_insert(SessionRow)
        .values(id=uuid.uuid4(), tenant=tenant, parent_id=parent_id)
        .on_conflict_do_nothing(constraint="uq_sessions_tenant_parent")
    )
    row = await session.scalar(
        select(SessionRow)
        .where(SessionRow.tenant == tenant, SessionRow.parent_id == parent_id)
        .with_for_update(key_share=True)
        .execution_options(populate_existing=True)
    )
    assert row is not None  # inserted or already there, and sessions are never deleted here
    return row


async def lock_session(session: AsyncSession, tenant: str, parent_id: str) -> SessionRow | None:
    """Lock an existing session row (``FOR NO KEY UPDATE``, see :func:`lock_or_create_session`); None
    when the tenant has no such session."""
    return await session.scalar(
        select(SessionRow)
        .where(SessionRow.tenant == tenant, SessionRow.parent_id == parent_id)
        .with_for_update(key_share=True)
        .execution_options(populate_existing=True)
    )


async def find_request(
    session: AsyncSession, tenant: str, request_id: uuid.UUID
) -> tuple[RequestRow, SessionRow] | None:
    """A visible (not cleared) request of the tenant, with its session; None otherwise."""
    found = (
        await session.execute(
            select(RequestRow, SessionRow)
            .join(SessionRow, SessionRow.id == RequestRow.session_id)
            .where(
                RequestRow.id == request_id,
                RequestRow.deleted_at.is_(None),
                SessionRow.tenant == tenant,
            )
            .execution_options(populate_existing=True)
        )
    ).first()
    if found is None:
        return None
    return found[0], found[1]


async def request_record_for(
    session: AsyncSession, tenant: str, request_id: uuid.UUID
) -> dict[str, Any] | None:
    """The public record of a visible request of the tenant, or None."""
    found = await find_request(session, tenant, request_id)
    if found is None:
        return None
    row, owner = found
    return request_record(row, owner.parent_id)


async def status_counts(session: AsyncSession, session_id: uuid.UUID) -> dict[str, int]:
    """Visible requests of a session by status (every status present, 0 when none)."""
    return (await status_counts_of(session, [session_id]))[session_id]


async def status_counts_of(
    session: AsyncSession, session_ids: list[uuid.UUID]
) -> dict[uuid.UUID, dict[str, int]]:
    """:func:`status_counts` of several sessions in one query (every id present in the result)."""
    result: dict[uuid.UUID, dict[str, int]] = {sid: dict.fromkeys(Status, 0) for sid in session_ids}
    if not session_ids:
        return result
    rows = await session.execute(
        select(RequestRow.session_id, RequestRow.status, func.count())
        .where(RequestRow.session_id.in_(session_ids), RequestRow.deleted_at.is_(None))
        .group_by(RequestRow.session_id, RequestRow.status)
    )
    for session_id, status, count in rows:
        result[session_id][status] = int(count)
    return result


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def memory_overview(memory: dict[str, Any] | None) -> dict[str, Any]:
    """SPEC's memory overview from the memory JSONB: coverage and cache keys, never the documents."""
    memory = memory or {}
    qa = memory.get("qa_summary")
    qa_view = None
    if isinstance(qa, dict):
        qa_view = {
            "first_ordinal": _int_or_none(qa.get("first_ordinal")),
            "covered_through_ordinal": _int_or_none(qa.get("covered_through_ordinal")),
            "tokens": _int_or_none(qa.get("tokens")),
            "updated_at": _str_or_none(qa.get("updated_at")),
        }
    summaries = []
    for item in memory.get("context_summaries") or []:
        if not isinstance(item, dict):
            continue
        summaries.append(
            {
                "key": _str_or_none(item.get("key")),
                "snapshot_id": _str_or_none(item.get("snapshot_id")),
                "covered_messages": _int_or_none(item.get("covered_messages")),
                "tokens": _int_or_none(item.get("tokens")),
                "created_at": _str_or_none(item.get("created_at")),
            }
        )
    return {"qa_summary": qa_view, "context_summaries": summaries}


async def read_one_snapshot(session: AsyncSession) -> None:
    """Make the reads of ``session``'s next transaction see one snapshot of the database: under READ
    COMMITTED an admission committing between a session row's read and its counts' showed counts
    beyond ``next_ordinal``. REPEATABLE READ is set on the transaction's own BEGIN
    (no statement of its own); a no-op when the transaction has begun already."""
    if not session.in_transaction():
        await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})


async def session_overview(session: AsyncSession, tenant: str, parent_id: str) -> dict[str, Any] | None:
    """SPEC's session object, or None when the tenant has no session for ``parent_id``; its parts
    read from one snapshot."""
    await read_one_snapshot(session)
    row = await find_session(session, tenant, parent_id)
    if row is None:
        return None
    return (await session_overviews(session, [row]))[0]


async def session_overviews(session: AsyncSession, rows: list[SessionRow]) -> list[dict[str, Any]]:
    """SPEC's session object for each of ``rows``, in their order, with one query per kind of data.

    The one builder of the session object: ``GET /v1/sessions/{parent_id}`` and the list
    ``GET /v1/sessions`` both come here, so a field added to the overview appears in both. Data
    that needs another table is loaded for every row at once (never one query per session).
    """
    ids = [row.id for row in rows]
    counts = await status_counts_of(session, ids)
    background = await background_overviews(session, ids)
    return [
        {
            "parent_id": row.parent_id,
            "clear_version": row.clear_version,
            "next_ordinal": row.next_ordinal,
            "handed_off_through": row.handed_off_through,
            "settings": {name: (row.settings or {}).get(name) for name in SETTINGS_FIELDS},
            "counts": counts[row.id],
            "background": background[row.id],
            "memory": memory_overview(row.memory),
            "created_at": iso_or_none(row.created_at),
            "updated_at": iso_or_none(row.updated_at),
        }
        for row in rows
    ]


async def history_page(
    session: AsyncSession, tenant: str, parent_id: str, *, limit: int, before: int | None
) -> dict[str, Any] | None:
    """The newest ``limit`` visible requests with ordinal < ``before``, in ascending ordinal.

    ``next_before`` is the smallest ordinal of the page when older requests remain (pass it as
    ``before`` for the previous page), else None. None when the session does not exist.
    """
    owner = await find_session(session, tenant, parent_id)
    if owner is None:
        return None
    query = select(RequestRow).where(RequestRow.session_id == owner.id, RequestRow.deleted_at.is_(None))
    if before is not None:
        query = query.where(RequestRow.ordinal < before)
    rows = list(await session.scalars(query.order_by(RequestRow.ordinal.desc()).limit(limit + 1)))
    has_more = len(rows) > limit
    page = list(reversed(rows[:limit]))
    return {
        "items": [request_record(r, owner.parent_id) for r in page],
        "has_more": has_more,
        "next_before": page[0].ordinal if has_more and page else None,
    }


@dataclass(frozen=True)
class SnapshotJobPolicy:
    """When storing a snapshot queues a background context summary (SPEC §6.6, second trigger).

    ``enabled`` is ``SIDEQUEST_BACKGROUND_SUMMARIES=on``; the window and cap are the service's
    defaults, used after the session's settings and the snapshot's own numbers (SPEC §5 order).
    ``expecting``, when set, is told of a snapshot whose job will be queued, before the snapshot is
    written (``sidequest serve``: the worker of this process renders the summary's material while
    the database stores it).
    """

    enabled: bool
    context_window: int | None
    max_output_tokens: int
    expecting: Callable[[PreparedSnapshot], None] | None = None

    @classmethod
    def of(
        cls, settings: Settings, expecting: Callable[[PreparedSnapshot], None] | None = None
    ) -> SnapshotJobPolicy:
        """The service's part, from its settings (the session's come from its row)."""
        return cls(
            enabled=settings.background_on,
            context_window=settings.context_window,
            max_output_tokens=settings.max_output_tokens,
            expecting=expecting,
        )

    def considers(self, owner: SessionRow) -> bool:
        """Whether a snapshot stored for the session ``owner`` is weighed for a job at all (SPEC §6.6):
        background summaries on and the session asked before. It then queues one when
        :meth:`needs_summary` says a question on it would need a summary (tier 2: masking needs none)."""
        return self.enabled and owner.next_ordinal > 1

    def needs_summary(self, prepared: PreparedSnapshot, owner: SessionRow, expected: dict[str, int]) -> bool:
        """Would a question on this snapshot need a summary, with the session's expected numbers?

        The snapshot alone is the test (its system, tools and messages against the input budget): the
        question and the side Q&A only add to it, and a job that turns out not to be needed ends
        with no call. The raw estimate: the admission reads no calibration; the job decides again
        with the ratio.
        """
        window = resolve_window(
            expected.get("context_window"), prepared.snapshot.context_window, self.context_window
        )
        cap = resolve_output_cap(
            expected.get("max_output_tokens"), self.max_output_tokens, prepared.snapshot.max_output_tokens
        )
        room = snapshot_room(prepared, plan_window(window, cap).input_budget)
        return needs_summary(prepared, room, mask=masks_tool_results(owner.settings or {}))


def expected_numbers(
    session_settings: dict[str, Any], latest_options: dict[str, Any] | None
) -> dict[str, int]:
    """SPEC §6.6: the window and output cap a question on a newly stored snapshot is expected to have —
    the session's settings, else those of the session's latest question (a chat UI that sends its
    model's window with every question and never writes settings), else none (the snapshot's own,
    then the service's, follow)."""
    expected: dict[str, int] = {}
    for name in ("context_window", "max_output_tokens"):
        value = positive_setting(session_settings.get(name)) or positive_setting(
            (latest_options or {}).get(name)
        )
        if value is not None:
            expected[name] = value
    return expected


async def latest_question_options(session: AsyncSession, session_id: uuid.UUID) -> dict[str, Any] | None:
    """The options the session's latest question was admitted with (None: it has asked none)."""
    options = await session.scalar(
        select(RequestRow.options)
        .where(RequestRow.session_id == session_id)
        .order_by(RequestRow.ordinal.desc())
        .limit(1)
    )
    return dict(options) if options is not None else None


async def queue_snapshot_job(
    session: AsyncSession, owner: SessionRow, snapshot_id: str, expected: dict[str, int]
) -> uuid.UUID | None:
    """Queue the snapshot's background context summary (caller's transaction), once
    :meth:`SnapshotJobPolicy.needs_summary` said SPEC §6.6 wants it; None when it is queued already. The
    job plans with the ``expected`` numbers the decision was made with."""
    return await enqueue_job(
        session,
        owner.id,
        kind=JobKind.CONTEXT_SUMMARY,
        key=f"snapshot:{snapshot_id}",
        params={"snapshot_id": snapshot_id, **expected},
        clear_version=owner.clear_version,
    )


@dataclass(frozen=True)
class StoredSnapshot:
    """What a snapshot write or read reports back (never the content itself)."""

    snapshot_id: str
    content_hash: str
    token_estimate: int
    size_bytes: int
    created_at: str
    created: bool

    def public(self) -> dict[str, Any]:
        """The API view of the snapshot."""
        return {
            "snapshot_id": self.snapshot_id,
            "content_hash": self.content_hash,
            "token_estimate": self.token_estimate,
            "size_bytes": self.size_bytes,
            "created_at": self.created_at,
            "created": self.created,
        }


def posted_json(content: dict[str, Any], encoded: EncodedSnapshot) -> str:
    """``content`` as compact JSON text in its posted key order, for the ``json`` column.

    orjson writes it in ~1 ms where ``json.dumps`` takes ~8 ms for 600 KB (on the inline
    admission's path); the same JSON value, not always the same bytes (it writes ``1e16`` for ``1e+16``).
    An encoded snapshot holds no non-finite number (``encode_snapshot`` refuses one: orjson would
    write null); an integer beyond 64 bits, which orjson refuses, goes the ``json.dumps`` way.
    """
    try:
        return orjson.dumps(content).decode("utf-8")
    except TypeError:  # orjson.JSONEncodeError: an integer beyond 64 bits, say
        return json_text(content)


async def store_snapshot(
    session: AsyncSession,
    session_id: uuid.UUID,
    snapshot_id: str | None,
    content: dict[str, Any],
    *,
    owner: SessionRow | None = None,
    jobs: SnapshotJobPolicy | None = None,
    encoded: EncodedSnapshot | None = None,
    prepared: PreparedSnapshot | None = None,
) -> StoredSnapshot:
    """Store ``content`` under ``snapshot_id`` (or its content hash) in the caller's transaction.

    Idempotent for identical content; raises :class:`SnapshotConflict` when the id already holds
    other content and :class:`InvalidSnapshot` when the snapshot cannot be read. A newly stored
    snapshot is prepared once (:mod:`service.budget.prepared`) and, given the session row ``owner``
    and a ``jobs`` policy, may queue its background context summary (SPEC §6.6).

    ``encoded`` is the snapshot encoded once by the caller (:func:`encode_or_refuse`, which the API
    needs for its size check first): its bytes give the content hash, the size, the prefix digests
    and the stored JSON, so a 600 KB snapshot is serialised once, not five times. ``prepared`` is its
    preparation when the caller made it already (the API, which shares it with its worker at once).
    """
    if encoded is None:
        encoded = encode_or_refuse(content)
    digest = encoded.content_hash
    key = snapshot_id or digest
    size = encoded.size
    if prepared is None:
        prepared = prepare_or_refuse(content, encoded)
    tokens = prepared.total_tokens
    expected: dict[str, int] = {}
    queues_job = False
    if owner is not None and jobs is not None and jobs.considers(owner):
        expected = expected_numbers(
            dict(owner.settings or {}), await latest_question_options(session, owner.id)
        )
        queues_job = jobs.needs_summary(prepared, owner, expected)
    if queues_job and jobs is not None and jobs.expecting is not None:
        jobs.expecting(prepared)  # before the INSERT: the longest wait of the admission
    inserted = await session.scalar(
        pg_insert(SnapshotRow)
        .values(
            session_id=session_id,
            snapshot_id=key,
            # As posted, key order kept (json, not jsonb), as text cast by PostgreSQL.
            content=cast(literal(posted_json(content, encoded), Text()), JSON),
            content_hash=digest,
            token_estimate=tokens,
            size_bytes=size,
            # Already-encoded JSON text, cast by PostgreSQL: the driver would serialise it again.
            prepared=cast(literal(prepared.to_json_text(encoded), Text()), JSON),
            prepared_version=PREPARED_VERSION,
        )
        .on_conflict_do_nothing(index_elements=["session_id", "snapshot_id"])
        .returning(SnapshotRow.created_at)
    )
    if inserted is not None:
        if queues_job and owner is not None:
            await queue_snapshot_job(session, owner, key, expected)
        return StoredSnapshot(key, digest, tokens, size, utc_iso(inserted), created=True)
    existing = (
        await session.execute(
            select(
                SnapshotRow.content_hash,
                SnapshotRow.token_estimate,
                SnapshotRow.size_bytes,
                SnapshotRow.created_at,
            ).where(SnapshotRow.session_id == session_id, SnapshotRow.snapshot_id == key)
        )
    ).one()
    if existing.content_hash != digest:
        raise SnapshotConflict(key)
    return StoredSnapshot(
        key, digest, existing.token_estimate, existing.size_bytes, utc_iso(existing.created_at), created=False
    )
