"""The event log: append (with NOTIFY) and read-after, for request and session streams.

Ordering guarantees that make ``Last-Event-ID`` resumption gap-free:

- ``seq`` is per request, taken with ``UPDATE … SET event_seq = event_seq + 1 RETURNING`` so the
  request row lock orders appends of one request;
- the global ``id`` is allocated while holding a transaction-level advisory lock on the session, so the
  events of one session commit in ``id`` order and a reader that saw id N never later finds an
  uncommitted id < N of the same session appear.

Callers keep the transaction that appends an event short (never across a model call).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.store import queries
from service.store.execute import Executor, fetch_all, fetch_one, json_text
from service.store.models import EventRow, RequestRow, SessionRow
from service.vocabulary import utc_iso

TERMINAL_EVENT_TYPES = frozenset({"done", "error"})


@dataclass(frozen=True)
class Event:
    """One stored event as streams send it.

    ``request_id`` and ``seq`` are None for a session-level event (``memory``, ``handoff``), which
    only session streams carry.
    """

    id: int
    request_id: uuid.UUID | None
    session_id: uuid.UUID
    seq: int | None
    type: str
    data: dict[str, Any]

    @property
    def is_terminal(self) -> bool:
        return self.type in TERMINAL_EVENT_TYPES


def _event(row: EventRow) -> Event:
    return Event(row.id, row.request_id, row.session_id, row.seq, row.type, row.data)


async def append_event(
    session: Executor,
    request_id: uuid.UUID,
    event_type: str,
    fields: dict[str, Any],
) -> Event:
    """Append one event inside the caller's transaction and NOTIFY listeners (delivered at commit).

    ``data`` gets ``request_id``, ``ordinal``, ``seq`` and ``at`` added to ``fields``. One round trip:
    the SQL function ``sidequest_append_event`` (migration 0004) bumps the request's ``seq``, takes the
    session's event lock, inserts the row and NOTIFYs, in that order.
    """
    at = utc_iso()
    row = await fetch_one(
        session,
        queries.append_event,
        {
            "request_id": request_id,
            "type": event_type,
            "fields": json_text(fields),
            "at": at,
        },
    )
    assert row is not None
    data = {"request_id": str(request_id), "ordinal": row["ordinal"], "seq": row["seq"], "at": at, **fields}
    return Event(row["event_id"], request_id, row["session_id"], row["seq"], event_type, data)


async def append_session_event(
    session: Executor, session_id: uuid.UUID, event_type: str, fields: dict[str, Any]
) -> Event:
    """Append one session-level event (no request: ``memory``, ``handoff``) in the caller's transaction.

    Same ordering rule as :func:`append_event` (the session's advisory lock is taken before the id is
    drawn), so session streams resume without gaps; ``data`` gets ``request_id``/``ordinal``/``seq``
    null and ``at``.
    """
    row = await fetch_one(
        session,
        queries.append_session_event,
        {"sid": session_id, "type": event_type, "fields": json_text(fields), "at": utc_iso()},
    )
    assert row is not None
    return Event(int(row["event_id"]), None, session_id, None, event_type, dict(row["data"]))


async def request_events_after(
    x: Executor, request_id: uuid.UUID, after_seq: int, limit: int = 500
) -> list[Event]:
    """Events of one request with ``seq > after_seq``, in order.

    One statement, on a session or a plain connection: a stream's shared reader runs it on the
    latter, once per event, while the same process is writing that event to every subscriber — each
    round trip it saves (``pool_pre_ping``'s checkout, the ORM's transaction) would wait behind such
    a round of writes."""
    rows = await fetch_all(
        x, queries.request_events_after, {"request_id": request_id, "after_seq": after_seq, "limit": limit}
    )
    return [Event(r["id"], r["request_id"], r["session_id"], r["seq"], r["type"], r["data"]) for r in rows]


async def session_events_after(
    session: AsyncSession, session_id: uuid.UUID, after_id: int, limit: int = 500
) -> list[Event]:
    """Events of every request of a session with global ``id > after_id``, in order."""
    rows = await session.scalars(
        select(EventRow)
        .where(EventRow.session_id == session_id, EventRow.id > after_id)
        .order_by(EventRow.id)
        .limit(limit)
    )
    return [_event(r) for r in rows]


async def terminal_seq(session: AsyncSession, request_id: uuid.UUID) -> int | None:
    """The seq of the request's terminal event (``done`` / ``error``), or None while it runs."""
    return await session.scalar(
        select(func.min(EventRow.seq)).where(
            EventRow.request_id == request_id, EventRow.type.in_(tuple(TERMINAL_EVENT_TYPES))
        )
    )


