"""The event log: append (with NOTIFY) and read-after, for request and session streams. Resumption
is gap-free (docs/architecture.md, "Ordering guarantees of the event log"; sql/events.sql).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from service.store import queries
from service.store.execute import Executor, Row, execute, fetch_all, fetch_one, fetch_value, json_text
from service.vocabulary import utc_iso


@dataclass(frozen=True)
class Event:
    """One stored event as streams send it; ``request_id`` and ``seq`` are None for a session-level
    event (``memory``, ``handoff``), which only session streams carry."""

    id: int
    request_id: uuid.UUID | None
    session_id: uuid.UUID
    seq: int | None
    type: str
    data: dict[str, Any]

    @property
    def is_terminal(self) -> bool:
        return self.type in ("done", "error")


async def append_event(tx: Executor, request_id: uuid.UUID, event_type: str, fields: dict[str, Any]) -> Event:
    """Append one event with its NOTIFY, one round trip (``sidequest_append_event``); ``data`` is
    ``fields`` with the envelope (``request_id``, ``ordinal``, ``seq``, ``at``)."""
    at = utc_iso()
    params = {"request_id": request_id, "type": event_type, "fields": json_text(fields), "at": at}
    row = await fetch_one(tx, queries.append_event, params)
    assert row is not None
    data = {"request_id": str(request_id), "ordinal": row["ordinal"], "seq": row["seq"], "at": at, **fields}
    return Event(row["event_id"], request_id, row["session_id"], row["seq"], event_type, data)


async def append_session_event(
    tx: Executor, session_id: uuid.UUID, event_type: str, fields: dict[str, Any]
) -> Event:
    """Append one session-level event, its envelope's ``request_id``, ``ordinal`` and ``seq`` null."""
    row = await fetch_one(
        tx,
        queries.append_session_event,
        {"sid": session_id, "type": event_type, "fields": json_text(fields), "at": utc_iso()},
    )
    assert row is not None
    return Event(int(row["event_id"]), None, session_id, None, event_type, dict(row["data"]))


def _events(rows: list[Row]) -> list[Event]:
    return [Event(r["id"], r["request_id"], r["session_id"], r["seq"], r["type"], r["data"]) for r in rows]


async def request_events_after(
    x: Executor, request_id: uuid.UUID, after_seq: int, limit: int = 500
) -> list[Event]:
    """Events of one request with ``seq > after_seq``, in order (a stream's shared reader runs it on a
    plain connection, once per event: each round trip saved counts)."""
    params = {"request_id": request_id, "after_seq": after_seq, "limit": limit}
    return _events(await fetch_all(x, queries.request_events_after, params))


async def terminal_seq(tx: Executor, request_id: uuid.UUID) -> int | None:
    """The seq of the request's terminal event (``done`` / ``error``), or None while it runs."""
    seq: int | None = await fetch_value(tx, queries.terminal_seq, {"request_id": request_id})
    return seq


async def request_exists(tx: Executor, request_id: uuid.UUID) -> bool:
    """Whether the request row is still there (cleared rows stay until the sweep purges them)."""
    return bool(await fetch_value(tx, queries.request_exists, {"request_id": request_id}))


async def session_events_with_deletion(
    tx: Executor, session_id: uuid.UUID, after_id: int, limit: int = 500
) -> list[tuple[Event, datetime | None, bool]]:
    """Events of a session after ``after_id``, each with when it was hidden (its request's ``deleted_at``, or
    a session-level event's ``cleared_at`` of the clear replacing its history; None while visible) and whether
    it was written before: the cleared history's own content, which no stream serves after the clear."""
    params = {"session_id": session_id, "after_id": after_id, "limit": limit}
    rows = await fetch_all(tx, queries.session_events_with_deletion, params)
    return [
        (event, r["hidden"], bool(r["written_before"])) for event, r in zip(_events(rows), rows, strict=True)
    ]


async def mark_session_events_cleared(tx: Executor, session_id: uuid.UUID) -> None:
    """Mark the session-level events written so far as the history a clear or a restore replaces
    (sql/events.sql): a session stream opened afterwards does not replay them. A clear calls it after
    cancelling the session's jobs, so their ``cancelled`` events belong to the old history too."""
    await execute(tx, queries.mark_session_events_cleared, {"sid": session_id})


async def session_high_water(tx: Executor, session_id: uuid.UUID) -> int:
    """The highest event id of a session (0 when it has none). Ids of one session commit in order,
    so every event of the session up to it is committed: a reader starting after it misses nothing."""
    return int(await fetch_value(tx, queries.session_high_water, {"session_id": session_id}))


async def database_now(tx: Executor) -> datetime:
    """PostgreSQL's clock (the one ``deleted_at`` is written with)."""
    moment: datetime = await fetch_value(tx, queries.database_now, {})
    return moment
