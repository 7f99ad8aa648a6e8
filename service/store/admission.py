"""Admission, cancel and clear: the API's writes, each one short transaction.

None of these waits for a worker: admission locks only the session row (which workers never hold
across a model call), cancel and clear write the terminal state themselves and tell a running worker
through ``NOTIFY sidequest_cancel``. A worker's own terminal writes are guarded by
``status = 'running'`` and its lease, so whichever terminal write lands first wins and the other is a
no-op.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.store.events import append_event
from service.store.jobs import cancel_session_jobs
from service.store.listener import CANCEL_CHANNEL, QUEUE_CHANNEL
from service.store.models import EMPTY_MEMORY, HandoffRow, RequestRow, SessionRow
from service.store.records import request_record
from service.store.sessions import (
    SnapshotJobPolicy,
    lock_or_create_session,
    lock_session,
    snapshot_exists,
    store_snapshot,
)

CANCELLED_BY_CLIENT = "cancelled by the client"
CANCELLED_BY_CLEAR = "cancelled because the session was cleared"


class QueueFull(Exception):
    """The session already has the maximum number of queued requests."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the session already has {limit} queued questions; wait for some to finish")
        self.limit = limit


class SnapshotMissing(Exception):
    """The request names a snapshot the session does not have."""

    def __init__(self, snapshot_id: str) -> None:
        super().__init__(f"snapshot {snapshot_id!r} was never stored for this session; PUT it first")
        self.snapshot_id = snapshot_id


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before with a different body."""

    def __init__(self, key: str) -> None:
        super().__init__("this Idempotency-Key was already used with a different request body")
        self.key = key


@dataclass(frozen=True)
class Admission:
    """A validated question, ready to be admitted."""

    question: str
    snapshot_id: str | None = None
    snapshot: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None
    body_hash: str | None = None
    # When storing an inline snapshot may queue its background context summary (SPEC §6.6).
    snapshot_jobs: SnapshotJobPolicy | None = None


@dataclass(frozen=True)
class Admitted:
    """The request record, and whether this call created it (False: an idempotent replay)."""

    record: dict[str, Any]
    created: bool


async def _notify(session: AsyncSession, channel: str, payload: str) -> None:
    await session.execute(text("SELECT pg_notify(:c, :p)"), {"c": channel, "p": payload})


async def admit(
    session: AsyncSession, tenant: str, parent_id: str, admission: Admission, *, max_queued: int
) -> Admitted:
    """Admit one question inside the caller's (fresh) transaction and commit it.

    Order matters: an idempotent replay answers before any limit applies, and every check runs
    before the first write, so a rejection (exception) rolls back and leaves nothing behind —
    not even a session created for it.
    """
    owner = await lock_or_create_session(session, tenant, parent_id)
    if admission.idempotency_key is not None:
        earlier = await session.scalar(
            select(RequestRow).where(
                RequestRow.session_id == owner.id,
                RequestRow.idempotency_key == admission.idempotency_key,
                RequestRow.deleted_at.is_(None),
            )
        )
        if earlier is not None:
            if earlier.body_hash != admission.body_hash:
                raise IdempotencyConflict(admission.idempotency_key)
            await session.commit()
            return Admitted(request_record(earlier, owner.parent_id), created=False)
    queued = await session.scalar(
        select(func.count()).where(
            RequestRow.session_id == owner.id,
            RequestRow.status == "queued",
            RequestRow.deleted_at.is_(None),
        )
    )
    if (queued or 0) >= max_queued:
        raise QueueFull(max_queued)
    snapshot_id = admission.snapshot_id
    if admission.snapshot is not None:
        own_id = admission.snapshot.get("snapshot_id")
        stored = await store_snapshot(
            session,
            owner.id,
            own_id if isinstance(own_id, str) and own_id else None,
            admission.snapshot,
            owner=owner,
            jobs=admission.snapshot_jobs,
        )
        snapshot_id = stored.snapshot_id
    elif snapshot_id is not None and not await snapshot_exists(session, owner.id, snapshot_id):
        raise SnapshotMissing(snapshot_id)
    ordinal = owner.next_ordinal
    owner.next_ordinal = ordinal + 1
    owner.updated_at = func.now()
    row = RequestRow(
        id=uuid.uuid4(),
        session_id=owner.id,
        ordinal=ordinal,
        question=admission.question,
        snapshot_id=snapshot_id,
        status="queued",
        clear_version=owner.clear_version,
        options=admission.options,
        model=admission.options.get("model"),
        idempotency_key=admission.idempotency_key,
        body_hash=admission.body_hash,
    )
    session.add(row)
    await session.flush()
    await append_event(session, row.id, "status", {"status": "queued", "stage": None})
    await _notify(session, QUEUE_CHANNEL, str(owner.id))
    await session.refresh(row)
    record = request_record(row, owner.parent_id)
    await session.commit()
    return Admitted(record, created=True)


async def _write_cancelled(session: AsyncSession, row: RequestRow, message: str) -> None:
    """Append the cancelled terminal events of ``row`` (already updated to ``cancelled``)."""
    await append_event(session, row.id, "status", {"status": "cancelled", "stage": row.stage})
    await append_event(session, row.id, "error", {"code": "cancelled", "message": message, "detail": {}})


def _cancel_values(message: str) -> dict[str, Any]:
    return {
        "status": "cancelled",
        "cancel_requested": True,
        "finished_at": func.now(),
        "error": {"code": "cancelled", "message": message, "detail": {}},
        "lease_owner": None,
        "lease_expires_at": None,
    }


async def cancel_request(session: AsyncSession, tenant: str, request_id: uuid.UUID) -> dict[str, Any] | None:
    """Cancel a queued or running request of the tenant and commit; None when not found.

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
    owner: SessionRow = found[1]
    # Guarded by the status it is leaving, so a worker finishing at the same moment wins or loses
    # cleanly: exactly one terminal write happens.
    changed = (
        await session.execute(
            update(RequestRow)
            .where(RequestRow.id == request_id, RequestRow.status.in_(("queued", "running")))
            .values(**_cancel_values(CANCELLED_BY_CLIENT))
            .returning(RequestRow.id, RequestRow.status)
            .execution_options(synchronize_session=False)
        )
    ).first()
    row = await session.scalar(
        select(RequestRow).where(RequestRow.id == request_id).execution_options(populate_existing=True)
    )
    assert row is not None
    if changed is not None:
        await _write_cancelled(session, row, CANCELLED_BY_CLIENT)
        await _notify(session, CANCEL_CHANNEL, str(request_id))
        await _notify(session, QUEUE_CHANNEL, str(owner.id))
        await session.refresh(row)
    record = request_record(row, owner.parent_id)
    await session.commit()
    return record


