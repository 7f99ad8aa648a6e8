"""Background summary jobs (SPEC §6.6): enqueue, claim, requeue, finish, and the single-flight registry
(``uq_jobs_active``; a request's registration is a ``running`` row with ``made_by = 'request'``):
docs/pipeline.md, "Background summary jobs". A background job's transition appends a ``memory`` event
and NOTIFYs ``sidequest_jobs``; a registration's does neither.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from service.store import queries
from service.store.execute import Executor, Row, execute, fetch_all, fetch_one, fetch_value, json_text, notify
from service.store.ledger import USAGE_FIELDS
from service.vocabulary import (
    CANCEL_CHANNEL,
    JobKind,
    RequeueReason,
    Status,
    TerminalStatus,
    session_cleared_error,
    taken_over_error,
    utc_iso,
)

# Key of the advisory lock that serialises job claims (requests have their own).
JOB_CLAIM_LOCK_KEY = 0x5EDE_0002


@dataclass(frozen=True)
class ClaimedJob:
    """A background job this worker now holds."""

    id: uuid.UUID
    session_id: uuid.UUID
    kind: JobKind
    key: str
    params: dict[str, Any]
    clear_version: int
    attempt: int
    # The lease owner of this claim (service.store.lease.claim_owner): every write of this run names it.
    owner: str
    # Its session as the claim read it: its clear_version now (None: the session is gone), memory, settings.
    session_clear_version: int | None
    memory: dict[str, Any]
    settings: dict[str, Any]
    # The content hash of the snapshot a context_summary job names (None: no such snapshot stored).
    snapshot_hash: str | None

    @property
    def cleared(self) -> bool:
        """Whether the session was cleared (or deleted) since the job was queued: it must write nothing."""
        return self.session_clear_version != self.clear_version


@dataclass(frozen=True)
class JobState:
    """A job as a waiting request sees it (the columns of sql/jobs.sql's active_jobs and job_state)."""

    id: uuid.UUID
    kind: str
    key: str
    status: str
    made_by: str
    error: dict[str, Any] | None


async def _memory_event(
    tx: Executor, job_id: uuid.UUID, job: Row, status: str, covered: dict[str, Any] | None, notify: str | None
) -> None:
    """The ``memory`` event of a transition of the job (``job``: its session_id, kind and calls) and,
    with ``notify``, its ``NOTIFY sidequest_jobs`` (``queued``: work to do; ``freed``: a slot freed)."""
    await execute(
        tx,
        queries.memory_event,
        {
            "sid": job["session_id"],
            "job_id": job_id,
            "kind": job["kind"],
            "status": str(status),
            "calls": job["calls"],
            "covered": json_text(covered) if covered is not None else None,
            "at": utc_iso(),
            "notify": notify,
        },
    )


async def enqueue_job(
    tx: Executor,
    session_id: uuid.UUID,
    *,
    kind: JobKind,
    key: str,
    params: dict[str, Any],
    clear_version: int,
) -> uuid.UUID | None:
    """Queue a background job; None when the same (session, kind, key) is active already, or the
    session was cleared since ``clear_version`` was read."""
    job_id: uuid.UUID | None = await fetch_value(
        tx,
        queries.enqueue_job,
        {
            "id": uuid.uuid4(),
            "sid": session_id,
            "kind": str(kind),
            "key": key,
            "params": json_text({**params, "made_by": "background"}),
            "cv": clear_version,
            "at": utc_iso(),
        },
    )
    return job_id


async def register_inline(
    tx: Executor,
    session_id: uuid.UUID,
    *,
    kind: JobKind,
    key: str,
    request_id: uuid.UUID,
    owner: str,
    clear_version: int,
    lease_s: float,
) -> uuid.UUID | None:
    """Register a request making this summary itself: the id, or None if another has the key (wait for it)."""
    registration: uuid.UUID | None = await fetch_value(
        tx,
        queries.register_inline,
        {
            "id": uuid.uuid4(),
            "sid": session_id,
            "kind": str(kind),
            "key": key,
            "params": json_text({"made_by": "request", "request_id": str(request_id)}),
            "cv": clear_version,
            "owner": owner,
            "lease_s": float(lease_s),
        },
    )
    return registration


async def end_inline(tx: Executor, registration_id: uuid.UUID, *, ok: bool) -> None:
    """End a request's registration (made or not): the key is free again."""
    status = Status.SUCCEEDED if ok else Status.FAILED
    await execute(tx, queries.end_inline, {"id": registration_id, "status": str(status)})


async def claim_job(tx: Executor, *, owner: str, lease_s: float, max_running: int) -> ClaimedJob | None:
    """Claim the oldest queued background job under the global background cap (``sidequest_claim_job``,
    which also reads the job's session). One running job per (session, kind): folds build on each other."""
    row = await fetch_one(
        tx,
        queries.claim_job,
        {
            "owner": owner,
            "lease_s": float(lease_s),
            "max_running": max_running,
            "lock_key": JOB_CLAIM_LOCK_KEY,
            "at": utc_iso(),
        },
    )
    if row is None:
        return None
    return ClaimedJob(
        id=row["id"],
        session_id=row["session_id"],
        kind=JobKind(row["kind"]),
        key=row["key"],
        params=dict(row["params"] or {}),
        clear_version=row["clear_version"],
        attempt=row["attempt"],
        owner=owner,
        session_clear_version=row["session_clear_version"],
        memory=dict(row["memory"] or {}),
        settings=dict(row["settings"] or {}),
        snapshot_hash=row["snapshot_hash"],
    )


async def finish_job(
    tx: Executor,
    job_id: uuid.UUID,
    owner: str | None,
    *,
    status: TerminalStatus,
    calls: int | None,
    covered: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    from_statuses: tuple[Status, ...] = (Status.RUNNING,),
) -> bool:
    """THE terminal transition of a job (its worker's end, the sweep, a take-over, a clear), guarded
    by the statuses it leaves and, given ``owner``, the lease; ``calls`` None keeps the row's count.
    With the ``memory`` event (not for a registration) and, when it was running, the slot's NOTIFY."""
    row = await fetch_one(
        tx,
        queries.finish_job,
        {
            "id": job_id,
            "status": str(status),
            "calls": calls,
            "covered": None if covered is None else json_text(covered),
            "error": None if error is None else json_text(error),
            "owner": owner,
            "from_statuses": [str(s) for s in from_statuses],
        },
    )
    if row is None:
        return False
    if row["made_by"] == "background":
        freed = "freed" if row["left_status"] == Status.RUNNING else None
        await _memory_event(tx, job_id, row, status, covered, freed)
    return True


async def _cancel_job(tx: Executor, job_id: uuid.UUID, error: dict[str, Any], *statuses: Status) -> bool:
    """:func:`finish_job` ending a job ``cancelled`` from one of ``statuses``, any lease, calls kept."""
    return await finish_job(
        tx, job_id, None, status=Status.CANCELLED, calls=None, error=error, from_statuses=statuses
    )


async def requeue_job(
    tx: Executor, job_id: uuid.UUID, *, reason: RequeueReason, owner: str | None = None
) -> bool:
    """THE way back to ``queued`` of a running job: a worker's graceful stop (``worker_stopped``,
    guarded by its ``owner``; the attempt does not count) or the sweep (``worker_lost``)."""
    row = await fetch_one(
        tx,
        queries.requeue_job,
        {"id": job_id, "owner": owner, "attempt_counts": reason == "worker_lost"},
    )
    if row is None:
        return False
    await _memory_event(tx, job_id, row, Status.QUEUED, None, "queued")
    return True


async def count_calls(tx: Executor, job_id: uuid.UUID, n: int) -> None:
    """``n`` more calls started by a running job: a clear that cancels it mid-call reports the calls
    in flight (their usage arrives when they end)."""
    await execute(tx, queries.count_job_calls, {"id": job_id, "n": n})


async def take_over(tx: Executor, job_id: uuid.UUID) -> bool:
    """A waiting request takes a still-queued job over (it ends ``cancelled``, ``taken_over``) to make
    the summary itself; False if it started meanwhile."""
    return await _cancel_job(tx, job_id, taken_over_error(), Status.QUEUED)


async def take_key(tx: Executor, job_id: uuid.UUID, key: str) -> bool:
    """Re-key a running job to the summary's real cache key; False when another active job or
    registration holds that key (the summary is being made)."""
    return await fetch_value(tx, queries.take_job_key, {"id": job_id, "key": key}) is not None


async def cancel_session_jobs(tx: Executor, session_id: uuid.UUID) -> None:
    """A clear: cancel the session's queued and running jobs (:func:`finish_job`) and tell their
    workers (``NOTIFY sidequest_cancel``, ``job:<id>``)."""
    for row in await fetch_all(tx, queries.active_session_jobs, {"sid": session_id}):
        await _cancel_job(tx, row["id"], session_cleared_error(), Status.QUEUED, Status.RUNNING)
        await notify(tx, CANCEL_CHANNEL, f"job:{row['id']}")


async def active_jobs(tx: Executor, session_id: uuid.UUID, kind: JobKind) -> list[JobState]:
    """The session's queued or running jobs (and registrations) of ``kind``, oldest first."""
    return [
        JobState(**r)
        for r in await fetch_all(tx, queries.active_jobs, {"sid": session_id, "kind": str(kind)})
    ]


async def job_state(tx: Executor, job_id: uuid.UUID) -> JobState | None:
    """One job's current state, or None when it is gone (purged with its session)."""
    row = await fetch_one(tx, queries.job_state, {"id": job_id})
    return None if row is None else JobState(**row)


async def background_overviews(
    tx: AsyncSession, session_ids: list[uuid.UUID]
) -> dict[uuid.UUID, dict[str, Any]]:
    """SPEC §3 ``session.background`` per session, in one query: jobs by status, background calls' usage."""
    result: dict[uuid.UUID, dict[str, Any]] = {}
    if not session_ids:
        return result
    for row in await tx.execute(queries.background_overviews, {"sids": list(session_ids)}):
        counts = {status: int((row.counts or {}).get(status, 0)) for status in Status}
        calls = list(row.calls or [])
        usage: dict[str, Any] = {
            name: sum(int(call.get(name) or 0) for call in calls if isinstance(call, dict))
            for name in USAGE_FIELDS
        }
        usage["calls"] = calls
        result[row.session_id] = {"jobs": counts, "usage": usage}
    return result
