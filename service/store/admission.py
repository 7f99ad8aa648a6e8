"""Admission, cancel and clear: the API's writes, each one short transaction.

Admission is one statement (``sidequest_admit()``, migration 0003_h12a) on a plain asyncpg
connection: the hot path of the API, and the ORM's object graph cost about ten times the CPU of the
work itself. None of these waits for a worker: admission locks only the session row (which workers
never hold across a model call), cancel and clear write the terminal state themselves and tell a
running worker through ``NOTIFY sidequest_cancel``. A worker's own terminal writes are guarded by
``status = 'running'`` and its lease, so whichever terminal write lands first wins and the other is
a no-op.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import asyncpg
from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.budget.prepared import EncodedSnapshot, PreparedSnapshot
from service.errors import SidequestError
from service.store import queries
from service.store.db import Database, driver_chain
from service.store.events import mark_session_events_cleared, purge_cleared_session_events
from service.store.execute import json_text, notify
from service.store.jobs import cancel_session_jobs
from service.store.models import EMPTY_MEMORY, HandoffRow, RequestRow, SessionRow
from service.store.records import request_record
from service.store.sessions import (
    SnapshotJobPolicy,
    StoredSnapshot,
    lock_or_create_session,
    lock_session,
    store_snapshot,
)
from service.store.terminal import finish_request
from service.vocabulary import (
    CANCEL_CHANNEL,
    CANCELLED_BY_CLEAR,
    CANCELLED_BY_CLIENT,
    Status,
    cancelled_error,
    superseded_error,
)


class QueueFull(SidequestError):
    """The session already has the maximum number of queued requests."""

    code = "queue_full"
    status = 429

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the session already has {limit} queued questions; wait for some to finish",
            {"max_queued": limit},
        )
        self.limit = limit


class SnapshotMissing(SidequestError):
    """The request names a snapshot the session does not have."""

    code = "snapshot_missing"
    status = 404

    def __init__(self, snapshot_id: str) -> None:
        super().__init__(
            f"snapshot {snapshot_id!r} was never stored for this session; PUT it first",
            {"snapshot_id": snapshot_id},
        )
        self.snapshot_id = snapshot_id


class IdempotencyConflict(SidequestError):
    """The Idempotency-Key was used before with a different body."""

    code = "idempotency_conflict"
    status = 409

    def __init__(self, key: str) -> None:
        super().__init__("this Idempotency-Key was already used with a different request body")
        self.key = key


class OrdinalsExhausted(SidequestError):
    """The session's next ordinal would not fit its column: every question number is used.

    Only a restored archive gets there (its ordinals may reach ``MAX_ORDINAL``); PostgreSQL refuses
    the ordinal's increment, and nothing of the admission is written.
    """

    code = "ordinals_exhausted"
    status = 409

    def __init__(self) -> None:
        super().__init__(
            "this session has used every question number; ask under another parent id "
            "(an export of this session restores into any parent id)"
        )


def _ordinal_overflow(exc: BaseException) -> bool:
    """Whether ``exc`` (or a driver error it wraps) is PostgreSQL's "integer out of range", which in
    the admission can only be the session's ``next_ordinal + 1``: every other number is bounded
    before it reaches SQL."""
    return any(isinstance(e, asyncpg.NumericValueOutOfRangeError) for e in driver_chain(exc))


class SessionBusyRejected(SidequestError):
    """``on_busy: reject`` (SPEC 11.2) and the session has a queued or running request."""

    code = "session_busy"
    status = 409

    def __init__(self, queued: int, running: int) -> None:
        super().__init__(
            f"the session is busy ({queued} queued, {running} running) and on_busy is 'reject'; "
            "wait for them to finish, or send on_busy 'enqueue' or 'interrupt'",
            {"queued": queued, "running": running},
        )
        self.queued = queued
        self.running = running


@dataclass(frozen=True)
class Admission:
    """A validated question, ready to be admitted.

    ``on_busy`` None means the session's setting (``settings.on_busy``), else ``enqueue``.
    """

    question: str
    snapshot_id: str | None = None
    snapshot: dict[str, Any] | None = None
    # ``snapshot`` encoded once by the caller (its size check needed it), reused by the store.
    snapshot_encoding: EncodedSnapshot | None = None
    # …and prepared by the caller (which shared it with its worker), so the store does not again.
    snapshot_prepared: PreparedSnapshot | None = None
    options: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None
    body_hash: str | None = None
    # When storing an inline snapshot may queue its background context summary (SPEC §6.6).
    snapshot_jobs: SnapshotJobPolicy | None = None
    on_busy: str | None = None


@dataclass(frozen=True)
class Admitted:
    """The request record, and whether this call created it (False: an idempotent replay).

    ``superseded``: the requests an ``interrupt`` cancelled (ids, in ordinal order).
    """

    record: dict[str, Any]
    created: bool
    superseded: tuple[uuid.UUID, ...] = ()


# The hot path (no inline snapshot) is ``db.admissions`` (admission_batch): ``CALL
# sidequest_admit_now`` for one admission, ``sidequest_admit_many`` for several waiting at once; both
# commit the rows, then send the NOTIFYs in a transaction of their own (a NOTIFY in the writing
# transaction would serialise every admission's commit behind one database-wide lock; see migration
# 0003_h12a). The function itself runs inside a caller's transaction (an inline snapshot stored
# first) and NOTIFYs there (queries.admit_in_transaction). The parameters of all three statements
# (service/store/sql/admission.sql), in this order:
_PARAMS = (
    "tenant",
    "parent_id",
    "request_id",
    "question",
    "snapshot_id",
    "options",
    "model",
    "idempotency_key",
    "body_hash",
    "max_queued",
    "on_busy",
    "superseded",
)


def _arguments(
    tenant: str, parent_id: str, admission: Admission, snapshot_id: str | None, max_queued: int
) -> tuple[Any, ...]:
    request_id = uuid.uuid4()
    return (
        tenant,
        parent_id,
        request_id,
        admission.question,
        snapshot_id,
        json_text(admission.options),
        admission.options.get("model"),
        admission.idempotency_key,
        admission.body_hash,
        max_queued,
        admission.on_busy,
        json_text(superseded_error(request_id)),
    )


def _outcome(
    outcome: str,
    detail: dict[str, Any] | None,
    superseded: list[uuid.UUID] | None,
    request: Mapping[Any, Any] | None,
    parent_id: str,
    admission: Admission,
    snapshot_id: str | None,
) -> Admitted:
    """The call's result as an :class:`Admitted`, or the refusal it stands for, raised."""
    if outcome in ("created", "replay"):
        assert request is not None
        # The row's own columns, so the record is exactly request_record's, like every other read.
        record = request_record(cast(RequestRow, SimpleNamespace(**dict(request))), parent_id)
        return Admitted(record, created=outcome == "created", superseded=tuple(superseded or ()))
    detail = detail or {}
    if outcome == "queue_full":
        raise QueueFull(int(detail["max_queued"]))
    if outcome == "session_busy":
        raise SessionBusyRejected(int(detail["queued"]), int(detail["running"]))
    if outcome == "idempotency_conflict":
        assert admission.idempotency_key is not None
        raise IdempotencyConflict(admission.idempotency_key)
    if outcome == "snapshot_missing":
        assert snapshot_id is not None
        raise SnapshotMissing(snapshot_id)
    raise RuntimeError(f"sidequest_admit returned an unknown outcome {outcome!r}")


