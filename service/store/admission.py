"""Admission, cancel and clear: the API's writes, each one short transaction, none waiting for a
worker (docs/architecture.md, "Data flow of one side question"): cancel and clear write the terminal
state themselves and tell a running worker through ``NOTIFY sidequest_cancel``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncSession

from service.budget.prepared import EncodedSnapshot, PreparedSnapshot
from service.errors import SidequestError
from service.store import queries
from service.store.admission_batch import AdmitResult
from service.store.db import Database, driver_chain
from service.store.events import mark_session_events_cleared
from service.store.execute import execute, fetch_all, fetch_one, fetch_value, json_text, notify
from service.store.jobs import cancel_session_jobs
from service.store.models import empty_memory
from service.store.records import record_of_row, request_record
from service.store.sessions import (
    SnapshotJobPolicy,
    find_request,
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


class SnapshotMissing(SidequestError):
    """The request names a snapshot the session does not have."""

    code = "snapshot_missing"
    status = 404


class IdempotencyConflict(SidequestError):
    """The Idempotency-Key was used before with a different body (a question's or a hand-off's)."""

    code = "idempotency_conflict"
    status = 409


class OrdinalsExhausted(SidequestError):
    """The session's next ordinal would not fit its column. Only a restored archive gets there (its
    ordinals may reach ``MAX_ORDINAL``); PostgreSQL refuses the increment, nothing is written."""

    code = "ordinals_exhausted"
    status = 409


class SessionBusyRejected(SidequestError):
    """``on_busy: reject`` (SPEC 11.2) and the session has a queued or running request."""

    code = "session_busy"
    status = 409


@dataclass(frozen=True)
class Admission:
    """A validated question, ready to be admitted; ``on_busy`` None: the session's setting."""

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
    """The request record, whether this call created it (False: an idempotent replay), and the
    requests an ``interrupt`` cancelled, in ordinal order."""

    record: dict[str, Any]
    created: bool
    superseded: tuple[uuid.UUID, ...] = ()


