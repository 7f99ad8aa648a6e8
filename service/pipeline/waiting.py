"""A request's side of single flight (SPEC §6.6; docs/pipeline.md, "Single flight"): waiting for a
background job that makes what it needs, and registering a summary it makes itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from service.aio import wait_event
from service.store import jobs
from service.vocabulary import ACTIVE, JobKind, Status, waiting_for_background

if TYPE_CHECKING:  # the runtime imports this module
    from service.pipeline.runtime import RequestRuntime

# Re-read a waited-for job at least this often even without a notification.
FALLBACK_POLL_S = 0.5
# A *queued* job is waited for this long to start, then the request takes it over rather than wait
# behind a queue that may be long, or have no worker at all (docs/pipeline.md, "Single flight").
QUEUED_GRACE_S = 1.0
# A request's single-flight registration outlives its deadline by this much: it never expires under a
# request still finishing its summary (the request's own timeout fires a little after its deadline),
# and one its request could not end (a worker that died) is swept this long after that deadline.
REGISTRATION_LEASE_MARGIN_S = 30.0


class JobWaiter:
    """Wakes every waiter when a job ends (any job: each re-reads its own; ends are rare)."""

    def __init__(self) -> None:
        # Set, then replaced by a fresh one, at each notification: a waiter that took it before
        # reading its job's state is woken by any change after that read.
        self.changed = asyncio.Event()

    def notify(self, _channel: str = "", _payload: str = "") -> None:
        """A job queued, ended or freed a slot (listener callback: never blocks)."""
        self.changed.set()
        self.changed = asyncio.Event()


async def wait_for_job(rt: RequestRuntime, job_id: uuid.UUID) -> int:
    """Wait until ``job_id`` is no longer queued or running; the wait in ms. A job still queued after
    :data:`QUEUED_GRACE_S` is taken over; ``TimeoutError`` when the request's deadline passes first."""
    db, started = rt.db, time.monotonic()
    queued_since: float | None = None
    while True:
        wake = rt.deps.waiter.changed
        async with db.connection() as conn:
            state = await jobs.job_state(conn, job_id)
        if state is not None and state.status == Status.QUEUED:
            queued_since = time.monotonic() if queued_since is None else queued_since
            if time.monotonic() - queued_since >= QUEUED_GRACE_S:
                async with db.sessions() as session:
                    async with session.begin():
                        taken = await jobs.take_over(session, job_id)
                    if taken:
                        state = await jobs.job_state(session, job_id)
        else:
            queued_since = None
        if state is None or state.status not in ACTIVE:
            return int((time.monotonic() - started) * 1000)
        left = rt.remaining_s()
        if left <= 0:
            raise TimeoutError("deadline passed while waiting for a background summary")
        poll = QUEUED_GRACE_S / 4 if queued_since is not None else FALLBACK_POLL_S
        await wait_event(wake, min(poll, left))


async def wait_for_background_jobs(
    rt: RequestRuntime, kind: JobKind, keys: set[str] | None = None
) -> int | None:
    """Wait in turn for each of the session's active ``kind`` jobs (only background ones keyed in ``keys``,
    when given), each announced by a progress event; the total wait in ms, None with none to wait for."""
    async with rt.db.connection() as conn:
        active = await jobs.active_jobs(conn, rt.claimed.session_id, kind)
    if keys is not None:
        active = [job for job in active if job.key in keys and job.made_by == "background"]
    if not active:
        return None
    waited = 0
    for job in active:
        await rt.progress(waiting_for_background(str(job.id), job.kind, job.key))
        started = time.monotonic()
        try:
            waited += await wait_for_job(rt, job.id)
        except TimeoutError:
            # At the deadline the request fails with timeout: its record still says how long it waited, and
            # for what (a statement timing out before then leaves the request lost, nothing written).
            part = rt.info.qa_summary if job.kind == JobKind.QA_FOLD else rt.info.context_summary
            if part is not None:
                part.waited_ms += waited + int((time.monotonic() - started) * 1000)
            raise
    return waited


@contextlib.asynccontextmanager
async def registered(rt: RequestRuntime, kind: JobKind, key: str) -> AsyncIterator[bool]:
    """Register that this request makes (kind, key) itself; yields False when someone else holds it.
    The registration ends with the block (made or not), so a failed attempt never blocks the next."""
    async with rt.db.sessions() as session, session.begin():
        registration = await jobs.register_inline(
            session,
            rt.claimed.session_id,
            kind=kind,
            key=key,
            request_id=rt.claimed.id,
            owner=rt.owner,
            clear_version=rt.claimed.clear_version,
            lease_s=rt.remaining_s() + REGISTRATION_LEASE_MARGIN_S,
        )
    if registration is None:
        yield False
        return
    ok = False
    try:
        yield True
        ok = True
    finally:
        with contextlib.suppress(Exception):  # best effort: an unended registration expires by lease
            async with rt.db.sessions() as session, session.begin():
                await jobs.end_inline(session, registration, ok=ok)