async def admit(
    db: Database | AsyncSession, tenant: str, parent_id: str, admission: Admission, *, max_queued: int
) -> Admitted:
    """Admit one question and commit it.

    Given the :class:`Database` (the API's hot path), this is at most one round trip: ``CALL
    sidequest_admit_now(…)`` (migration 0003_h12a), or one ``sidequest_admit_many`` shared with the
    admissions waiting beside it (``db.admissions``, group commit), locks or creates the session, answers an
    idempotent replay, applies on_busy (SPEC 11.2), the queue limit and the snapshot check, and only
    then writes: the cancellations an ``interrupt`` makes, the ordinal, the request and its
    ``queued`` event; it commits, then NOTIFYs. A refusal (raised here as QueueFull,
    SessionBusyRejected, IdempotencyConflict, SnapshotMissing) writes nothing, not even a session
    for a first request.

    An inline snapshot is first stored through :func:`store_snapshot`, then the same SQL function runs
    in that transaction (and NOTIFYs there), which a refusal rolls back. Given an ``AsyncSession``,
    everything runs that way, inside the caller's transaction (a refusal raises: the caller's
    ``session.begin()`` rolls it back).
    """
    try:
        if isinstance(db, AsyncSession):
            return await _admit_in_transaction(db, tenant, parent_id, admission, max_queued=max_queued)
        if admission.snapshot is not None:
            async with db.sessions() as session, session.begin():
                return await _admit_in_transaction(
                    session, tenant, parent_id, admission, max_queued=max_queued
                )
        args = _arguments(tenant, parent_id, admission, admission.snapshot_id, max_queued)
        result = await db.admissions.admit(args)
    except Exception as exc:
        if _ordinal_overflow(exc):
            raise OrdinalsExhausted() from exc
        raise
    return _outcome(
        result.outcome,
        result.detail,
        list(result.superseded),
        result.request,
        parent_id,
        admission,
        admission.snapshot_id,
    )


async def _admit_in_transaction(
    session: AsyncSession, tenant: str, parent_id: str, admission: Admission, *, max_queued: int
) -> Admitted:
    snapshot_id = admission.snapshot_id
    stored: StoredSnapshot | None = None
    if admission.snapshot is not None:
        session_row = await lock_or_create_session(session, tenant, parent_id)
        own_id = admission.snapshot.get("snapshot_id")
        stored = await store_snapshot(
            session,
            session_row.id,
            own_id if isinstance(own_id, str) and own_id else None,
            admission.snapshot,
            owner=session_row,
            jobs=admission.snapshot_jobs,
            encoded=admission.snapshot_encoding,
            prepared=admission.snapshot_prepared,
        )
        snapshot_id = stored.snapshot_id
    args = _arguments(tenant, parent_id, admission, snapshot_id, max_queued)
    params = dict(zip(_PARAMS, args, strict=True))
    params["snapshot_stored"] = admission.snapshot is not None
    row = dict((await session.execute(queries.admit_in_transaction, params)).mappings().one())
    outcome, detail, superseded = row.pop("outcome"), row.pop("detail"), row.pop("superseded")
    request = row if row["id"] is not None else None
    admitted = _outcome(outcome, detail, superseded, request, parent_id, admission, snapshot_id)
    return admitted