# The parameters, in this order, of the three admission statements: admit_now and admit_many (the
# batcher's CALLs, by position) and admit_in_transaction (an inline snapshot's).
_PARAMS = tuple(
    "tenant parent_id request_id question snapshot_id options model idempotency_key body_hash"
    " max_queued on_busy superseded".split()
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


def _outcome(result: AdmitResult, parent_id: str, snapshot_id: str | None) -> Admitted:
    """The call's result as an :class:`Admitted`, or the refusal it stands for raised with its detail."""
    outcome, detail = result.outcome, result.detail or {}
    if outcome in ("created", "replay"):
        assert result.request is not None
        record = record_of_row(result.request, parent_id)
        return Admitted(record, created=outcome == "created", superseded=result.superseded)
    if outcome == "queue_full":
        limit = detail["max_queued"]
        raise QueueFull(f"the session already has {limit} queued questions; wait for some to finish", detail)
    if outcome == "session_busy":
        raise SessionBusyRejected(
            f"the session is busy ({detail['queued']} queued, {detail['running']} running) and on_busy is "
            "'reject'; wait for them to finish, or send on_busy 'enqueue' or 'interrupt'",
            detail,
        )
    if outcome == "idempotency_conflict":
        raise IdempotencyConflict("this Idempotency-Key was already used with a different request body")
    if outcome == "snapshot_missing":
        raise SnapshotMissing(
            f"snapshot {snapshot_id!r} was never stored for this session; PUT it first",
            {"snapshot_id": snapshot_id},
        )
    raise RuntimeError(f"sidequest_admit returned an unknown outcome {outcome!r}")


async def admit(
    db: Database, tenant: str, parent_id: str, admission: Admission, *, max_queued: int
) -> Admitted:
    """Admit one question and commit it: one round trip (shared with the admissions waiting beside it,
    ``db.admissions``); with an inline snapshot, the snapshot stored first and the same SQL function
    in that transaction. A refusal (raised) writes nothing, not even a session for a first request."""
    try:
        if admission.snapshot is not None:
            async with db.sessions() as tx, tx.begin():
                return await _admit_in_transaction(tx, tenant, parent_id, admission, max_queued=max_queued)
        args = _arguments(tenant, parent_id, admission, admission.snapshot_id, max_queued)
        result = await db.admissions.admit(args)
    except Exception as exc:
        # "integer out of range" can only be the session's next_ordinal + 1: all else is bounded before SQL.
        if any(isinstance(e, asyncpg.NumericValueOutOfRangeError) for e in driver_chain(exc)):
            raise OrdinalsExhausted(
                "this session has used every question number; ask under another parent id "
                "(an export of this session restores into any parent id)"
            ) from exc
        raise
    return _outcome(result, parent_id, admission.snapshot_id)


async def _admit_in_transaction(
    tx: AsyncSession, tenant: str, parent_id: str, admission: Admission, *, max_queued: int
) -> Admitted:
    """:func:`admit` with an inline snapshot (it counts as stored in that transaction)."""
    assert admission.snapshot is not None
    session_row = await lock_or_create_session(tx, tenant, parent_id)
    own_id = admission.snapshot.get("snapshot_id")
    stored = await store_snapshot(
        tx,
        session_row,
        own_id if isinstance(own_id, str) and own_id else None,
        admission.snapshot,
        jobs=admission.snapshot_jobs,
        encoded=admission.snapshot_encoding,
        prepared=admission.snapshot_prepared,
    )
    args = _arguments(tenant, parent_id, admission, stored.snapshot_id, max_queued)
    admitted = await fetch_one(tx, queries.admit_in_transaction, dict(zip(_PARAMS, args, strict=True)))
    assert admitted is not None  # sidequest_admit returns one row whatever the outcome
    row = dict(admitted)
    outcome, detail, superseded = row.pop("outcome"), row.pop("detail"), tuple(row.pop("superseded") or ())
    result = AdmitResult(outcome, detail, superseded, row if row["id"] is not None else None)
    return _outcome(result, parent_id, stored.snapshot_id)


async def _cancel(tx: AsyncSession, request_id: uuid.UUID, message: str) -> bool:
    """Cancel a queued or running request (:func:`finish_request`), tell its worker; False if it had ended."""
    ended = await finish_request(
        tx,
        request_id,
        status=Status.CANCELLED,
        owner=None,
        from_statuses=(Status.QUEUED, Status.RUNNING),
        error=cancelled_error(message),
    )
    if ended is None:
        return False
    await notify(tx, CANCEL_CHANNEL, str(request_id))
    return True


async def cancel_request(tx: AsyncSession, tenant: str, request_id: uuid.UUID) -> dict[str, Any] | None:
    """Cancel a queued or running request of the tenant (a running one ends here at once); None when
    not found. Idempotent: a terminal request is returned unchanged."""
    found = await find_request(tx, tenant, request_id)
    if found is None:
        return None
    request_row, session_row = found
    await _cancel(tx, request_id, CANCELLED_BY_CLIENT)
    await tx.refresh(request_row)
    return request_record(request_row, session_row.parent_id)


async def clear_session(tx: AsyncSession, tenant: str, parent_id: str) -> dict[str, Any] | None:
    """Clear a session; None when the tenant has no such session. Cancels queued and running requests
    and jobs, hides every request at once (``deleted_at``; the sweep purges them) and the old
    history's session-level events, deletes the hand-offs, resets memory and the hand-off mark, and
    bumps ``clear_version``. Ordinals keep counting; snapshots and settings are kept."""
    session_row = await lock_session(tx, tenant, parent_id)
    if session_row is None:
        return None
    active = await fetch_all(tx, queries.active_requests_of_session, {"session_id": session_row.id})
    cancelled = [row["id"] for row in active if await _cancel(tx, row["id"], CANCELLED_BY_CLEAR)]
    hidden = await fetch_value(tx, queries.hide_session_requests, {"session_id": session_row.id})
    await cancel_session_jobs(tx, session_row.id)
    await mark_session_events_cleared(tx, session_row.id)
    params = {"session_id": session_row.id, "empty_memory": json_text(empty_memory())}
    reset = await fetch_one(tx, queries.reset_cleared_session, params)
    assert reset is not None
    return {**reset, "cleared_requests": int(hidden), "cancelled_requests": len(cancelled)}


async def purge_cleared(tx: AsyncSession, older_than_s: float) -> int:
    """The sweep: delete requests (with their events) cleared more than ``older_than_s`` ago, and the
    session-level events of the histories those clears replaced; how many requests went."""
    await execute(tx, queries.purge_cleared_session_events, {"older_than_s": older_than_s})
    return int(await fetch_value(tx, queries.purge_cleared_requests, {"older_than_s": older_than_s}))
