"""The worker: slots, the claim loop, heartbeats, cancellation and the recovery sweep (SPEC §9).

Any number of worker processes share one PostgreSQL; the global cap (``max_concurrency`` running
requests across *all* of them) is enforced by the claim itself (:func:`service.store.queue.claim_next`),
so each process simply tries to fill up to ``max_concurrency`` local slots and the database says no
when the cluster is full. The loops:

- **claim** — woken by ``NOTIFY sidequest_queue`` (admission, a freed slot) with ``poll_s`` polling as
  the fallback for lost notifications; claims until it has no free slot or nothing is eligible.
- **heartbeat** — every ``min(heartbeat_s, 1 s)`` extends the leases of the requests it runs, in one
  statement; a request no longer held (cancelled, cleared, taken over) has its task cancelled, so a
  cancel whose NOTIFY was lost still stops the request within about a second.
- **cancel** — ``NOTIFY sidequest_cancel`` with a request id cancels that task at once.
- **sweep** — re-queues or fails (``worker_lost``) requests whose lease expired, and purges cleared
  requests once their streams had time to read the final events.

A cancelled task records its in-flight provider call as ``cancelled`` (the calling policy does that) and
then, depending on why it was cancelled, writes ``cancelled`` (a no-op when the API already did), writes
nothing (lost), or gives the request back to the queue (worker shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable
from typing import Literal

from service.config import Settings
from service.pipeline import PipelineDeps, run_request
from service.providers import build_provider
from service.providers.base import Provider
from service.store import queue
from service.store.admission import purge_cleared
from service.store.db import Database
from service.store.listener import CANCEL_CHANNEL, QUEUE_CHANNEL, Listener

log = logging.getLogger(__name__)

CancelReason = Literal["cancelled", "lost", "shutdown"]

# Cleared requests stay readable (404 to the API, but open streams can finish) this long before purge.
PURGE_CLEARED_AFTER_S = 600.0
# The liveness check never runs less often than this, whatever heartbeat_s says (cancel within ~1 s).
MAX_CHECK_INTERVAL_S = 1.0


def worker_id() -> str:
    """A lease owner name unique to this process: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Worker:
    """One worker process's loops. Build, :meth:`start`, and :meth:`stop`."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        *,
        database_url: str | None = None,
        provider: Provider | None = None,
        owner: str | None = None,
        listener: Listener | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.owner = owner or worker_id()
        self.slots = settings.max_concurrency
        self._database_url = database_url or db.engine.url.render_as_string(hide_password=False)
        self._provider = provider
        self._own_provider = provider is None
        self._tasks: dict[uuid.UUID, asyncio.Task[None]] = {}
        self._cancel_reasons: dict[uuid.UUID, CancelReason] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self._loops: list[asyncio.Task[None]] = []
        # A shared listener (the API's, in `serve`) is started and stopped by its owner.
        self._own_listener = listener is None
        self._listener = listener or Listener(self._database_url, channels=(QUEUE_CHANNEL, CANCEL_CHANNEL))
        self._unsubscribe: list[Callable[[], None]] = []

    @property
    def listener(self) -> Listener:
        """The LISTEN connection this worker is woken through (its own, or the process's)."""
        return self._listener

    @property
    def running(self) -> set[uuid.UUID]:
        """Ids of the requests this process runs right now."""
        return set(self._tasks)

    async def start(self) -> None:
        """Connect the listener and start the loops; returns at once."""
        if self._provider is None:
            self._provider = build_provider(self.settings)
        self._unsubscribe = [
            self._listener.subscribe(QUEUE_CHANNEL, lambda _c, _p: self._wake.set()),
            self._listener.subscribe(CANCEL_CHANNEL, self._on_cancel_notify),
        ]
        if self._own_listener:
            await self._listener.start()
        self._loops = [
            asyncio.create_task(self._claim_loop(), name="sidequest-claim"),
            asyncio.create_task(self._heartbeat_loop(), name="sidequest-heartbeat"),
            asyncio.create_task(self._sweep_loop(), name="sidequest-sweep"),
        ]
        log.info("worker %s started with %d slots", self.owner, self.slots)

    async def stop(self) -> None:
        """Stop claiming, give running requests back to the queue, close everything."""
        self._stopping = True
        self._wake.set()
        for loop in self._loops:
            loop.cancel()
        for loop in self._loops:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loop
        for request_id in list(self._tasks):
            self._cancel(request_id, "shutdown")
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._own_listener:
            await self._listener.stop()
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        if self._own_provider and self._provider is not None:
            await self._provider.aclose()
        log.info("worker %s stopped", self.owner)

    # ------------------------------------------------------------------ cancellation

    def _on_cancel_notify(self, _channel: str, payload: str) -> None:
        if not payload:
            return  # a reconnect wake-up: the heartbeat check catches anything missed
        with contextlib.suppress(ValueError):
            self._cancel(uuid.UUID(payload), "cancelled")

    def _cancel(self, request_id: uuid.UUID, reason: CancelReason) -> None:
        task = self._tasks.get(request_id)
        if task is None or task.done() or request_id in self._cancel_reasons:
            # Cancel once only: a second cancel (NOTIFY and heartbeat both noticing) would interrupt
            # the cancelled task while it records its in-flight call's usage.
            return
        self._cancel_reasons[request_id] = reason
        task.cancel()

    # ------------------------------------------------------------------ loops

    async def _claim_loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                while len(self._tasks) < self.slots and not self._stopping:
                    async with self.db.sessions() as session:
                        claimed = await queue.claim_next(
                            session,
                            owner=self.owner,
                            lease_s=self.settings.lease_s,
                            max_running=self.settings.max_concurrency,
                        )
                    if claimed is None:
                        break
                    self._spawn(claimed)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("claim failed; retrying after the poll interval")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.poll_s)

    def _spawn(self, claimed: queue.Claimed) -> None:
        task = asyncio.create_task(self._run(claimed), name=f"sidequest-request-{claimed.id}")
        self._tasks[claimed.id] = task

    async def _run(self, claimed: queue.Claimed) -> None:
        assert self._provider is not None
        deps = PipelineDeps(db=self.db, settings=self.settings, provider=self._provider, owner=self.owner)
        try:
            outcome = await run_request(deps, claimed)
            log.info("request %s ended: %s", claimed.id, outcome.status)
        except asyncio.CancelledError:
            await self._after_cancel(claimed)
        except Exception:
            log.exception("request %s crashed", claimed.id)
        finally:
            self._tasks.pop(claimed.id, None)
            self._cancel_reasons.pop(claimed.id, None)
            self._wake.set()  # a local slot is free

    async def _after_cancel(self, claimed: queue.Claimed) -> None:
        reason = self._cancel_reasons.get(claimed.id, "cancelled")
        try:
            async with self.db.sessions() as session:
                if reason == "shutdown":
                    await queue.release(session, claimed.id, self.owner)
                elif reason == "cancelled":
                    # Normally the API wrote the terminal state already and this is a no-op.
                    await queue.finish_failed(
                        session,
                        claimed.id,
                        self.owner,
                        code="cancelled",
                        message="the request was cancelled",
                        status="cancelled",
                    )
        except Exception:
            log.exception("could not settle cancelled request %s", claimed.id)

    async def _heartbeat_loop(self) -> None:
        interval = min(self.settings.heartbeat_s, MAX_CHECK_INTERVAL_S)
        while True:
            await asyncio.sleep(interval)
            ids = list(self._tasks)
            if not ids:
                continue
            try:
                async with self.db.sessions() as session:
                    held = await queue.heartbeat(
                        session, owner=self.owner, request_ids=ids, lease_s=self.settings.lease_s
                    )
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("heartbeat failed")
                continue
            for request_id in ids:
                if request_id not in held:
                    self._cancel(request_id, "lost")

    async def _sweep_loop(self) -> None:
        interval = max(self.settings.poll_s, min(self.settings.lease_s / 2, 10.0))
        while True:
            try:
                async with self.db.sessions() as session:
                    result = await queue.sweep_expired(session)
                if result.requeued or result.failed:
                    log.warning(
                        "recovered expired leases: re-queued %s, failed %s", result.requeued, result.failed
                    )
                    self._wake.set()
                await self._purge_cleared()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("recovery sweep failed")
            await asyncio.sleep(interval)

    async def _purge_cleared(self) -> None:
        async with self.db.sessions() as session, session.begin():
            await purge_cleared(session, PURGE_CLEARED_AFTER_S)
