"""Event streams (SPEC §4): replay from the events table, then tail live.

One :class:`~service.store.listener.Listener` per process delivers ``sidequest_events``
notifications to the :class:`EventHub`, which only *sets* each interested subscriber's own
``asyncio.Event``. A subscriber then reads the rows after its cursor itself. So a notification is a
wake-up, never data: nothing is lost when a notification is (a reconnect wakes everyone), a slow
client only delays its own generator, and events written by any process on any machine arrive.

Ordering: ``seq`` is gap-free per request and global ids of one session commit in order
(service/store/events.py), so "rows after my cursor" never skips an event that commits later.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime
from typing import TypeVar

from sse_starlette.event import ServerSentEvent

from service.store import events as events_store
from service.store.db import Database, is_unavailable
from service.store.events import NOTIFY_CHANNEL, Event, request_events_after
from service.store.listener import Listener

RETRY_MS = 3000
PING_S = 15.0
# Re-read even without a notification this often: a cheap fallback, never the main path.
FALLBACK_POLL_S = 5.0
SEND_TIMEOUT_S = 30.0
# While PostgreSQL is unreachable an open stream waits and re-reads (SPEC §9): it keeps its cursor,
# so when the database is back it continues with no gap and no duplicate, and a browser's
# EventSource (which gives up on a non-200 reconnect) never sees the outage.
OUTAGE_RETRY_S = (0.2, 2.0)

T = TypeVar("T")


async def _read_through_outage(read: Callable[[], Awaitable[T]]) -> T:
    """``await read()``, retried with backoff while the database is unreachable; other errors raise."""
    delay, ceiling = OUTAGE_RETRY_S
    while True:
        try:
            return await read()
        except Exception as exc:
            if not is_unavailable(exc):
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, ceiling)


class EventHub:
    """Fans ``sidequest_events`` notifications out to per-subscriber wake-up events."""

    def __init__(self) -> None:
        self._requests: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._sessions: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._unsubscribe: list[Callable[[], None]] = []

    def attach(self, listener: Listener) -> None:
        """Receive the listener's event notifications."""
        self._unsubscribe.append(listener.subscribe(NOTIFY_CHANNEL, self.notify))

    def detach(self) -> None:
        """Stop receiving notifications (app shutdown)."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()

    def notify(self, _channel: str, payload: str) -> None:
        """Wake the subscribers of the notified request and session (everyone on an empty payload).

        Runs on the listener's connection callback: only sets flags, never awaits.
        """
        if not payload:
            self._wake_all()
            return
        try:
            data = json.loads(payload)
            request_id, session_id = str(data["request_id"]), str(data["session_id"])
        except (ValueError, KeyError, TypeError):
            self._wake_all()
            return
        for wake in self._requests.get(request_id, ()):
            wake.set()
        for wake in self._sessions.get(session_id, ()):
            wake.set()

    def _wake_all(self) -> None:
        for group in (self._requests, self._sessions):
            for wakes in group.values():
                for wake in wakes:
                    wake.set()

    @contextlib.contextmanager
    def subscribe(
        self, *, request_id: str | None = None, session_id: str | None = None
    ) -> Iterator[asyncio.Event]:
        """A wake-up event for one request or one session, removed on exit."""
        group, key = (self._requests, request_id) if request_id is not None else (self._sessions, session_id)
        assert key is not None
        wake = asyncio.Event()
        group[key].add(wake)
        try:
            yield wake
        finally:
            group[key].discard(wake)
            if not group[key]:
                del group[key]

    def subscriber_count(self) -> int:
        """Open streams in this process."""
        return sum(len(w) for w in self._requests.values()) + sum(len(w) for w in self._sessions.values())


def _message(event: Event, event_id: int) -> ServerSentEvent:
    return ServerSentEvent(
        data=json.dumps(event.data, ensure_ascii=False, separators=(",", ":")),
        event=event.type,
        id=str(event_id),
    )


def retry_hint() -> ServerSentEvent:
    """The first message of every stream: how long a browser waits before reconnecting."""
    return ServerSentEvent(comment="sidequest stream", retry=RETRY_MS)


async def _wait(wake: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wake.wait(), seconds)


async def terminal_seq(db: Database, request_id: uuid.UUID) -> int | None:
    """The seq of the request's terminal event (``done`` / ``error``), or None while it runs."""
    async with db.sessions() as session:
        return await events_store.terminal_seq(session, request_id)


async def _request_exists(db: Database, request_id: uuid.UUID) -> bool:
    async with db.sessions() as session:
        return await events_store.request_exists(session, request_id)


async def _request_events(db: Database, request_id: uuid.UUID, after: int) -> list[Event]:
    async with db.sessions() as session:
        return await request_events_after(session, request_id, after)


async def request_stream(
    db: Database, hub: EventHub, request_id: uuid.UUID, after: int, *, poll_s: float = FALLBACK_POLL_S
) -> AsyncIterator[ServerSentEvent]:
    """Events of one request with ``seq > after``; ends after the terminal event."""
    yield retry_hint()
    with hub.subscribe(request_id=str(request_id)) as wake:
        while True:
            wake.clear()  # before reading: a notification racing the read re-triggers the loop
            events = await _read_through_outage(functools.partial(_request_events, db, request_id, after))
            for event in events:
                assert event.seq is not None  # a request's own events always have a seq
                yield _message(event, event.seq)
                after = event.seq
                if event.is_terminal:
                    return
            if events:
                continue
            await _wait(wake, poll_s)
            if not wake.is_set() and not await _read_through_outage(
                functools.partial(_request_exists, db, request_id)
            ):
                return  # purged by the sweep: nothing more will ever come


async def _session_events(
    db: Database, session_id: uuid.UUID, after_id: int, limit: int = 500
) -> list[tuple[Event, datetime | None]]:
    """Events of a session after ``after_id`` with their request's ``deleted_at``."""
    async with db.sessions() as session:
        return await events_store.session_events_with_deletion(session, session_id, after_id, limit)


async def database_now(db: Database) -> datetime:
    """PostgreSQL's clock (the one ``deleted_at`` is written with)."""
    async with db.sessions() as session:
        return await events_store.database_now(session)


async def session_stream(
    db: Database,
    hub: EventHub,
    session_id: uuid.UUID,
    after: int,
    *,
    resumed: bool,
    opened_at: datetime,
    poll_s: float = FALLBACK_POLL_S,
) -> AsyncIterator[ServerSentEvent]:
    """Events of every request of a session with global ``id > after``; never ends by itself.

    A fresh stream does not replay requests that were cleared before it opened (they are gone for
    everyone), but it does deliver the final ``cancelled`` events of a clear that happens while it
    is open, and a resumed stream delivers everything after its cursor.
    """
    yield retry_hint()
    seen: set[uuid.UUID | None] = set()
    with hub.subscribe(session_id=str(session_id)) as wake:
        while True:
            wake.clear()
            events = await _read_through_outage(functools.partial(_session_events, db, session_id, after))
            for event, deleted_at in events:
                after = event.id
                visible = resumed or deleted_at is None or deleted_at > opened_at or event.request_id in seen
                if visible:
                    seen.add(event.request_id)
                    yield _message(event, event.id)
            if events:
                continue
            await _wait(wake, poll_s)
