"""The pipeline's call recorder: a ledger row first, then a ``usage`` event."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Literal

from service.providers.base import CallUsage
from service.store import jobs, ledger
from service.store.db import Database


def call_entry(
    purpose: str, model: str, status: Literal["ok", "failed", "cancelled"], usage: CallUsage, latency_ms: int
) -> ledger.CallEntry:
    """One provider call as the ledger stores it (SPEC §3 ``usage.calls[]``), from what it reported."""
    return ledger.CallEntry(
        purpose=purpose,
        model=model,
        status=status,
        reported=usage.reported,
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        reasoning_tokens=usage.reasoning_tokens,
        cached_tokens=usage.cached_tokens,
        latency_ms=latency_ms,
    )


class JobRecorder:
    """A background job's recorder: each call persisted on the job's row the moment it ends (the
    session's ``background.usage``); a job has no request stream to tell."""

    def __init__(self, db: Database, job_id: uuid.UUID) -> None:
        self._db = db
        self._job_id = job_id
        # The count write the attempts starting now join, and how many have joined it.
        self._round: asyncio.Future[None] | None = None
        self._joined = 0

    async def record_call(
        self,
        *,
        purpose: str,
        model: str,
        status: Literal["ok", "failed", "cancelled"],
        usage: CallUsage,
        latency_ms: int = 0,
    ) -> None:
        """Append one call to the job's usage."""
        async with self._db.connection() as conn:
            await ledger.append_call(
                conn, self._job_id, call_entry(purpose, model, status, usage, latency_ms), job=True
            )

    async def attempt_started(self) -> None:
        """Count a call on the job's row before it starts (what a clear reports if it cancels the job).

        The attempts that start in the same turn of the event loop — a round of parallel chunks —
        share one write: four writes of the same row, each waiting for the last one's commit, held
        the fourth chunk's call back by ~10 ms (issue 11). The call still starts only once it is
        counted. A joiner that is cancelled leaves the write to the others (it is shielded).
        """
        if self._round is None:
            self._round = asyncio.ensure_future(self._count_round())
        self._joined += 1
        await asyncio.shield(self._round)

    async def _count_round(self) -> None:
        await asyncio.sleep(0)  # the other attempts of this turn join first
        joined, self._joined, self._round = self._joined, 0, None
        async with self._db.connection() as conn:
            await jobs.count_calls(conn, self._job_id, joined)


class LedgerRecorder:
    """Persists each provider call the moment it ends, then tells the streams (SPEC §4 ``usage``).

    The ledger write is not lease-guarded (tokens were spent whatever happened to the request), the
    event is: after a cancel or clear no event may follow the terminal one.
    """

    def __init__(self, db: Database, request_id: uuid.UUID, owner: str) -> None:
        self._db = db
        self._request_id = request_id
        self._owner = owner
        self.calls = 0
        # Set while the answer streams: buffered delta text is written before the usage event.
        self.before_usage: Callable[[], Awaitable[None]] | None = None
        # Set while the answer streams: a successful call of this purpose (the answer's, not a
        # shrink's summary calls) is not written at once but kept in ``held``, and written with the
        # request's success (one commit: terminal.finish_succeeded).
        self.hold_purpose: str | None = None
        self.held: ledger.CallEntry | None = None

    async def record_call(
        self,
        *,
        purpose: str,
        model: str,
        status: Literal["ok", "failed", "cancelled"],
        usage: CallUsage,
        latency_ms: int = 0,
    ) -> None:
        """Append one call to the ledger and emit the cumulative usage object."""
        entry = call_entry(purpose, model, status, usage, latency_ms)
        if status == "ok" and purpose == self.hold_purpose:
            self.held = entry
            self.calls += 1
            return
        # The streamed text comes before the usage event; the ledger and the event are one commit.
        if self.before_usage is not None and status != "cancelled":
            await self.before_usage()
        async with self._db.sessions() as session:
            await ledger.append_call_and_emit(session, self._request_id, entry, owner=self._owner)
        self.calls += 1

    def take_held(self) -> ledger.CallEntry | None:
        """The held call, now the caller's to write."""
        entry, self.held = self.held, None
        return entry

    async def write_held(self) -> None:
        """Write a held call on its own, with its usage event (the success it waited for did not come)."""
        entry = self.take_held()
        if entry is not None:
            async with self._db.sessions() as session:
                await ledger.append_call_and_emit(session, self._request_id, entry, owner=self._owner)
