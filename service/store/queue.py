"""All queue SQL: claim, lease + heartbeat, guarded stage/terminal writes, and the recovery sweep.

The worker never writes SQL itself; it calls these functions (procrastinate's "one manager" shape).

Invariants, and how each is kept:

- **Global cap** (SPEC §9: at most ``max_concurrency`` running across all processes): every claim takes
  one transaction-level advisory lock, counts ``running`` rows and picks the next request inside that
  lock. Claims are therefore serialised (a claim is a few milliseconds) and the count a claimer sees
  includes every earlier claim, because READ COMMITTED takes a fresh snapshot per statement, after the
  lock was granted.
- **One running per session, ordinal order**: only the lowest queued ordinal of a session with nothing
  running is a candidate.
- **Never waiting on the API**: the pick locks the request *and* its session row with ``SKIP LOCKED``;
  a session whose row an admission or a clear holds right now is skipped this time (their commit
  NOTIFYs the queue, so it is picked up at once after), and the claim never queues behind them.
- **Round robin**: among candidates, the session whose ``last_started_at`` is oldest goes first (NULL —
  never started — first), ties broken by the oldest queued request. Claiming stamps
  ``last_started_at``.
- **Lease**: a claim sets ``lease_owner`` and ``lease_expires_at``; heartbeats extend it. Every write a
  worker makes afterwards (events, stage, terminal state) is guarded by ``status = 'running' AND
  lease_owner = <me>``, so a request cancelled, cleared or taken over by the sweep is never written by a
  worker that lost it, and no event ever follows a terminal one.
- **Recovery**: a running request whose lease expired is queued again once (``attempt`` 1 → the next
  claim makes it 2; usage kept) or, on its second loss, failed with ``worker_lost``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from service.store.events import append_event
from service.store.listener import QUEUE_CHANNEL
from service.store.models import RequestRow
from service.store.records import request_record

# Key of the advisory lock that serialises claims (any constant; shared by every process).
CLAIM_LOCK_KEY = 0x5EDE_0001

# A request that lost its worker this many times is failed with worker_lost instead of re-run.
MAX_ATTEMPTS = 2

_PICK_NEXT = text(
    """
    SELECT r.id
    FROM side_question_requests r
    JOIN side_question_sessions s ON s.id = r.session_id
    WHERE r.status = 'queued'
      AND r.deleted_at IS NULL
      AND r.ordinal = (
          SELECT min(q.ordinal) FROM side_question_requests q
          WHERE q.session_id = r.session_id AND q.status = 'queued' AND q.deleted_at IS NULL
      )
      AND NOT EXISTS (
          SELECT 1 FROM side_question_requests x
          WHERE x.session_id = r.session_id AND x.status = 'running'
      )
    ORDER BY s.last_started_at ASC NULLS FIRST, r.created_at ASC, r.id ASC
    LIMIT 1
    FOR UPDATE OF r, s SKIP LOCKED
    """
)


@dataclass(frozen=True)
class Claimed:
    """A request this worker now holds: what the pipeline needs to start."""

    id: uuid.UUID
    session_id: uuid.UUID
    parent_id: str
    ordinal: int
    attempt: int
    clear_version: int


async def count_running(session: AsyncSession) -> int:
    """How many requests are running right now, across all processes."""
    value = await session.scalar(text("SELECT count(*) FROM side_question_requests WHERE status = 'running'"))
    return int(value or 0)


async def claim_next(
    session: AsyncSession, *, owner: str, lease_s: float, max_running: int
) -> Claimed | None:
    """Claim the next request per SPEC §9, or None when the cap is reached or nothing is eligible.

    Runs in (and commits) its own short transaction on ``session``: lock, count, pick, mark running with
    stage ``preparing`` and a lease, stamp the session's ``last_started_at``, write the ``status`` event.
    """
    async with session.begin():
        await session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": CLAIM_LOCK_KEY})
        if await count_running(session) >= max_running:
            return None
        picked = await session.scalar(_PICK_NEXT)
        if picked is None:
            return None
        row = (
            await session.execute(
                text(
                    """
                    UPDATE side_question_requests
                    SET status = 'running', stage = 'preparing', attempt = attempt + 1,
                        lease_owner = :owner,
                        lease_expires_at = now() + make_interval(secs => :lease_s),
                        heartbeat_at = now(),
                        started_at = coalesce(started_at, now()),
                        context_info = jsonb_set(context_info, '{stage}', '"preparing"')
                    WHERE id = :id
                    RETURNING id, session_id, ordinal, attempt, clear_version
                    """
                ),
                {"id": picked, "owner": owner, "lease_s": lease_s},
            )
        ).one()
        parent_id = await session.scalar(
            text(
                "UPDATE side_question_sessions SET last_started_at = clock_timestamp() "
                "WHERE id = :sid RETURNING parent_id"
            ),
            {"sid": row.session_id},
        )
        await append_event(
            session, row.id, "status", {"status": "running", "stage": "preparing", "attempt": row.attempt}
        )
        return Claimed(
            id=row.id,
            session_id=row.session_id,
            parent_id=str(parent_id),
            ordinal=row.ordinal,
            attempt=row.attempt,
            clear_version=row.clear_version,
        )


async def heartbeat(
    session: AsyncSession, *, owner: str, request_ids: list[uuid.UUID], lease_s: float
) -> set[uuid.UUID]:
    """Extend the leases of ``request_ids`` this worker still holds; returns the ids still held.

    An id missing from the result was cancelled, cleared, finished or taken over: its task must stop.
    A request with ``cancel_requested`` set is treated as lost too.
    """
    if not request_ids:
        return set()
    async with session.begin():
        rows = await session.execute(
            text(
                """
                UPDATE side_question_requests
                SET lease_expires_at = now() + make_interval(secs => :lease_s), heartbeat_at = now()
                WHERE id = ANY(:ids) AND status = 'running' AND lease_owner = :owner
                  AND deleted_at IS NULL
                RETURNING id, cancel_requested
                """
            ),
            {"ids": request_ids, "owner": owner, "lease_s": lease_s},
        )
        return {r.id for r in rows if not r.cancel_requested}


async def lock_if_held(session: AsyncSession, request_id: uuid.UUID, owner: str) -> bool:
    """Inside the caller's transaction: lock the request row if this worker still runs it.

    Used before every worker write; a concurrent cancel or clear holding the row makes this wait, then
    see the new status, so the worker's write is skipped rather than landing after a terminal event.
    """
    held = await session.scalar(
        text(
            """
            SELECT id FROM side_question_requests
            WHERE id = :id AND status = 'running' AND lease_owner = :owner AND deleted_at IS NULL
            FOR UPDATE
            """
        ),
        {"id": request_id, "owner": owner},
    )
    return held is not None


async def emit_if_held(
    session: AsyncSession,
    request_id: uuid.UUID,
    owner: str,
    event_type: str,
    fields: dict[str, Any],
) -> bool:
    """Append one event in its own transaction, only while this worker holds the request."""
    async with session.begin():
        if not await lock_if_held(session, request_id, owner):
            return False
        await append_event(session, request_id, event_type, fields)
        return True


async def set_stage(
    session: AsyncSession,
    request_id: uuid.UUID,
    owner: str,
    stage: str,
    *,
    context_info: dict[str, Any] | None = None,
) -> bool:
    """Move a held request to ``stage`` (and store ``context_info``), writing its ``status`` event."""
    async with session.begin():
        if not await lock_if_held(session, request_id, owner):
            return False
        info = dict(context_info or {})
        info["stage"] = stage
        await session.execute(
            text(
                "UPDATE side_question_requests SET stage = :stage, "
                "context_info = context_info || CAST(:info AS jsonb) WHERE id = :id"
            ),
            {"stage": stage, "info": _json(info), "id": request_id},
        )
        await append_event(session, request_id, "status", {"status": "running", "stage": stage})
        return True


async def _record_for(session: AsyncSession, request_id: uuid.UUID) -> dict[str, Any]:
    row = await session.get(RequestRow, request_id, populate_existing=True)
    assert row is not None
    parent_id = await session.scalar(
        text("SELECT parent_id FROM side_question_sessions WHERE id = :sid"), {"sid": row.session_id}
    )
    return request_record(row, str(parent_id))


async def _notify_slot_freed(session: AsyncSession, session_id: uuid.UUID) -> None:
    await session.execute(
        text("SELECT pg_notify(:channel, :payload)"), {"channel": QUEUE_CHANNEL, "payload": str(session_id)}
    )


async def finish_succeeded(
    session: AsyncSession,
    request_id: uuid.UUID,
    owner: str,
    *,
    answer: str,
    truncated: bool,
    stop_reason: str | None,
    model: str | None,
    context_info: dict[str, Any],
) -> dict[str, Any] | None:
    """Write the success terminal state and its ``status`` + ``done`` events; returns the final record.

    None when the worker no longer holds the request (cancelled/cleared/taken over): nothing written.
    """
    async with session.begin():
        if not await lock_if_held(session, request_id, owner):
            return None
        session_id = await session.scalar(
            text(
                """
                UPDATE side_question_requests
                SET status = 'succeeded', answer = :answer, truncated = :truncated,
                    stop_reason = :stop_reason, model = coalesce(:model, model),
                    context_info = context_info || CAST(:info AS jsonb), error = NULL,
                    finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
                WHERE id = :id
                RETURNING session_id
                """
            ),
            {
                "answer": answer,
                "truncated": truncated,
                "stop_reason": stop_reason,
                "model": model,
                "info": _json(context_info),
                "id": request_id,
            },
        )
        record = await _record_for(session, request_id)
        await append_event(session, request_id, "status", {"status": "succeeded", "stage": record["stage"]})
        await append_event(session, request_id, "done", {"record": record})
        assert session_id is not None
        await _notify_slot_freed(session, session_id)
        return record


async def finish_failed(
    session: AsyncSession,
    request_id: uuid.UUID,
    owner: str | None,
    *,
    code: str,
    message: str,
    detail: dict[str, Any] | None = None,
    status: str = "failed",
    context_info: dict[str, Any] | None = None,
) -> bool:
    """Write a ``failed`` (or ``cancelled``) terminal state with its ``status`` + ``error`` events.

    ``owner`` None skips the lease check (the recovery sweep, which has locked the row itself).
    Returns False, writing nothing, when the request is no longer running under ``owner``.
    """
    async with session.begin():
        if owner is not None and not await lock_if_held(session, request_id, owner):
            return False
        error = {"code": code, "message": message, "detail": detail or {}}
        updated = (
            await session.execute(
                text(
                    """
                    UPDATE side_question_requests
                    SET status = :status, error = CAST(:error AS jsonb),
                        context_info = context_info || CAST(:info AS jsonb),
                        finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
                    WHERE id = :id AND status = 'running'
                    RETURNING session_id, stage
                    """
                ),
                {
                    "status": status,
                    "error": _json(error),
                    "info": _json(context_info or {}),
                    "id": request_id,
                },
            )
        ).one_or_none()
        if updated is None:
            return False
        await append_event(session, request_id, "status", {"status": status, "stage": updated.stage})
        await append_event(session, request_id, "error", error)
        await _notify_slot_freed(session, updated.session_id)
        return True


async def release(session: AsyncSession, request_id: uuid.UUID, owner: str) -> bool:
    """Give a held request back to the queue (graceful worker stop); the attempt does not count."""
    async with session.begin():
        if not await lock_if_held(session, request_id, owner):
            return False
        stage = await session.scalar(
            text("SELECT stage FROM side_question_requests WHERE id = :id"), {"id": request_id}
        )
        session_id = await session.scalar(
            text(
                """
                UPDATE side_question_requests
                SET status = 'queued', stage = NULL, attempt = greatest(attempt - 1, 0),
                    lease_owner = NULL, lease_expires_at = NULL
                WHERE id = :id RETURNING session_id
                """
            ),
            {"id": request_id},
        )
        await append_event(
            session,
            request_id,
            "progress",
            {"stage": stage, "action": "worker_stopped_rerun", "discard_streamed_text": True},
        )
        await append_event(
            session, request_id, "status", {"status": "queued", "stage": None, "reason": "worker_stopped"}
        )
        assert session_id is not None
        await _notify_slot_freed(session, session_id)
        return True


@dataclass(frozen=True)
class SweepResult:
    """What one recovery sweep did."""

    requeued: list[uuid.UUID]
    failed: list[uuid.UUID]


async def sweep_expired(session: AsyncSession, *, max_attempts: int = MAX_ATTEMPTS) -> SweepResult:
    """Recover requests whose lease expired (their worker died): re-run once, else ``worker_lost``.

    Usage, context_info and events already recorded are kept. A re-run gets a ``status`` event back to
    ``queued`` and a ``progress`` event telling clients to discard the text streamed so far.
    """
    requeued: list[uuid.UUID] = []
    failed: list[uuid.UUID] = []
    async with session.begin():
        rows = (
            await session.execute(
                text(
                    """
                    SELECT id, session_id, attempt, stage FROM side_question_requests
                    WHERE status = 'running' AND lease_expires_at < now()
                    ORDER BY lease_expires_at
                    FOR UPDATE SKIP LOCKED
                    """
                )
            )
        ).all()
        for row in rows:
            if row.attempt < max_attempts:
                await session.execute(
                    text(
                        """
                        UPDATE side_question_requests
                        SET status = 'queued', stage = NULL, lease_owner = NULL, lease_expires_at = NULL
                        WHERE id = :id
                        """
                    ),
                    {"id": row.id},
                )
                await append_event(
                    session,
                    row.id,
                    "progress",
                    {
                        "stage": row.stage,
                        "action": "worker_lost_rerun",
                        "attempt": row.attempt,
                        "discard_streamed_text": True,
                    },
                )
                await append_event(
                    session, row.id, "status", {"status": "queued", "stage": None, "reason": "worker_lost"}
                )
                requeued.append(row.id)
            else:
                error = {
                    "code": "worker_lost",
                    "message": f"the worker running this request stopped answering ({row.attempt} attempts)",
                    "detail": {"attempts": row.attempt, "stage": row.stage},
                }
                await session.execute(
                    text(
                        """
                        UPDATE side_question_requests
                        SET status = 'failed', error = CAST(:error AS jsonb), finished_at = now(),
                            lease_owner = NULL, lease_expires_at = NULL
                        WHERE id = :id
                        """
                    ),
                    {"id": row.id, "error": _json(error)},
                )
                await append_event(session, row.id, "status", {"status": "failed", "stage": row.stage})
                await append_event(session, row.id, "error", error)
                failed.append(row.id)
            await _notify_slot_freed(session, row.session_id)
    return SweepResult(requeued=requeued, failed=failed)


def _json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