async def _cancel(session: AsyncSession, request_id: uuid.UUID, message: str) -> bool:
    """Cancel one queued or running request through THE terminal transition (terminal.finish_request),
    guarded by the status it leaves, and tell its worker; False when it had already ended."""
    ended = await finish_request(
        session,
        request_id,
        status=Status.CANCELLED,
        owner=None,
        from_statuses=(Status.QUEUED, Status.RUNNING),
        error=cancelled_error(message),
    )
    if ended is None:
        return False
    await notify(session, CANCEL_CHANNEL, str(request_id))
    return True


async def cancel_request(session: AsyncSession, tenant: str, request_id: uuid.UUID) -> dict[str, Any] | None:
    """Cancel a queued or running request of the tenant, inside the caller's transaction; None when
    not found.

    Idempotent: a terminal request is returned unchanged. A running one gets its terminal state
    from here at once and its worker is told through ``NOTIFY sidequest_cancel``.
    """
    found = (
        await session.execute(
            select(RequestRow, SessionRow)
            .join(SessionRow, SessionRow.id == RequestRow.session_id)
            .where(RequestRow.id == request_id, RequestRow.deleted_at.is_(None), SessionRow.tenant == tenant)
        )
    ).first()
    if found is None:
        return None
    session_row: SessionRow = found[1]
    # Guarded by the status it is leaving, so a worker finishing at the same moment wins or loses
    # cleanly: exactly one terminal write happens.
    await _cancel(session, request_id, CANCELLED_BY_CLIENT)
    row = await session.scalar(
        select(RequestRow).where(RequestRow.id == request_id).execution_options(populate_existing=True)
    )
    assert row is not None
    return request_record(row, session_row.parent_id)


async def clear_session(session: AsyncSession, tenant: str, parent_id: str) -> dict[str, Any] | None:
    """Clear a session, inside the caller's transaction; None when the tenant has no such session.

    Cancels queued and running requests (their streams end with ``error`` code ``cancelled``),
    hides every request at once (``deleted_at``; a later sweep purges them), resets memory and
    bumps ``clear_version`` so that no late summary write restores anything; deletes the session's
    hand-offs and resets ``handed_off_through`` to 0. Ordinals keep counting; stored snapshots and
    the session's settings are kept.
    """
    session_row = await lock_session(session, tenant, parent_id)
    if session_row is None:
        return None
    candidates = list(
        await session.scalars(
            select(RequestRow.id)
            .where(
                RequestRow.session_id == session_row.id,
                RequestRow.deleted_at.is_(None),
                RequestRow.status.in_((Status.QUEUED, Status.RUNNING)),
            )
            .order_by(RequestRow.ordinal)
        )
    )
    active = [rid for rid in candidates if await _cancel(session, rid, CANCELLED_BY_CLEAR)]
    hidden: Any = await session.execute(
        update(RequestRow)
        .where(RequestRow.session_id == session_row.id, RequestRow.deleted_at.is_(None))
        .values(deleted_at=func.now())
        .execution_options(synchronize_session=False)
    )
    removed = hidden.rowcount
    # Background jobs of the session end too (SPEC §6.6); their late writes are refused anyway.
    await cancel_session_jobs(session, session_row.id)
    # The old history's hand-off and memory events are hidden like its requests' (theirs included).
    await mark_session_events_cleared(session, session_row.id)
    # SPEC §11.1: a clear deletes the hand-offs and resets the mark; settings are kept (§11.2).
    await session.execute(delete(HandoffRow).where(HandoffRow.session_id == session_row.id))
    session_row.handed_off_through = 0
    session_row.memory = dict(EMPTY_MEMORY)
    session_row.clear_version = session_row.clear_version + 1
    session_row.updated_at = func.now()
    await session.flush()
    result = {
        "parent_id": session_row.parent_id,
        "clear_version": session_row.clear_version,
        "next_ordinal": session_row.next_ordinal,
        "cleared_requests": int(removed or 0),
        "cancelled_requests": len(active),
    }
    return result


async def purge_cleared(session: AsyncSession, older_than_s: float) -> int:
    """Delete requests (and, by cascade, their events) cleared more than ``older_than_s`` ago, and
    the session-level events of the histories those clears replaced.

    For the worker's sweep; runs in the caller's transaction (the caller commits). Returns how many
    requests were purged.
    """
    await purge_cleared_session_events(session, older_than_s)
    result: Any = await session.execute(
        delete(RequestRow)
        .where(
            RequestRow.deleted_at.is_not(None),
            RequestRow.deleted_at < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, older_than_s),
        )
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount or 0)
