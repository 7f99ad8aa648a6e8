"""The event hub (SPEC §4): per process, one shared reader (:class:`Feed`) per stream with subscribers,
woken by ``sidequest_events`` notifications, feeding their inboxes from memory. How, and why a notification
is only a wake-up: docs/architecture.md, "Streams"; what a connection sends: :mod:`service.api.sse`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from sse_starlette.event import ServerSentEvent

from service.aio import wait_event
from service.api.sse_response import PING_S, SendWatchdog
from service.store import events as events_store
from service.store.db import Database
from service.store.events import Event
from service.store.listener import Listener
from service.vocabulary import EVENTS_CHANNEL

log = logging.getLogger(__name__)

# Rows per read, for the shared reader and for a subscriber's own catch-up.
PAGE = 500
READ_BACKOFF_S = (0.2, 5.0)

FeedKind = Literal["request", "session"]
REQUEST: FeedKind = "request"
SESSION: FeedKind = "session"


@dataclass(frozen=True, slots=True)
class FeedItem:
    """One event as a stream sends it: its cursor (seq or global id) and its encoded message."""

    cursor: int
    event: Event
    deleted_at: datetime | None  # the request's, as of the read (session streams' visibility rule)
    wire: bytes
    # Written before its request was cleared (or its session-level history replaced): the deleted
    # history's content, served to no stream once the clear is read.
    cleared_content: bool = False


def _wire(event: Event, event_id: int) -> bytes:
    return ServerSentEvent(
        data=json.dumps(event.data, ensure_ascii=False, separators=(",", ":")),
        event=event.type,
        id=str(event_id),
    ).encode()


def _request_item(event: Event) -> FeedItem:
    assert event.seq is not None  # a request's own events always have a seq
    return FeedItem(event.seq, event, None, _wire(event, event.seq))


async def read_items(db: Database, kind: FeedKind, key: uuid.UUID, after: int) -> list[FeedItem]:
    """One page of a stream's events after the cursor ``after``: a feed's read and a catch-up alike."""
    if kind == REQUEST:
        async with db.connection() as conn:
            events = await events_store.request_events_after(conn, key, after, PAGE)
        return [_request_item(event) for event in events]
    async with db.sessions() as tx:
        rows = await events_store.session_events_with_deletion(tx, key, after, PAGE)
    return [FeedItem(e.id, e, deleted_at, _wire(e, e.id), cleared) for e, deleted_at, cleared in rows]


@dataclass(slots=True, eq=False)
class Subscriber:
    """One open stream's inbox: batches appended by its feed, taken by its generator."""

    pending: list[FeedItem] = field(default_factory=list)
    pending_bytes: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False  # nothing more will be appended

    def push(self, items: list[FeedItem], size: int, max_items: int, max_bytes: int) -> bool:
        """Append a batch (never blocks); False when this subscriber is dropped for being behind: more
        than the limit *still* undelivered from earlier batches when a new one comes (its socket stopped
        draining). One large batch never drops a subscriber that keeps up."""
        if len(self.pending) > max_items or self.pending_bytes > max_bytes:
            self.pending = []
            self.pending_bytes = 0
            self.close()
            return False
        self.pending.extend(items)
        self.pending_bytes += size
        self.wake.set()
        return True

    def close(self) -> None:
        """No more batches: the generator sends what is pending, then ends the stream."""
        self.closed = True
        self.wake.set()

    async def next_batch(self) -> list[FeedItem]:
        """Everything pending (waiting for it); empty once closed and drained."""
        while not self.pending:
            if self.closed:
                return []
            self.wake.clear()
            await self.wake.wait()
        items = self.pending
        self.pending = []
        self.pending_bytes = 0
        return items


