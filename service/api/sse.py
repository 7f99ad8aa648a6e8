"""Event streams (SPEC §4): what one connection to a request or a session stream sends. Each keeps its
own ``delivered`` cursor, so ids on one connection strictly increase (docs/architecture.md, "Streams").
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from datetime import datetime

from sse_starlette.event import ServerSentEvent

from service.api.event_hub import PAGE, REQUEST, SESSION, EventHub, FeedItem, read_items
from service.store.db import Database

log = logging.getLogger(__name__)

# The first message of every stream: how long (ms) a browser waits before reconnecting.
RETRY_HINT = ServerSentEvent(comment="sidequest stream", retry=3000)


def visible_on_session_stream(
    item: FeedItem, *, resumed: bool, opened_at: datetime, seen: set[uuid.UUID | None]
) -> bool:
    """Whether a session stream sends ``item`` (docs/api.md, "Session streams and clears"): never what
    a cleared history wrote before the clear, once the clear is read; what the clear wrote (the
    ``cancelled`` events) only to a stream open when it happened (``opened_at``, the database's clock),
    resumed from before it (``resumed``), or that already sent that request's events (``seen``)."""
    if item.deleted_at is None:
        return True
    if item.cleared_content:
        return False
    request_id = item.event.request_id
    return resumed or item.deleted_at > opened_at or (request_id is not None and request_id in seen)


async def request_stream(
    db: Database, hub: EventHub, request_id: uuid.UUID, after: int
) -> AsyncIterator[ServerSentEvent | bytes]:
    """Events of one request with ``seq > after``, each once and in order; ends after the terminal event."""
    yield RETRY_HINT
    async with hub.join(db, REQUEST, request_id, after, from_memory=True) as (subscriber, catch_up):
        delivered = after
        while True:
            live = not catch_up
            if catch_up:
                items = await read_items(db, REQUEST, request_id, delivered)
                catch_up = len(items) >= PAGE
            else:
                items = await subscriber.next_batch()
                if not items:
                    return  # dropped (the client resumes with Last-Event-ID) or the request is gone
            chunks: list[bytes] = []
            finished = False
            for item in items:
                if item.cursor <= delivered:
                    continue  # already sent (the catch-up overlapped the live feed)
                if live and item.cursor != delivered + 1:
                    log.warning("request stream gap after seq %d; re-reading", delivered)
                    catch_up = True
                    break
                chunks.append(item.wire)
                delivered = item.cursor
                if item.event.is_terminal:
                    finished = True
                    break
            if chunks:
                # One write for everything pending: a subscriber that fell behind catches up at once.
                yield b"".join(chunks)
            if finished:
                # Every subscriber of the feed was woken for this terminal event at once: let them
                # all send it before any of them tears its connection down (that costs far more).
                await asyncio.sleep(0)
                return


async def session_stream(
    db: Database,
    hub: EventHub,
    session_id: uuid.UUID,
    after: int,
    *,
    resumed: bool,
    opened_at: datetime,
    ever_cleared: bool,
) -> AsyncIterator[ServerSentEvent | bytes]:
    """Events of every request of a session with global ``id > after``; never ends by itself. A fresh
    stream reads its history itself (``deleted_at`` as of now); a resumed one may start from memory,
    unless the session was ever cleared (or restored: ``ever_cleared``): a live feed's buffer has the
    flags of when it was read, perhaps before the clear (:func:`visible_on_session_stream`)."""
    yield RETRY_HINT
    seen: set[uuid.UUID | None] = set()
    memory = resumed and not ever_cleared
    async with hub.join(db, SESSION, session_id, after, from_memory=memory) as (subscriber, catch_up):
        delivered = after
        while True:
            if catch_up:
                items = await read_items(db, SESSION, session_id, delivered)
                catch_up = len(items) >= PAGE
            else:
                items = await subscriber.next_batch()
                if not items:
                    return  # dropped: the client resumes with Last-Event-ID
            chunks: list[bytes] = []
            for item in items:
                if item.cursor <= delivered:
                    continue
                delivered = item.cursor
                if visible_on_session_stream(item, resumed=resumed, opened_at=opened_at, seen=seen):
                    seen.add(item.event.request_id)
                    chunks.append(item.wire)
            if chunks:
                yield b"".join(chunks)
