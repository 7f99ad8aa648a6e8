"""Group commit for admissions: one admission alone is one ``CALL sidequest_admit_now``; those arriving while
:data:`IN_FLIGHT` CALLs are in flight go together in one ``CALL sidequest_admit_many`` (how and why:
docs/architecture.md, "Admission"). An unreachable database fails the batch and all waiting behind it at once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import asyncpg

from service.store import queries
from service.store.execute import positional

# Admissions in one CALL at most, and CALLs in flight at once (each holds a pool connection).
MAX_BATCH: Final = 64
IN_FLIGHT: Final = 3


@dataclass(frozen=True)
class AdmitResult:
    """What ``sidequest_admit()`` returned for one admission."""

    outcome: str
    detail: dict[str, Any] | None
    superseded: tuple[uuid.UUID, ...]
    request: Mapping[str, Any] | None


# The argument tuple of one admission, in the CALLs' parameter order (admission._arguments).
Arguments = tuple[Any, ...]
_TENANT, _PARENT = 0, 1


class AdmissionBatcher:
    """Sends admissions to PostgreSQL, several to a CALL when several are waiting."""

    def __init__(
        self,
        pool: Callable[[], Awaitable[asyncpg.Pool]],
        unavailable: Callable[[BaseException], bool],
    ) -> None:
        self._pool = pool
        # The store's one rule for "the database is unreachable" (db.is_unavailable), passed in.
        self._unavailable = unavailable
        self._waiting: list[tuple[Arguments, asyncio.Future[AdmitResult]]] = []
        self._senders: set[asyncio.Task[None]] = set()
        # For tests and benchmarks: CALLs that committed (both kinds), the admissions they carried,
        # and batches that failed and were sent again one by one.
        self.calls = 0
        self.admissions = 0
        self.fallbacks = 0

    async def admit(self, args: Arguments) -> AdmitResult:
        """Admit one question (``args`` in ``sidequest_admit_now``'s order); committed on return."""
        future: asyncio.Future[AdmitResult] = asyncio.get_running_loop().create_future()
        # Marked retrieved, so that an error nobody awaits any more (a cancelled caller) is not logged.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._waiting.append((args, future))
        if len(self._senders) < IN_FLIGHT:
            self._senders.add(asyncio.create_task(self._send_waiting()))
        # A caller cancelled meanwhile (a client that hung up) cancels only this future: the sender
        # still sends the admission, and skips answering it.
        return await future

    async def drain(self) -> None:
        """Wait until every admission handed in has been answered (before the pool closes)."""
        while self._senders:
            await asyncio.gather(*list(self._senders), return_exceptions=True)

    async def _send_waiting(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
                try:
                    await self._send(batch)
                except Exception as exc:  # never leave a caller waiting
                    if self._unavailable(exc):
                        # Those that came in meanwhile would only wait for the same failure (a
                        # connect timeout each): 503 now, within one timeout (SPEC 9).
                        batch, self._waiting = batch + self._waiting, []
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                except BaseException:
                    for _, future in batch:
                        future.cancel()
                    raise
        finally:
            # Leaves the set in the step that found nothing waiting: a done-callback would run a
            # step later, and an admission handed in meanwhile would be left waiting.
            sender = asyncio.current_task()
            assert sender is not None
            self._senders.discard(sender)

    async def _send(self, batch: list[tuple[Arguments, asyncio.Future[AdmitResult]]]) -> None:
        pool = await self._pool()
        if len(batch) == 1:
            await self._send_alone(pool, *batch[0])
            return
        # Sessions in one order in every batch (docs/architecture.md, "Admission"); arrival order within one.
        ordered = sorted(batch, key=lambda item: (item[0][_TENANT], item[0][_PARENT]))
        columns = [list(column) for column in zip(*(args for args, _ in ordered), strict=True)]
        try:
            async with pool.acquire() as conn:
                # Outside any transaction block, so that the procedure may commit.
                row = await conn.fetchrow(positional(queries.admit_many)[0], *columns)
        except Exception as exc:
            if self._unavailable(exc) or not isinstance(exc, asyncpg.PostgresError):
                raise
            # Nothing of the CALL committed: each admission again, alone, so the one at fault gets the error.
            self.fallbacks += 1
            for args, future in ordered:
                try:
                    await self._send_alone(pool, args, future)
                except Exception as alone:
                    if not future.done():
                        future.set_exception(alone)
            return
        self.calls += 1
        assert row is not None
        for i, (_, future) in enumerate(ordered):
            superseded = tuple(uuid.UUID(s) for s in (row["superseded"][i] or ()))
            self._answer(future, AdmitResult(row["outcome"][i], row["detail"][i], superseded, row["req"][i]))

    async def _send_alone(
        self, pool: asyncpg.Pool, args: Arguments, future: asyncio.Future[AdmitResult]
    ) -> None:
        async with pool.acquire() as conn:
            row = await conn.fetchrow(positional(queries.admit_now)[0], *args)
        self.calls += 1
        assert row is not None
        self._answer(
            future, AdmitResult(row["outcome"], row["detail"], tuple(row["superseded"] or ()), row["req"])
        )

    def _answer(self, future: asyncio.Future[AdmitResult], result: AdmitResult) -> None:
        """One admission's committed result, to its caller unless the caller is gone."""
        self.admissions += 1
        if not future.done():
            future.set_result(result)