async def request_exists(session: AsyncSession, request_id: uuid.UUID) -> bool:
    """Whether the request row is still there (cleared rows stay until the sweep purges them)."""
    return await session.scalar(select(RequestRow.id).where(RequestRow.id == request_id)) is not None


async def session_events_with_deletion(
    session: AsyncSession, session_id: uuid.UUID, after_id: int, limit: int = 500
) -> list[tuple[Event, datetime | None, bool]]:
    """Events of a session after ``after_id``, each with its request's ``deleted_at`` and whether
    it was written before that (the cleared history's own content, which no stream serves after
    the clear; what the clear itself wrote, its ``cancelled`` events, has the clear's time).

    A session-level event (no request) comes with the ``cleared_at`` of the clear that replaced its
    history (:func:`mark_session_events_cleared`), None while its history is the current one.
    """
    # A session-level event of a history since replaced counts as deleted when that clear was.
    hidden = case(
        (
            and_(EventRow.request_id.is_(None), EventRow.id <= SessionRow.cleared_through_event),
            SessionRow.cleared_at,
        ),
        else_=RequestRow.deleted_at,
    )
    rows = await session.execute(
        select(EventRow, hidden, func.coalesce(EventRow.created_at < hidden, False))
        .outerjoin(RequestRow, RequestRow.id == EventRow.request_id)
        .join(SessionRow, SessionRow.id == EventRow.session_id)
        .where(EventRow.session_id == session_id, EventRow.id > after_id)
        .order_by(EventRow.id)
        .limit(limit)
    )
    return [(_event(row), deleted_at, bool(before)) for row, deleted_at, before in rows]


async def mark_session_events_cleared(session: AsyncSession, session_id: uuid.UUID) -> None:
    """The session-level events (``memory``, ``handoff``: no request) written so far belong to the
    history a clear or an archive restore is replacing: mark where it ends, so that a session stream
    opened afterwards does not replay them (a fresh stream would show the old history's hand-offs),
    while one that resumes still gets everything after its cursor — the rule of a
    cleared request's events. Called after the clear has cancelled the session's jobs, in its
    transaction, so their ``cancelled`` events are part of the old history too (streams open now get
    them live); a job's own event transactions serialise with the clear on the rows both lock."""
    await session.execute(queries.mark_session_events_cleared, {"sid": session_id})


async def purge_cleared_session_events(session: AsyncSession, older_than_s: float) -> int:
    """Delete the session-level events a clear or a restore replaced (:func:`mark_session_events_cleared`)
    more than ``older_than_s`` ago, as the sweep purges cleared requests with theirs. Returns how many."""
    result: Any = await session.execute(queries.purge_cleared_session_events, {"older_than_s": older_than_s})
    return int(result.rowcount or 0)


async def session_high_water(session: AsyncSession, session_id: uuid.UUID) -> int:
    """The highest event id of a session (0 when it has none).

    Ids of one session commit in order (the advisory lock above), so every event of the session with
    an id up to this one is committed: a reader starting after it misses nothing.
    """
    highest: int | None = await session.scalar(
        select(func.max(EventRow.id)).where(EventRow.session_id == session_id)
    )
    return highest or 0


async def database_now(session: AsyncSession) -> datetime:
    """PostgreSQL's clock (the one ``deleted_at`` is written with)."""
    moment: datetime | None = await session.scalar(select(func.clock_timestamp()))
    assert moment is not None
    return moment
