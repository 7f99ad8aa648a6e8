"""The session stream's visibility rule after a clear (SPEC §3), as the pure function it is."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from service.api.event_hub import FeedItem
from service.api.sse import visible_on_session_stream
from service.store.events import Event

OPENED = datetime(2026, 1, 1, tzinfo=UTC)
REQUEST = uuid.uuid4()


def item(deleted_at: datetime | None, cleared_content: bool = False) -> FeedItem:
    event = Event(1, REQUEST, uuid.uuid4(), 1, "error", {})
    return FeedItem(1, event, deleted_at, b"", cleared_content)


def visible(feed_item: FeedItem, *, resumed: bool = False, seen: frozenset[uuid.UUID] = frozenset()) -> bool:
    return visible_on_session_stream(feed_item, resumed=resumed, opened_at=OPENED, seen=set(seen))


def test_what_a_cleared_history_wrote_reaches_no_stream() -> None:
    before = item(OPENED - timedelta(seconds=1), cleared_content=True)
    assert not visible(before)
    assert not visible(before, resumed=True, seen=frozenset({REQUEST}))


def test_what_the_clear_wrote_reaches_open_and_resumed_streams_only() -> None:
    cleared_earlier = item(OPENED - timedelta(seconds=1))
    assert not visible(cleared_earlier)  # a fresh stream opened after the clear
    assert visible(cleared_earlier, resumed=True)
    assert visible(cleared_earlier, seen=frozenset({REQUEST}))  # it sent the request's earlier events
    assert visible(item(OPENED + timedelta(seconds=1)))  # cleared while the stream was open


def test_events_of_requests_never_cleared_are_always_sent() -> None:
    assert visible(item(None))
