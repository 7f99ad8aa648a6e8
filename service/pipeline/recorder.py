"""The pipeline's call recorders: a request's (a ledger row, then a ``usage`` event) and a job's."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Generic, TypeVar

from service.providers.calling import CallRecord
from service.store import jobs, lease, ledger
from service.store.db import Database, is_unavailable
from service.store.execute import committed

# Waits between a ledger write's tries while the database is unavailable (then one last try): about half a
# minute in all, so a restart or a failover (longer than a few seconds) does not lose a call's tokens. Tries
# are safe to repeat: an entry already recorded (its call_id) adds nothing.
LEDGER_RETRY_WAITS_S: tuple[float, ...] = (0.2, 1.0, 2.0, 4.0, 8.0, 15.0)


async def write_retrying(write: Callable[[], Awaitable[None]]) -> None:
    """``write()``, tried again over a fresh connection while the database is unavailable (a pooled
    connection dropped by a restart fails its first use) — not while the task is being cancelled (a
    shutdown or a cancel waits for this write; one try is what it gets then)."""
    for wait_s in (*LEDGER_RETRY_WAITS_S, None):
        try:
            await write()
            return
        except Exception as exc:
            task = asyncio.current_task()
            if wait_s is None or not is_unavailable(exc) or (task is not None and task.cancelling()):
                raise
        await asyncio.sleep(wait_s)


T = TypeVar("T")


def _ledger_entry(call: CallRecord) -> ledger.CallEntry:
    return ledger.CallEntry(
        purpose=call.purpose,
        model=call.model,
        status=call.status,
        latency_ms=call.latency_ms,
        **asdict(call.usage),
    )


class GroupWrite(Generic[T]):
    """Writes of one row that arrive while one is in flight go together in the next (group commit).
    :meth:`add` returns once its item is written (or raises what the write raised); a caller cancelled
    while it waits leaves the write to the others."""

    def __init__(self, write: Callable[[list[T]], Awaitable[None]]) -> None:
        self._write = write
        self._pending: list[T] = []
        self._next: asyncio.Future[None] | None = None  # the write the pending items wait for
        self._writer: asyncio.Task[None] | None = None

    async def add(self, item: T) -> None:
        self._pending.append(item)
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            # Retrieved even when every waiter was cancelled (no "exception never retrieved").
            self._next.add_done_callback(lambda done: done.cancelled() or done.exception())
        written = self._next
        if self._writer is None:
            self._writer = asyncio.ensure_future(self._drain())
        await asyncio.shield(written)

    async def _drain(self) -> None:
        try:
            while self._pending:
                items, written = self._pending, self._next
                self._pending, self._next = [], None
                assert written is not None
                try:
                    await self._write(items)
                except BaseException as exc:
                    written.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                else:
                    written.set_result(None)
        finally:
            self._writer = None


class JobRecorder:
    """A background job's recorder: each call appended to the job's row, each attempt counted on it
    before it starts, writes that come together sharing one (docs/pipeline.md, "Background summary jobs")."""

    def __init__(self, db: Database, job_id: uuid.UUID) -> None:
        self._db = db
        self._job_id = job_id
        self._ends: GroupWrite[ledger.CallEntry] = GroupWrite(self._append)
        self._starts: GroupWrite[None] = GroupWrite(self._count)

    async def record_call(self, call: CallRecord) -> None:
        await self._ends.add(_ledger_entry(call))  # returns once it is written

    async def attempt_started(self) -> None:
        """Count a call on the job's row before it starts (what a clear reports if it cancels the job)."""
        await self._starts.add(None)

    async def _append(self, entries: list[ledger.CallEntry]) -> None:
        async def write() -> None:
            async with self._db.connection() as conn, committed(conn):
                await ledger.append_calls(conn, self._job_id, entries, job=True)

        await write_retrying(write)

    async def _count(self, attempts: list[None]) -> None:
        async with self._db.connection() as conn, committed(conn):
            await jobs.count_calls(conn, self._job_id, len(attempts))


class LedgerRecorder:
    """Persists each provider call the moment it ends, then tells the streams the cumulative usage (SPEC §4
    ``usage``). Only the event is lease-guarded: tokens were spent whatever happened to the request."""

    def __init__(self, db: Database, request_id: uuid.UUID, owner: str) -> None:
        self._db = db
        self._request_id = request_id
        self._owner = owner
        # Set while the answer streams: buffered delta text is written before the usage event.
        self.before_usage: Callable[[], Awaitable[None]] | None = None
        # Set while the answer streams: a successful call of this purpose (the answer's, not a shrink's
        # summary calls) waits in ``held``, written with the success (one commit: terminal.finish_succeeded).
        self.hold_purpose: str | None = None
        self.held: ledger.CallEntry | None = None

    async def record_call(self, call: CallRecord) -> None:
        entry = _ledger_entry(call)
        if entry.status == "ok" and entry.purpose == self.hold_purpose:
            self.held = entry
            return
        # The streamed text comes before the usage event; the ledger and the event are one commit.
        if self.before_usage is not None and entry.status != "cancelled":
            await self.before_usage()
        await self._write(entry)

    async def _write(self, entry: ledger.CallEntry) -> None:
        """The ledger entry and its usage event (:func:`write_retrying`): tokens were spent, and the
        ledger is what SPEC §9 keeps when the request is run again."""

        async def write() -> None:
            async with self._db.sessions() as session, session.begin():
                appended = await ledger.append_calls(session, self._request_id, [entry])
                # Only the event is lease-guarded (no event after a terminal one); a call already
                # recorded (a retried write whose first COMMIT was applied) adds no event either.
                if appended.added:
                    usage_event = ("usage", {"usage": appended.usage})
                    await lease.emit_if_held(session, self._request_id, self._owner, [usage_event])

        await write_retrying(write)

    def take_held(self) -> ledger.CallEntry | None:
        """The held call, now the caller's to write."""
        entry, self.held = self.held, None
        return entry

    async def write_held(self) -> None:
        """Write a held call on its own, with its usage event (the success it waited for did not come)."""
        entry = self.take_held()
        if entry is not None:
            await self._write(entry)
