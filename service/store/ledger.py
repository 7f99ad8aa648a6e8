"""The usage ledger and the request's live metadata (``context_info``).

Each provider call's usage is appended the moment the call ends (ok, failed or cancelled) in one
``UPDATE`` that also recomputes the totals from the per-call list, so the totals can never disagree with
the calls and a worker crash right after a call loses nothing. Totals come only from reported usage: a
call the provider sent no usage for is recorded with zeros and ``reported: false``.

Usage is recorded even after the request left ``running`` (a call cancelled by a clear still cost
tokens); only events are guarded by the lease (see :mod:`service.store.queue`).

Each call carries its own ``call_id``, and an append whose calls are already in the list changes
nothing: a write tried again because the database's reply was lost — its COMMIT may have been applied —
never counts a call twice.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from service.store import queries
from service.store.events import append_event
from service.store.execute import Executor, committed, fetch_value
from service.store.lease import lock_if_held

USAGE_FIELDS = ("input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens")

# The appends (a request's, a background job's: the same usage object, SPEC §3, each in its own
# table) and the reads of the usage as it stands: named queries in service/store/sql/ledger.sql, with
# why the totals are computed inside the SET expression.


@dataclass(frozen=True)
class CallEntry:
    """One provider call as the ledger stores it (SPEC §3 ``usage.calls[]``)."""

    purpose: str
    model: str
    status: str  # ok | failed | cancelled
    reported: bool
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    # Wall time of the call; not in SPEC's list, kept for the provider latency metric.
    latency_ms: int | None = None
    # This call's identity: an append tried again after a lost reply does not count it twice.
    call_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def as_json(self) -> dict[str, Any]:
        extra = {} if self.latency_ms is None else {"latency_ms": self.latency_ms}
        return {
            "purpose": self.purpose,
            "model": self.model,
            "status": self.status,
            "reported": self.reported,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "cached_tokens": self.cached_tokens,
            **extra,
            "call_id": self.call_id,
        }


async def append_call(
    x: Executor, request_id: uuid.UUID, entry: CallEntry, *, job: bool = False
) -> dict[str, Any]:
    """Append one call to the request's (or, with ``job``, the background job's) usage; commits.

    The totals are recomputed from the calls in the same statement, and the row lock taken by the
    ``UPDATE`` serialises concurrent appends. Returns the new usage object.
    """
    return await append_calls(x, request_id, [entry], job=job)


async def append_calls(
    x: Executor, request_id: uuid.UUID, entries: Sequence[CallEntry], *, job: bool = False
) -> dict[str, Any]:
    """:func:`append_call` of several calls, in this order, in one statement; commits."""
    async with committed(x):
        appended = await _append(x, request_id, entries, job=job)
    return appended.usage


@dataclass(frozen=True)
class Appended:
    """The usage after an append, and whether the append added its calls (False: already there)."""

    usage: dict[str, Any]
    added: bool


async def _append(x: Executor, row_id: uuid.UUID, entries: Sequence[CallEntry], *, job: bool) -> Appended:
    statement = queries.append_job_calls if job else queries.append_request_calls
    params = {"id": row_id, "call": json.dumps([entry.as_json() for entry in entries])}
    usage = await fetch_value(x, statement, params)
    if usage is not None:
        return Appended(dict(usage), added=True)
    usage = await fetch_value(x, queries.job_usage if job else queries.request_usage, {"id": row_id})
    if usage is None:
        raise LookupError(f"{'job' if job else 'request'} {row_id} does not exist")
    return Appended(dict(usage), added=False)


async def append_call_and_emit(
    session: AsyncSession, request_id: uuid.UUID, entry: CallEntry, *, owner: str
) -> dict[str, Any]:
    """Append one call to the request's usage and, while ``owner`` still holds the request, its
    ``usage`` event with the new totals — one transaction; commits. Returns the new usage object.

    The ledger part is written whatever happened to the request (tokens were spent); only the event
    is guarded by the lease (no event after a terminal one). A call already recorded (a retried
    write whose first COMMIT was applied) adds nothing, not even the event.
    """
    async with session.begin():
        appended = await add_call(session, request_id, entry)
        if appended.added and await lock_if_held(session, request_id, owner):
            await append_event(session, request_id, "usage", {"usage": appended.usage})
    return appended.usage


async def add_call(session: Executor, request_id: uuid.UUID, entry: CallEntry) -> Appended:
    """Append one call to the request's usage inside the caller's transaction."""
    return await _append(session, request_id, [entry], job=False)


async def merge_context_info(session: AsyncSession, request_id: uuid.UUID, fields: dict[str, Any]) -> None:
    """Merge ``fields`` into the request's ``context_info`` (top-level keys replaced); commits.

    Not lease-guarded: context_info is metadata about what was done, and keeping it current after a
    cancel is harmless and useful (it shows how far the request got).
    """
    async with session.begin():
        await session.execute(
            queries.merge_context_info,
            {"id": request_id, "info": json.dumps(fields, ensure_ascii=False)},
        )