async def clear_session(session: AsyncSession, tenant: str, parent_id: str) -> dict[str, Any] | None:
    """Clear a session and commit; None when the tenant has no such session.

    Cancels queued and running requests (their streams end with ``error`` code ``cancelled``),
    hides every request at once (``deleted_at``; a later sweep purges them), resets memory and
    bumps ``clear_version`` so that no late summary write restores anything; deletes the session's
    hand-offs and resets ``handed_off_through`` to 0. Ordinals keep counting; stored snapshots and
    the session's settings are kept.
    """
    owner = await lock_session(session, tenant, parent_id)
    if owner is None:
        return None
    active = list(
        await session.scalars(
            update(RequestRow)
            .where(
                RequestRow.session_id == owner.id,
                RequestRow.deleted_at.is_(None),
                RequestRow.status.in_(("queued", "running")),
            )
            .values(**_cancel_values(CANCELLED_BY_CLEAR))
            .returning(RequestRow.id)
            .execution_options(synchronize_session=False)
        )
    )
    for request_id in active:
        row = await session.scalar(
            select(RequestRow).where(RequestRow.id == request_id).execution_options(populate_existing=True)
        )
        assert row is not None
        await _write_cancelled(session, row, CANCELLED_BY_CLEAR)
        await _notify(session, CANCEL_CHANNEL, str(request_id))
    hidden: Any = await session.execute(
        update(RequestRow)
        .where(RequestRow.session_id == owner.id, RequestRow.deleted_at.is_(None))
        .values(deleted_at=func.now())
        .execution_options(synchronize_session=False)
    )
    removed = hidden.rowcount
    # Background jobs of the session end too (SPEC §6.6); their late writes are refused anyway.
    await cancel_session_jobs(session, owner.id)
    # SPEC §11.1: a clear deletes the hand-offs and resets the mark; settings are kept (§11.2).
    await session.execute(delete(HandoffRow).where(HandoffRow.session_id == owner.id))
    owner.handed_off_through = 0
    owner.memory = dict(EMPTY_MEMORY)
    owner.clear_version = owner.clear_version + 1
    owner.updated_at = func.now()
    await session.flush()
    if active:
        await _notify(session, QUEUE_CHANNEL, str(owner.id))
    result = {
        "parent_id": owner.parent_id,
        "clear_version": owner.clear_version,
        "next_ordinal": owner.next_ordinal,
        "cleared_requests": int(removed or 0),
        "cancelled_requests": len(active),
    }
    await session.commit()
    return result


async def purge_cleared(session: AsyncSession, older_than_s: float) -> int:
    """Delete requests (and, by cascade, their events) cleared more than ``older_than_s`` ago.

    For the worker's sweep; runs in the caller's transaction (the caller commits). Returns how many
    requests were purged.
    """
    result: Any = await session.execute(
        delete(RequestRow)
        .where(
            RequestRow.deleted_at.is_not(None),
            RequestRow.deleted_at < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, older_than_s),
        )
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount or 0)
