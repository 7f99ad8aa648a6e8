"""The queue: claim, lease + heartbeat, the way back to the queue, the recovery sweep (with
:mod:`.lease` and :mod:`.terminal`, the worker's front door). The claim is ``sidequest_claim``
(sql/queue.sql); its invariants (global cap, one running per session in ordinal order, round robin,
never waiting on the API) and the recovery are docs/pipeline.md's "Claiming" and "Recovery". A queue
NOTIFY says why: ``freed:<session id>`` when a slot frees, the bare session id on an admission.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from service.store import jobs, queries
from service.store.events import append_event
from service.store.execute import Executor, fetch_one, notify
from service.store.lease import lock_if_held
from service.store.terminal import finish_request
from service.vocabulary import QUEUE_CHANNEL, RequeueReason, Status, rerun, utc_iso, worker_lost_error

# Key of the advisory lock that serialises claims (any constant; shared by every process).
CLAIM_LOCK_KEY = 0x5EDE_0001

# A request that lost its worker this many times is failed with worker_lost instead of re-run.
MAX_ATTEMPTS = 2


@dataclass(frozen=True)
class Claimed:
    """A request this worker now holds: what the pipeline needs to start, read by the claim itself."""

    id: uuid.UUID
    session_id: uuid.UUID
    parent_id: str
    ordinal: int
    attempt: int
    clear_version: int
    # The lease owner of this claim (service.store.lease.claim_owner): every write of this run names it.
    owner: str
    question: str
    snapshot_id: str | None
    options: dict[str, Any]
    model: str | None
    memory: dict[str, Any]
    session_settings: dict[str, Any]
    created_at: str | None
    # Whether the session had an active background job (or registration) at the claim: if not, the
    # request need not look for one to wait for (a later one meets its single-flight registration).
    jobs_active: bool
    # The content hash of the snapshot it names (the worker's prepared snapshots' key); None: none.
    snapshot_hash: str | None


async def try_claim(
    tx: Executor, *, owner: str, lease_s: float, max_running: int
) -> tuple[Claimed | None, bool]:
    """Claim the next request (SPEC §9, ``sidequest_claim``) or None, and whether the cluster is at cap."""
    row = await fetch_one(
        tx,
        queries.claim_request,
        {
            "owner": owner,
            "lease_s": float(lease_s),
            "max_running": max_running,
            "lock_key": CLAIM_LOCK_KEY,
            "at": utc_iso(),
        },
    )
    if row is None:
        return None, False
    if row["cluster_full"]:
        return None, True
    return Claimed(
        id=row["id"],
        session_id=row["session_id"],
        parent_id=str(row["parent_id"]),
        ordinal=row["ordinal"],
        attempt=row["attempt"],
        clear_version=row["clear_version"],
        owner=owner,
        question=row["question"],
        snapshot_id=row["snapshot_id"],
        options=dict(row["options"] or {}),
        model=row["model"],
        memory=dict(row["memory"] or {}),
        session_settings=dict(row["settings"] or {}),
        created_at=utc_iso(row["created_at"]),
        jobs_active=bool(row["jobs_active"]),
        snapshot_hash=row["snapshot_hash"],
    ), False


@dataclass(frozen=True)
class Held:
    """What a heartbeat found still held by this worker."""

    requests: set[uuid.UUID]
    jobs: set[uuid.UUID]


async def heartbeat(
    tx: AsyncSession,
    *,
    requests: Mapping[uuid.UUID, str],
    lease_s: float,
    jobs: Mapping[uuid.UUID, str] | None = None,
) -> Held:
    """Extend a worker's leases on requests and jobs (id → its run's lease owner); an id missing from the
    result (cancelled, cleared, finished, taken over, or a request with ``cancel_requested``) must stop."""
    held = Held(set(), set())
    if requests:
        rows = await tx.execute(
            queries.heartbeat_requests,
            {"ids": list(requests), "owners": list(requests.values()), "lease_s": lease_s},
        )
        held.requests.update(r.id for r in rows if not r.cancel_requested)
    if jobs:
        rows = await tx.execute(
            queries.heartbeat_jobs,
            {"ids": list(jobs), "owners": list(jobs.values()), "lease_s": lease_s},
        )
        held.jobs.update(r.id for r in rows)
    return held


async def requeue_request(
    tx: Executor, request_id: uuid.UUID, *, reason: RequeueReason, owner: str | None = None
) -> bool:
    """THE way back to ``queued`` of a running request: a worker's graceful stop (``worker_stopped``,
    guarded by its ``owner``; the attempt does not count) or the sweep (``worker_lost``). Its
    ``progress`` event tells clients to discard the text so far. False when nothing was written."""
    if owner is not None and not await lock_if_held(tx, request_id, owner):
        return False
    row = await fetch_one(
        tx, queries.requeue_request, {"id": request_id, "attempt_counts": reason == "worker_lost"}
    )
    if row is None:
        return False
    attempt = row["attempt"] if reason == "worker_lost" else None
    await append_event(tx, request_id, "progress", rerun(reason, row["stage"], attempt))
    await append_event(tx, request_id, "status", {"status": Status.QUEUED, "stage": None, "reason": reason})
    await notify(tx, QUEUE_CHANNEL, f"freed:{row['session_id']}")  # a slot freed (module docstring)
    return True


@dataclass(frozen=True)
class SweepResult:
    """What one recovery sweep did (requests and background jobs)."""

    requeued: list[uuid.UUID] = field(default_factory=list)
    failed: list[uuid.UUID] = field(default_factory=list)
    jobs_requeued: list[uuid.UUID] = field(default_factory=list)
    jobs_failed: list[uuid.UUID] = field(default_factory=list)


async def sweep_expired(tx: AsyncSession) -> SweepResult:
    """Recover requests and background jobs whose lease expired (their worker died): each is re-run
    once, else failed with ``worker_lost`` (what it recorded is kept); a registration just ends."""
    result = SweepResult()
    for row in (await tx.execute(queries.expired_requests)).all():
        if row.attempt < MAX_ATTEMPTS:
            await requeue_request(tx, row.id, reason="worker_lost")
            result.requeued.append(row.id)
        else:
            await finish_request(
                tx,
                row.id,
                status=Status.FAILED,
                owner=None,
                error=worker_lost_error(row.attempt, row.stage, "request"),
            )
            result.failed.append(row.id)
    for job in (await tx.execute(queries.expired_jobs)).all():
        if job.made_by == "background" and job.attempt < MAX_ATTEMPTS:
            await jobs.requeue_job(tx, job.id, reason="worker_lost")
            result.jobs_requeued.append(job.id)
        else:
            await jobs.finish_job(
                tx,
                job.id,
                None,
                status=Status.FAILED,
                calls=job.calls,
                error=worker_lost_error(job.attempt, None, "job"),
            )
            result.jobs_failed.append(job.id)
    return result
