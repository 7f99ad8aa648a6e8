"""Shared SSE fan-out against a real uvicorn: exactly once per connection under joins racing writes,
session-level events, slow subscribers dropped and resuming, and DB reads independent of subscribers.

Every stream here is followed by :func:`follow`, which records the ids of each connection separately;
the assertions compare their concatenation with the ids in the database, so a duplicate, a gap or a
reordering on any connection fails the test.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sse_starlette.sse import SendTimeoutError

import service.api.sse as sse_module
import service.store.events as events_store
from service.api.event_hub import EventHub
from service.api.sse_response import StreamResponse
from service.client.sse import SseMessage as Message
from service.store.db import Database
from service.store.events import append_session_event
from service.store.models import EventRow, SessionRow
from service.vocabulary import EVENTS_CHANNEL
from tests.api.conftest import Server, StartServer
from tests.api.helpers import append, ask, finish, mark_running
from tests.api.sse_client import events

Stop = Callable[[Message], bool]


@dataclass
class Followed:
    """What one subscriber saw: the ids of each of its connections, in arrival order."""

    start: int
    connections: list[list[int]] = field(default_factory=list)
    ended_by_server: list[bool] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return [i for connection in self.connections for i in connection]


def _client(server: Server) -> httpx.AsyncClient:
    # Hundreds of streams at once: no connection cap, long reads (streams sit idle between events).
    return httpx.AsyncClient(
        base_url=server.url,
        timeout=60,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
    )


async def follow(
    client: httpx.AsyncClient,
    url: str,
    *,
    cursor: int | None,
    via: str = "last-event-id",
    drop_after: int | None = None,
    stop: Stop | None = None,
    progress: Callable[[int], None] | None = None,
    max_connections: int = 10,
) -> Followed:
    """Follow a stream from ``cursor`` (None: fresh) until ``stop`` says so (default: the request's
    terminal event).

    ``drop_after``: the client hangs up after that many events once, then resumes with
    ``Last-Event-ID``. A stream the server ends early (a dropped subscriber) is resumed the same way.
    """
    seen = Followed(start=cursor or 0)
    last = cursor
    for _ in range(max_connections):
        headers: dict[str, str] = {}
        target = url
        if last is not None:
            if via == "after" and not seen.connections:
                target = f"{url}?after={last}"
            else:
                headers["Last-Event-ID"] = str(last)
        got: list[int] = []
        finished = hung_up = False
        async with client.stream("GET", target, headers=headers) as response:
            if response.status_code == 204:
                seen.connections.append(got)
                seen.ended_by_server.append(True)
                return seen
            assert response.status_code == 200, await response.aread()
            async for message in events(response):
                assert message.id is not None
                got.append(int(message.id))
                if progress is not None:
                    progress(int(message.id))
                if stop(message) if stop is not None else message.event in ("done", "error"):
                    finished = True
                    break
                if drop_after is not None and len(got) == drop_after:
                    drop_after = None
                    hung_up = True
                    break
        seen.connections.append(got)
        seen.ended_by_server.append(not finished and not hung_up)
        if got:
            last = got[-1]
        if finished:
            return seen
    raise AssertionError(f"gave up after {max_connections} connections: {seen.connections}")


async def _session_id(db: Database, parent_id: str) -> uuid.UUID:
    async with db.sessions() as tx:
        sid = await tx.scalar(select(SessionRow.id).where(SessionRow.parent_id == parent_id))
    assert sid is not None
    return sid


async def _session_ids(db: Database, session_id: uuid.UUID) -> list[int]:
    async with db.sessions() as tx:
        rows = await tx.scalars(
            select(EventRow.id).where(EventRow.session_id == session_id).order_by(EventRow.id)
        )
        return list(rows)


async def _append_session_event(
    db: Database, session_id: uuid.UUID, kind: str, fields: dict[str, Any]
) -> int:
    async with db.sessions() as tx:
        event = await append_session_event(tx, session_id, kind, fields)
        await tx.commit()
    return event.id


def _check_exactly_once(followed: Followed, expected: list[int]) -> None:
    for connection in followed.connections:
        assert connection == sorted(set(connection)), (
            f"duplicate or out of order on one connection: {connection}"
        )
    assert followed.ids == expected, (followed.start, followed.connections)


async def test_subscribers_joining_mid_burst_get_every_seq_once_in_order(
    start_server: StartServer, db: Database
) -> None:
    server = await start_server()
    hub: EventHub = server.app.state.hub
    # A small buffer, so that joiners with older cursors take the catch-up path and newer ones start
    # from memory: both handovers race the writer.
    hub.buffer_items = 24
    rng = random.Random(20261201)
    n_events, n_subscribers = 200, 200
    async with _client(server) as client:
        rid = (await ask(client, "p-burst"))["id"]
        await mark_running(db, rid, "answering")
        written = 2  # seq of the newest committed event: queued, running
        writing = True
        progress = Changes()

        async def writer() -> None:
            nonlocal written, writing
            for i in range(n_events):
                await append(db, rid, "delta", {"text": f"t{i} "})
                written += 1
                progress.touch()
                if rng.random() < 0.2:
                    await asyncio.sleep(0.003)  # bursts and pauses
            await finish(db, rid)
            writing = False
            progress.touch()

        async def subscriber() -> Followed:
            # Join at a random point of the burst (measured in events written, not in time: the
            # writer's pace depends on the machine).
            target = rng.randint(0, n_events)
            await progress.until(lambda: not writing or written >= target, limit_s=120)
            mode = rng.choice(["fresh", "last-event-id", "after"])
            cursor = None if mode == "fresh" else rng.randint(0, written)
            drop_after = rng.choice([None, None, rng.randint(1, 40)])
            return await follow(
                client, f"/v1/questions/{rid}/events", cursor=cursor, via=mode, drop_after=drop_after
            )

        writer_task = asyncio.create_task(writer())
        followed = await asyncio.wait_for(asyncio.gather(*(subscriber() for _ in range(n_subscribers))), 180)
        await writer_task
    terminal = n_events + 4  # queued, running, deltas, succeeded, done
    for one in followed:
        _check_exactly_once(one, list(range(one.start + 1, terminal + 1)))
    assert not writing
    assert hub.joined_from_memory > 0 and hub.joined_with_catch_up > 0, (
        hub.joined_from_memory,
        hub.joined_with_catch_up,
    )
    assert sum(len(one.connections) > 1 for one in followed) > 0  # some resumed mid-burst


async def test_session_stream_fanout_with_session_level_events(
    start_server: StartServer, db: Database
) -> None:
    server = await start_server()
    server.app.state.hub.buffer_items = 24
    rng = random.Random(7)
    parent = "p-session-burst"
    async with _client(server) as client:
        rids = [(await ask(client, parent))["id"] for _ in range(3)]
        sid = await _session_id(db, parent)
        for rid in rids:
            await mark_running(db, rid, "answering")
        written: list[int] = await _session_ids(db, sid)

        async def request_writer(rid: str) -> None:
            for i in range(80):
                written.append((await append(db, rid, "delta", {"text": f"{rid[:4]}{i}"})).id)
                if rng.random() < 0.2:
                    await asyncio.sleep(0.003)
            await finish(db, rid)

        async def session_writer() -> None:
            for i in range(40):
                kind = "memory" if i % 2 else "handoff"
                written.append(await _append_session_event(db, sid, kind, {"n": i}))
                await asyncio.sleep(rng.uniform(0, 0.01))

        def is_final(message: Message) -> bool:
            return message.event == "handoff" and message.json().get("final") is True

        async def subscriber() -> Followed:
            await asyncio.sleep(rng.uniform(0, 1.0))
            cursor = rng.choice([None, rng.choice(written)])
            drop_after = rng.choice([None, rng.randint(1, 30)])
            return await follow(
                client, f"/v1/sessions/{parent}/events", cursor=cursor, drop_after=drop_after, stop=is_final
            )

        async def writers() -> None:
            await asyncio.gather(*(request_writer(rid) for rid in rids), session_writer())
            await _append_session_event(db, sid, "handoff", {"final": True})

        writing = asyncio.create_task(writers())
        followed = await asyncio.wait_for(asyncio.gather(*(subscriber() for _ in range(120))), 180)
        await writing
        all_ids = await _session_ids(db, sid)
    for one in followed:
        _check_exactly_once(one, [i for i in all_ids if i > one.start])
    # Session-level events (no request, no seq) were delivered to everyone who joined before them.
    async with db.sessions() as tx:
        session_level = set(
            await tx.scalars(select(EventRow.id).where(EventRow.session_id == sid, EventRow.seq.is_(None)))
        )
    assert len(session_level) == 41
    assert all(session_level & set(one.ids) for one in followed)


async def test_slow_subscriber_is_dropped_and_resumes_without_gap(
    start_server: StartServer, db: Database
) -> None:
    server = await start_server()
    hub: EventHub = server.app.state.hub
    hub.lag_items = 32  # a subscriber more than 32 events behind is dropped
    chunk = "x" * 65536
    n_events = 250  # ~16 MB: beyond what loopback socket buffers hold for a client that does not read
    async with _client(server) as slow_client, _client(server) as fast_client:
        rid = (await ask(slow_client, "p-slow-drop"))["id"]
        await mark_running(db, rid, "answering")
        slow_ids: list[int] = []
        async with slow_client.stream("GET", f"/v1/questions/{rid}/events") as slow:
            assert slow.status_code == 200  # opened, then not read while the burst is written
            # The fast one may be dropped too when this machine stalls it; it then resumes like any client.
            fast_task = asyncio.create_task(
                follow(fast_client, f"/v1/questions/{rid}/events", cursor=None, max_connections=100)
            )
            for _ in range(n_events):
                await append(db, rid, "delta", {"text": chunk})
            await finish(db, rid)
            fast = await asyncio.wait_for(fast_task, 60)  # never held up by the slow one
            assert hub.dropped >= 1
            # Now the slow client reads: what was sent before the drop, then the server ends the stream.
            async with asyncio.timeout(60):
                async for message in events(slow):
                    slow_ids.append(int(message.id or 0))
        assert slow_ids and slow_ids[-1] < n_events + 4, "the slow subscriber was not dropped"
        rest = await follow(slow_client, f"/v1/questions/{rid}/events", cursor=slow_ids[-1])
    terminal = n_events + 4
    _check_exactly_once(fast, list(range(1, terminal + 1)))
    assert slow_ids + rest.ids == list(range(1, terminal + 1))


Counter = dict[str, int]


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count every read of the event log (the store functions the streams use)."""
    counts: Counter = {"request": 0, "session": 0}

    def counting(name: str, kind: str) -> None:
        original = getattr(events_store, name)

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[kind] += 1
            return await original(*args, **kwargs)

        monkeypatch.setattr(events_store, name, wrapper)
        # Also wherever the streams module imported it by name.
        for attribute, value in list(vars(sse_module).items()):
            if value is original:
                monkeypatch.setattr(sse_module, attribute, wrapper)

    counting("request_events_after", "request")
    counting("session_events_with_deletion", "session")
    return counts