class Feed:
    """The shared reader of one request or session stream in this process."""

    def __init__(self, hub: EventHub, db: Database, kind: FeedKind, key: uuid.UUID) -> None:
        self.hub = hub
        self.db = db
        self.kind: FeedKind = kind
        self.key = key
        self.subscribers: set[Subscriber] = set()
        self.joining = 0
        self.buffer: deque[FeedItem] = deque()
        self.buffer_bytes = 0
        # The buffer holds every event with floor < cursor <= last; the reader reads after last.
        self.floor = 0
        self.last = 0
        self.ended = False  # nothing more will ever come (terminal event read, or request purged)
        self.closed = False  # forgotten by the hub: the reader stops
        self.wake = asyncio.Event()
        self.ready = asyncio.Event()
        if kind == REQUEST:
            # A request's history is short: read it all, so any cursor can be served from memory.
            self.ready.set()
        self.task = asyncio.create_task(self._run(), name=f"sidequest-feed-{kind}-{key}")
        self.task.add_done_callback(self._finished)

    def items_after(self, cursor: int) -> list[FeedItem]:
        """Buffered events after ``cursor`` (the caller checked ``cursor >= floor``)."""
        if not self.buffer or self.buffer[-1].cursor <= cursor:
            return []
        return [item for item in self.buffer if item.cursor > cursor]

    async def _run(self) -> None:
        backoff = READ_BACKOFF_S[0]
        while not self.closed:
            self.wake.clear()  # before reading: a notification racing the read re-triggers the loop
            items: list[FeedItem] = []
            try:
                if not self.ready.is_set():
                    # Session feeds start at the session's newest event: every event up to it is
                    # committed, joiners with older cursors catch up themselves.
                    async with self.db.sessions() as tx:
                        self.floor = self.last = await events_store.session_high_water(tx, self.key)
                    self.ready.set()
                else:
                    items = await read_items(self.db, self.kind, self.key, self.last)
            except Exception as exc:  # the database went away: keep subscribers, retry
                log.warning("event feed read failed (%s); retrying", type(exc).__name__)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, READ_BACKOFF_S[1])
                continue
            backoff = READ_BACKOFF_S[0]
            if items:
                self._publish(items)
                if self.ended:
                    return
                if len(items) >= PAGE:
                    continue
            if await wait_event(self.wake, self.hub.poll_s) or self.closed or self.kind != REQUEST:
                continue
            if not await self._request_exists():
                self._end()  # purged by the sweep: nothing more will ever come
                return

    async def _request_exists(self) -> bool:
        try:
            async with self.db.sessions() as tx:
                return await events_store.request_exists(tx, self.key)
        except Exception:  # unknown: keep the stream open
            return True

    def _publish(self, items: list[FeedItem]) -> None:
        if self.kind == REQUEST:
            for index, item in enumerate(items):
                if item.event.is_terminal:  # a request stream ends after its terminal event
                    items = items[: index + 1]
                    self.ended = True
                    break
        size = sum(len(item.wire) for item in items)
        self.buffer.extend(items)
        self.buffer_bytes += size
        while self.buffer and (
            len(self.buffer) > self.hub.buffer_items or self.buffer_bytes > self.hub.buffer_bytes
        ):
            old = self.buffer.popleft()
            self.buffer_bytes -= len(old.wire)
            self.floor = old.cursor
        self.last = items[-1].cursor
        for subscriber in list(self.subscribers):
            if not subscriber.push(items, size, self.hub.lag_items, self.hub.lag_bytes):
                self.subscribers.discard(subscriber)
                self.hub.dropped += 1
        if self.ended:
            self._end()

    def _end(self) -> None:
        self.ended = True
        self.ready.set()  # a joiner still waiting for the start sees the end instead of hanging
        for subscriber in self.subscribers:
            subscriber.close()

    def _finished(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # A bug, not a database error (those are retried): end the streams, clients reconnect.
            log.error("event feed failed", exc_info=task.exception())
            self._end()
            self.hub.forget(self)


class EventHub:
    """The feeds of this process, woken by ``sidequest_events`` notifications, and what its streams'
    responses share: the ping interval and the send watchdog."""

    def __init__(self) -> None:
        # The limits, per hub so that a test can change them for its own app.
        self.ping_s = PING_S
        self.send_watchdog = SendWatchdog()
        # Re-read even without a notification this often: a cheap fallback, never the main path.
        self.poll_s = 5.0
        # The recent events a feed keeps in memory for subscribers that join or reconnect.
        self.buffer_items = 1024
        self.buffer_bytes = 1 << 20
        # How far a subscriber may fall behind (its socket not draining) before it is dropped.
        self.lag_items = 2048
        self.lag_bytes = 8 << 20
        self._feeds: dict[tuple[FeedKind, str], Feed] = {}
        self._unsubscribe: list[Callable[[], None]] = []
        self.streams = 0  # open streams (a dropped one counts until its connection ends)
        # Counters (tests): how subscribers joined, and how many were dropped.
        self.joined_from_memory = 0
        self.joined_with_catch_up = 0
        self.dropped = 0

    def attach(self, listener: Listener) -> None:
        self._unsubscribe.append(listener.subscribe(EVENTS_CHANNEL, self.notify))

    def detach(self) -> None:
        """Stop receiving notifications and stop every reader (app shutdown)."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()
        for feed in list(self._feeds.values()):
            self.forget(feed)
            feed._end()
            feed.task.cancel()

    def notify(self, _channel: str, payload: str) -> None:
        """Wake the feeds of the notified request and session; every feed on a payload naming none (the
        listener's reconnect sends an empty one). Runs on the listener's connection callback: only sets
        flags, never awaits."""
        try:
            data = json.loads(payload)
            keys = [(SESSION, str(data["session_id"]))]
            if data["request_id"] is not None:  # null for a session-level event
                keys.append((REQUEST, str(data["request_id"])))
        except (ValueError, KeyError, TypeError):
            keys = list(self._feeds)
        for key in keys:
            feed = self._feeds.get(key)
            if feed is not None:
                feed.wake.set()

    @contextlib.asynccontextmanager
    async def join(
        self, db: Database, kind: FeedKind, key: uuid.UUID, cursor: int, *, from_memory: bool
    ) -> AsyncIterator[tuple[Subscriber, bool]]:
        """Subscribe to the feed of ``key`` after ``cursor``: (the inbox, whether to catch up first). The
        inbox starts from the feed's buffer only ``from_memory`` and with the cursor within it; else the
        caller first reads the rows after its cursor itself."""
        feed = self._feeds.get((kind, str(key)))
        if feed is None:
            feed = Feed(self, db, kind, key)  # its reader starts at once
            self._feeds[(kind, str(key))] = feed
        subscriber = Subscriber()
        self.streams += 1
        feed.joining += 1
        try:
            try:
                await feed.ready.wait()
            finally:
                feed.joining -= 1
            # From here to the yield nothing awaits: the handover is one step of the event loop.
            memory = from_memory and cursor >= feed.floor
            if memory:
                subscriber.pending = feed.items_after(cursor)
                subscriber.pending_bytes = sum(len(item.wire) for item in subscriber.pending)
                self.joined_from_memory += 1
            else:
                self.joined_with_catch_up += 1
            if feed.ended:
                subscriber.closed = True
            else:
                feed.subscribers.add(subscriber)
            yield subscriber, not memory
        finally:
            self.streams -= 1
            feed.subscribers.discard(subscriber)
            if not feed.subscribers and not feed.joining:
                self.forget(feed)

    def forget(self, feed: Feed) -> None:
        """Remove a feed (no subscribers left); its reader stops at its next wake-up."""
        if self._feeds.get((feed.kind, str(feed.key))) is feed:
            del self._feeds[(feed.kind, str(feed.key))]
        feed.closed = True
        feed.wake.set()
