"""The worker: request slots and background-job slots, one heartbeat, one sweep (SPEC §6.6, §9;
what each loop does and how often: docs/pipeline.md, "Leases, heartbeats, cancellation", "Recovery").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import Generic, Literal, Protocol, TypeVar

from service.aio import settle, wait_event
from service.config import Settings
from service.pipeline.background import run_job
from service.pipeline.run import run_request
from service.pipeline.runtime import PipelineDeps
from service.providers import build_provider
from service.store import jobs, lease, queue, terminal
from service.store.admission import purge_cleared
from service.store.db import Database, OutageLog, is_unavailable, unusable_reason
from service.store.execute import committed
from service.store.listener import WORKER_CHANNELS, Listener
from service.vocabulary import CANCEL_CHANNEL, JOBS_CHANNEL, QUEUE_CHANNEL, Status, cancelled_error

log = logging.getLogger(__name__)

CancelReason = Literal["cancelled", "lost", "shutdown"]

# Cleared requests stay readable (404 to the API, but open streams can finish) this long before purge.
PURGE_CLEARED_AFTER_S = 600.0
# The liveness check never runs less often than this, whatever heartbeat_s says (cancel within ~1 s).
MAX_CHECK_INTERVAL_S = 1.0
# How long a stop waits for cancelled work to settle (give a request back, record a call: a statement or two);
# a task still going then is stuck on a database that stopped answering, and its lease brings its work back.
STOP_WAIT_S = 15.0


class _Work(Protocol):
    @property
    def id(self) -> uuid.UUID: ...

    @property
    def owner(self) -> str: ...  # the lease owner of its claim


W = TypeVar("W", bound=_Work)


def log_loop_failure(what: str, outages: OutageLog) -> None:
    """Log the exception being handled by a worker loop: a bug with its traceback, the database
    being unavailable as one warning line per ``what`` now and then (``outages``, the loop owner's)."""
    exc = sys.exc_info()[1]
    if exc is None or not is_unavailable(exc):
        log.exception("%s", what)
        return
    if outages.due(what):
        log.warning("%s: the database is unavailable (%s); retrying", what, unusable_reason(exc) or exc)


class SlotPool(Generic[W]):
    """Local slots for one kind of work: claim while a slot is free, run, claim again at once. ``claim``: the
    next unit or None, and whether the cluster is full; ``run``: one to its end; ``settle``: one cancelled."""

    def __init__(
        self,
        name: str,
        slots: int,
        *,
        claim: Callable[[], Awaitable[tuple[W | None, bool]]],
        run: Callable[[W], Awaitable[None]],
        settle: Callable[[W, CancelReason], Awaitable[None]],
        poll_s: float,
    ) -> None:
        self.name = name
        self.slots = slots
        self._claim = claim
        self._run = run
        self._settle = settle
        self._poll_s = poll_s
        self.tasks: dict[uuid.UUID, asyncio.Task[None]] = {}
        self._work: dict[uuid.UUID, W] = {}  # the unit each entry of ``tasks`` runs
        # Keyed by task, not by work id: a unit claimed again while its stale run still ends
        # (its lease expired during a database outage) has two tasks for a while; a task is here
        # until it ends, so a stale run, always cancelled, is still found here when the pool stops.
        self._cancel_reasons: dict[asyncio.Task[None], CancelReason] = {}
        self._wake = asyncio.Event()
        self._cluster_full = False
        self._outages = OutageLog()
        self._stopping = False

    @property
    def free(self) -> int:
        return self.slots - len(self.tasks)

    def held(self) -> dict[uuid.UUID, str]:
        """The lease owner of each unit this pool runs now (its newest run's claim)."""
        return {work_id: self._work[work_id].owner for work_id in self.tasks}

    def wake(self, *, freed: bool) -> None:
        """Work may be there: a slot freed somewhere (``freed``) or work was admitted / queued. No
        database work when every local slot is busy, nor for an admission while the cluster is full."""
        if self.free > 0 and (freed or not self._cluster_full):
            self._wake.set()

    def cancel(self, work_id: uuid.UUID, reason: CancelReason) -> None:
        task = self.tasks.get(work_id)
        if task is None or task.done() or task in self._cancel_reasons:
            # Cancel once only: a second cancel (NOTIFY and heartbeat both noticing) would interrupt
            # the cancelled task while it records its in-flight call's usage.
            return
        self._cancel_reasons[task] = reason
        task.cancel()

    async def loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                while self.free > 0 and not self._stopping:
                    work, self._cluster_full = await self._claim()
                    if work is None:
                        break
                    self._spawn(work)
            except Exception:
                log_loop_failure(f"{self.name} claim failed; retrying after the poll interval", self._outages)
            await wait_event(self._wake, self._poll_s)
            if not self._wake.is_set():
                self._cluster_full = False  # the poll fallback always tries again

    def _spawn(self, work: W) -> None:
        # A run of this unit still going here lost its lease (hence this claim): it is stopped as lost;
        # its writes carry the old claim's lease owner, so none lands (docs/pipeline.md, "Guarded writes").
        self.cancel(work.id, "lost")
        task = asyncio.create_task(self._guarded(work), name=f"sidequest-{self.name}-{work.id}")
        self.tasks[work.id] = task
        self._work[work.id] = work

    async def _guarded(self, work: W) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            await self._run(work)
        except asyncio.CancelledError:
            try:
                await self._settle(work, self._cancel_reasons.get(task, "cancelled"))
            except Exception:
                log_loop_failure(f"could not settle a cancelled {self.name}", self._outages)
        except Exception:
            log.exception("%s %s crashed", self.name, work.id)
        finally:
            # Only this run's entry: a newer run of the same work (see _spawn) keeps its own.
            if self.tasks.get(work.id) is task:
                del self.tasks[work.id]
                del self._work[work.id]
            self._cancel_reasons.pop(task, None)
            # Instant hand-off: the freed local slot is claimed again now, not at the next poll.
            self._cluster_full = False
            self._wake.set()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for work_id in list(self.tasks):
            self.cancel(work_id, "shutdown")
        await settle({*self.tasks.values(), *self._cancel_reasons}, STOP_WAIT_S, f"{self.name} tasks")


class Worker:
    """One worker process's loops. Build, :meth:`start`, and :meth:`stop`."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        *,
        database_url: str | None = None,
        listener: Listener | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        # Unique per process; each claim's lease owner adds a token of that claim (:func:`lease.claim_owner`).
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._outages = OutageLog()
        self._loops: list[asyncio.Task[None]] = []
        # The LISTEN connection that wakes it: its own, or the API's in `serve` (started and stopped there).
        self._own_listener = listener is None
        self.listener = listener or Listener(
            settings.listen_url(database_url or db.url), channels=WORKER_CHANNELS, on_connect=db.node_gone
        )
        self._unsubscribe: list[Callable[[], None]] = []
        self._deps = PipelineDeps(db=db, settings=settings, provider=build_provider(settings))
        # The prepared snapshots this worker keeps in memory (``sidequest serve``'s API feeds it).
        self.snapshots = self._deps.snapshots
        self.requests: SlotPool[queue.Claimed] = SlotPool(
            "request",
            settings.max_concurrency,
            claim=self._claim_request,
            run=self._run_request,
            settle=self._settle_request,
            poll_s=settings.poll_s,
        )
        self.jobs: SlotPool[jobs.ClaimedJob] = SlotPool(
            "job",
            settings.max_background_concurrency if settings.background_on else 0,
            claim=self._claim_job,
            run=self._run_job,
            settle=self._settle_job,
            poll_s=settings.poll_s,
        )

    async def start(self) -> None:
        """Connect the listener and start the loops; returns at once."""
        self._unsubscribe = [
            self.listener.subscribe(QUEUE_CHANNEL, self._on_queue_notify),
            self.listener.subscribe(JOBS_CHANNEL, self._on_jobs_notify),
            self.listener.subscribe(JOBS_CHANNEL, self._deps.waiter.notify),
            self.listener.subscribe(CANCEL_CHANNEL, self._on_cancel_notify),
        ]
        if self._own_listener:
            await self.listener.start()
        self._loops = [
            asyncio.create_task(self.requests.loop(), name="sidequest-claim"),
            asyncio.create_task(self._heartbeat_loop(), name="sidequest-heartbeat"),
            asyncio.create_task(self._sweep_loop(), name="sidequest-sweep"),
        ]
        if self.jobs.slots > 0:
            self._loops.append(asyncio.create_task(self.jobs.loop(), name="sidequest-claim-jobs"))
        log.info(
            "worker %s started with %d request slots and %d background slots",
            self.owner,
            self.requests.slots,
            self.jobs.slots,
        )

    async def stop(self) -> None:
        """Stop claiming, give running requests back to the queue, close everything."""
        for loop in self._loops:
            loop.cancel()
        await settle(self._loops, STOP_WAIT_S, "worker loops")
        await self.requests.stop()
        await self.jobs.stop()
        await self.snapshots.close()
        if self._own_listener:
            await self.listener.stop()
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        await self._deps.provider.aclose()
        log.info("worker %s stopped", self.owner)

    def _on_queue_notify(self, _channel: str, payload: str) -> None:
        # "freed:<session>" — a slot freed somewhere; a bare session id — a request was admitted;
        # "" — the listener reconnected (anything may have been missed).
        self.requests.wake(freed=payload.startswith("freed:") or not payload)

    def _on_jobs_notify(self, _channel: str, payload: str) -> None:
        self.jobs.wake(freed=payload != "queued")

    def _on_cancel_notify(self, _channel: str, payload: str) -> None:
        if not payload:
            return  # a reconnect wake-up: the heartbeat check catches anything missed
        with contextlib.suppress(ValueError):
            if payload.startswith("job:"):
                self.jobs.cancel(uuid.UUID(payload[4:]), "cancelled")
            else:
                self.requests.cancel(uuid.UUID(payload), "cancelled")

    async def _claim_request(self) -> tuple[queue.Claimed | None, bool]:
        async with self.db.connection() as conn, committed(conn):
            return await queue.try_claim(
                conn,
                owner=lease.claim_owner(self.owner),
                lease_s=self.settings.lease_s,
                max_running=self.settings.max_concurrency,
            )

    async def _run_request(self, claimed: queue.Claimed) -> None:
        log.info("request %s claimed (ordinal %s, attempt %s)", claimed.id, claimed.ordinal, claimed.attempt)
        outcome = await run_request(self._deps, claimed)
        if outcome.error is not None:
            # The code and the provider's own words: what an operator looks for first.
            log.info(
                "request %s ended: %s: %s: %s",
                claimed.id,
                outcome.status,
                outcome.error.get("code"),
                str(outcome.error.get("message", ""))[:300],
            )
        else:
            log.info("request %s ended: %s", claimed.id, outcome.status)

    async def _settle_request(self, claimed: queue.Claimed, reason: CancelReason) -> None:
        async with self.db.sessions() as session, session.begin():
            if reason == "shutdown":
                await queue.requeue_request(session, claimed.id, reason="worker_stopped", owner=claimed.owner)
            elif reason == "cancelled":
                # Normally the API wrote the terminal state already and this is a no-op.
                await terminal.finish_request(
                    session, claimed.id, status=Status.CANCELLED, owner=claimed.owner, error=cancelled_error()
                )

    async def _claim_job(self) -> tuple[jobs.ClaimedJob | None, bool]:
        async with self.db.connection() as conn, committed(conn):
            job = await jobs.claim_job(
                conn,
                owner=lease.claim_owner(self.owner),
                lease_s=self.settings.lease_s,
                max_running=self.settings.max_background_concurrency,
            )
        return job, False

    async def _run_job(self, job: jobs.ClaimedJob) -> None:
        log.info("background job %s (%s %s) claimed", job.id, job.kind, job.key)
        outcome = await run_job(self._deps, job)
        log.info("background job %s (%s) ended: %s", job.id, job.kind, outcome.status)

    async def _settle_job(self, job: jobs.ClaimedJob, reason: CancelReason) -> None:
        # A shutdown gives the job back (attempt not counted); a clear already ended it.
        async with self.db.sessions() as session, session.begin():
            if reason == "shutdown":
                await jobs.requeue_job(session, job.id, reason="worker_stopped", owner=job.owner)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.settings.heartbeat_s, MAX_CHECK_INTERVAL_S))
            requests, job_owners = self.requests.held(), self.jobs.held()
            if not requests and not job_owners:
                continue
            try:
                async with self.db.sessions() as session, session.begin():
                    held = await queue.heartbeat(
                        session, requests=requests, jobs=job_owners, lease_s=self.settings.lease_s
                    )
            except Exception:
                log_loop_failure("heartbeat failed", self._outages)
                continue
            for request_id in requests.keys() - held.requests:
                self.requests.cancel(request_id, "lost")
            for job_id in job_owners.keys() - held.jobs:
                self.jobs.cancel(job_id, "lost")

    async def _sweep_loop(self) -> None:
        while True:
            try:
                async with self.db.sessions() as session, session.begin():
                    result = await queue.sweep_expired(session)
                counts = (result.requeued, result.failed, result.jobs_requeued, result.jobs_failed)
                if any(counts):
                    log.warning(
                        "recovered expired leases: re-queued %s, failed %s; jobs re-queued %s, failed %s",
                        *counts,
                    )
                    self.requests.wake(freed=True)
                    self.jobs.wake(freed=True)
                async with self.db.sessions() as session, session.begin():
                    await purge_cleared(session, PURGE_CLEARED_AFTER_S)
            except Exception:
                log_loop_failure("recovery sweep failed", self._outages)
            await asyncio.sleep(max(self.settings.poll_s, min(self.settings.lease_s / 2, 10.0)))