class Changes:
    """Set from synchronous callbacks (a subscriber's progress); wait for a condition on them."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def touch(self) -> None:
        self._event.set()

    async def until(self, condition: Callable[[], bool], limit_s: float = 60) -> None:
        async with asyncio.timeout(limit_s):
            while not condition():
                self._event.clear()
                await self._event.wait()


async def _poll_until(condition: Callable[[], bool], limit_s: float = 60) -> None:
    """For server-side state that has no event to wait on."""
    async with asyncio.timeout(limit_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def _fan_out_reads(
    server: Server,
    url: str,
    n_subscribers: int,
    cursor: int,
    write: Callable[[], Awaitable[int]],
    n_writes: int,
    counts: Counter,
    kind: str,
) -> tuple[int, int]:
    """Open ``n_subscribers`` streams, then write ``n_writes`` events one by one, each delivered to
    every subscriber before the next is written (one notification batch per event: the worst case
    for shared reads). Returns (reads while joining, reads while writing)."""
    latest = [cursor] * n_subscribers
    changes = Changes()
    async with _client(server) as client:
        tasks = []
        for index in range(n_subscribers):

            def progress(seen: int, index: int = index) -> None:
                latest[index] = seen
                changes.touch()

            tasks.append(
                asyncio.create_task(
                    follow(client, url, cursor=cursor, progress=progress, stop=lambda m: False)
                )
            )
        before_join = counts[kind]
        await _poll_until(lambda: server.app.state.hub.streams >= n_subscribers)
        await asyncio.sleep(0.3)  # let the joins' replays settle
        joined = counts[kind] - before_join
        before = counts[kind]
        for _ in range(n_writes):
            newest = await write()
            await changes.until(lambda newest=newest: min(latest) >= newest)  # type: ignore[misc]
        writing = counts[kind] - before
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return joined, writing


async def test_database_reads_do_not_grow_with_subscribers(
    start_server: StartServer, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await start_server()
    counts = _count_reads(monkeypatch)
    n_writes = 20
    async with server.client() as client:
        rid = (await ask(client, "p-reads"))["id"]
        await mark_running(db, rid, "answering")

    async def write_delta() -> int:
        event = await append(db, rid, "delta", {"text": "."})
        assert event.seq is not None
        return event.seq

    results = {}
    for n in (1, 200):
        results[n] = await _fan_out_reads(
            server, f"/v1/questions/{rid}/events", n, 2, write_delta, n_writes, counts, "request"
        )
    # Read per subscriber, one read per notification would be 200 × 20 = 4000 reads. Shared: one
    # read per batch, plus at most a couple for the feed's start and a fallback poll.
    for n, (joined, writing) in results.items():
        assert writing <= n_writes + 2, (n, results)
        assert joined <= 2, (n, results)  # joiners are served from the feed's memory, not the database
    assert abs(results[200][1] - results[1][1]) <= 2, results

    # The session stream: resumed subscribers, session-level events.
    sid = await _session_id(db, "p-reads")
    newest = (await _session_ids(db, sid))[-1]

    async def write_memory_event() -> int:
        return await _append_session_event(db, sid, "memory", {"n": 1})

    joined, writing = await _fan_out_reads(
        server, "/v1/sessions/p-reads/events", 200, newest, write_memory_event, n_writes, counts, "session"
    )
    assert writing <= n_writes + 2 and joined <= 2, (joined, writing)


async def test_lost_notifications_are_recovered_by_wake_all_and_fallback_poll(
    start_server: StartServer, db: Database
) -> None:
    server = await start_server()
    hub: EventHub = server.app.state.hub
    listener = server.app.state.listener
    async with _client(server) as client:
        rid = (await ask(client, "p-lost"))["id"]
        await mark_running(db, rid, "answering")
        latest = [0]
        changes = Changes()

        def progress(seen: int) -> None:
            latest[0] = seen
            changes.touch()

        task = asyncio.create_task(
            follow(
                client,
                f"/v1/questions/{rid}/events",
                cursor=None,
                progress=progress,
            )
        )
        await changes.until(lambda: latest[0] == 2)
        # The hub stops hearing notifications (as if the LISTEN connection had dropped).
        listener._subscribers[EVENTS_CHANNEL].discard(hub.notify)
        await append(db, rid, "delta", {"text": "unheard"})
        await asyncio.sleep(0.3)
        assert latest[0] == 2
        # The listener's reconnect wakes everyone with an empty payload: the feed re-reads.
        hub.poll_s = 0.2  # from the feed's next wait on
        hub.notify(EVENTS_CHANNEL, "")
        await changes.until(lambda: latest[0] == 3, limit_s=10)
        # Without any wake-up at all, the fallback poll still delivers.
        await append(db, rid, "delta", {"text": "polled"})
        await finish(db, rid)
        await changes.until(lambda: latest[0] == 6, limit_s=15)
        followed = await asyncio.wait_for(task, 10)
    _check_exactly_once(followed, [1, 2, 3, 4, 5, 6])


async def test_a_send_that_never_completes_times_out_and_closes_the_stream() -> None:
    closed = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"data: x\r\n\r\n"
        finally:
            closed.set()

    async def stuck_send(message: Any) -> None:
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the client's socket never drains

    async def receive() -> Any:
        await asyncio.Event().wait()  # and it never hangs up either

    response = StreamResponse(body(), send_timeout=0.5, ping=0)
    started = asyncio.get_running_loop().time()
    with pytest.raises(SendTimeoutError):
        async with asyncio.timeout(10):
            await response({"type": "http", "method": "GET"}, receive, stuck_send)
    assert closed.is_set()  # the generator's cleanup ran (the stream's subscription is released)
    assert asyncio.get_running_loop().time() - started < 3
