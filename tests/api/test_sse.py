"""SSE against a real uvicorn server: replay, live tail, resume, termination, pings, other processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import textwrap

import httpx
import pytest

from service.client.sse import SseMessage
from service.config import Settings
from service.store.db import Database
from tests.api.conftest import Server, StartServer
from tests.api.helpers import append, ask, finish, mark_running
from tests.api.sse_client import events, messages


async def _collect(
    client: httpx.AsyncClient, url: str, *, headers: dict[str, str] | None = None
) -> list[SseMessage]:
    async with client.stream("GET", url, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        return [m async for m in events(response)]


async def test_client_dropping_mid_answer_resumes_with_last_event_id_exactly_once(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        rid = (await ask(client, "p-drop"))["id"]
        await mark_running(db, rid, "answering")
        seen: list[SseMessage] = []
        async with client.stream("GET", f"/v1/questions/{rid}/events") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            stream = events(response)
            async for message in stream:
                seen.append(message)
                if len(seen) == 2:  # queued + running replayed: now write live deltas
                    for i in range(3):
                        await append(db, rid, "delta", {"text": f"part{i} "})
                if len(seen) == 4:
                    break  # the client drops mid-answer
        # Written while nobody listens.
        for i in range(3, 8):
            await append(db, rid, "delta", {"text": f"part{i} "})
        last_id = seen[-1].id
        assert last_id is not None

        resumed: list[SseMessage] = []
        async with client.stream(
            "GET", f"/v1/questions/{rid}/events", headers={"Last-Event-ID": last_id}
        ) as response:
            assert response.status_code == 200
            async for message in events(response):
                resumed.append(message)
                if len(resumed) == 5:
                    await append(db, rid, "delta", {"text": "tail"})
                    await finish(db, rid)
        # The stream closed by itself after the terminal event.
        ids = [int(m.id or 0) for m in seen + resumed]
        assert ids == list(range(1, len(ids) + 1)), ids
        texts = [m.json()["text"] for m in seen + resumed if m.event == "delta"]
        assert texts == [f"part{i} " for i in range(8)] + ["tail"]
        assert [m.event for m in resumed[-2:]] == ["status", "done"]
        for message in seen + resumed:
            data = message.json()
            assert data["request_id"] == rid and data["ordinal"] == 1 and data["seq"] == int(message.id or 0)
            assert data["at"].endswith("Z") and len(data["at"]) == len("2026-11-29T10:00:00.000000Z")


async def test_after_query_resumes_and_last_event_id_wins(server: Server, db: Database) -> None:
    async with server.client() as client:
        rid = (await ask(client, "p-after"))["id"]
        await mark_running(db, rid)
        for i in range(3):
            await append(db, rid, "delta", {"text": str(i)})
        await finish(db, rid)  # seqs: 1 queued, 2 running, 3-5 deltas, 6 status, 7 done
        after = await _collect(client, f"/v1/questions/{rid}/events?after=3")
        assert [m.id for m in after] == ["4", "5", "6", "7"]
        both = await _collect(client, f"/v1/questions/{rid}/events?after=1", headers={"Last-Event-ID": "5"})
        assert [m.id for m in both] == ["6", "7"]


async def test_stream_opened_after_the_end_replays_and_closes(server: Server, db: Database) -> None:
    async with server.client() as client:
        rid = (await ask(client, "p-ended"))["id"]
        await mark_running(db, rid)
        await finish(db, rid)
        replay = await _collect(client, f"/v1/questions/{rid}/events")
        assert [m.event for m in replay] == ["status", "status", "status", "done"]
        assert replay[-1].json()["record"]["status"] == "succeeded"


async def test_resume_at_or_after_the_terminal_event_is_204(server: Server, db: Database) -> None:
    async with server.client() as client:
        rid = (await ask(client, "p-204"))["id"]
        await finish(db, rid)  # 1 queued, 2 status, 3 done
        for cursor in ("3", "4", "99"):
            response = await client.get(f"/v1/questions/{rid}/events", headers={"Last-Event-ID": cursor})
            assert response.status_code == 204
        assert (await client.get(f"/v1/questions/{rid}/events?after=3")).status_code == 204
        # Just before the terminal event: only the terminal event comes.
        last = await _collect(client, f"/v1/questions/{rid}/events", headers={"Last-Event-ID": "2"})
        assert [m.event for m in last] == ["done"]


async def test_streams_send_a_retry_hint_and_comment_pings(start_server: StartServer, db: Database) -> None:
    server = await start_server(ping_s=0.2)
    async with server.client() as client:
        rid = (await ask(client, "p-ping"))["id"]
        got: list[SseMessage] = []
        async with client.stream("GET", f"/v1/questions/{rid}/events") as response:
            async for message in messages(response):
                got.append(message)
                if sum(1 for m in got if m.event is None and m.retry_ms is None) >= 2:
                    break
        assert got[0].retry_ms is not None and got[0].retry_ms > 0
        pings = [m for m in got if m.event is None and m.retry_ms is None]
        assert len(pings) >= 2 and all(m.comments for m in pings)
        assert any(m.event == "status" for m in got)


async def test_bad_last_event_id_is_400(server: Server) -> None:
    async with server.client() as client:
        rid = (await ask(client, "p-bad-leid"))["id"]
        response = await client.get(f"/v1/questions/{rid}/events", headers={"Last-Event-ID": "x1"})
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_last_event_id"


SECOND_PROCESS = textwrap.dedent(
    """
    import asyncio, sys, uuid
    from service.store.db import connect
    from service.store.events import append_event

    async def main() -> None:
        db = connect(sys.argv[1], pool_size=1)
        for rid in sys.argv[2:]:
            for i in range(3):
                async with db.sessions() as tx:
                    await append_event(tx, uuid.UUID(rid), "delta", {"text": f"{rid[:4]}-{i}"})
                    await tx.commit()
                await asyncio.sleep(0.05)
        await db.dispose()

    asyncio.run(main())
    """
)


async def _run_second_process(settings: Settings, *request_ids: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SECOND_PROCESS,
        settings.database_url or "",
        *request_ids,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()


async def test_session_stream_is_fed_by_a_second_process(server: Server, settings: Settings) -> None:
    async with server.client() as client:
        first = (await ask(client, "p-cross"))["id"]
        second = (await ask(client, "p-cross"))["id"]
        other = (await ask(client, "p-elsewhere"))["id"]  # another session's events must not appear
        got: list[SseMessage] = []
        async with client.stream("GET", "/v1/sessions/p-cross/events") as response:
            writer: asyncio.Task[None] | None = None
            async for message in events(response):
                got.append(message)
                if len(got) == 2:  # both queued events replayed; now another process writes live
                    writer = asyncio.create_task(_run_second_process(settings, first, second, other))
                if len(got) == 8:
                    break
            assert writer is not None
            await writer
        ids = [int(m.id or 0) for m in got]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        deltas = [m.json()["text"] for m in got if m.event == "delta"]
        assert deltas == [f"{first[:4]}-{i}" for i in range(3)] + [f"{second[:4]}-{i}" for i in range(3)]
        assert all(m.json()["request_id"] in (first, second) for m in got)

        # Resume the session stream after the 4th message: the rest, once, in order.
        again = []
        async with client.stream(
            "GET", "/v1/sessions/p-cross/events", headers={"Last-Event-ID": got[3].id or ""}
        ) as response:
            async for message in events(response):
                again.append(message)
                if len(again) == 4:
                    break
        assert [m.id for m in again] == [m.id for m in got[4:]]


async def test_request_stream_is_fed_by_a_second_process(
    server: Server, settings: Settings, db: Database
) -> None:
    async with server.client() as client:
        rid = (await ask(client, "p-cross-req"))["id"]
        got: list[SseMessage] = []
        async with client.stream("GET", f"/v1/questions/{rid}/events") as response:
            writer = asyncio.create_task(_run_second_process(settings, rid))
            async for message in events(response):
                got.append(message)
                if len(got) == 4:
                    await writer
                    await finish(db, rid)
        assert [m.event for m in got] == ["status", "delta", "delta", "delta", "status", "done"]


async def test_a_client_that_stops_reading_does_not_block_another(server: Server, db: Database) -> None:
    async with server.client() as slow_client, server.client() as fast_client:
        rid = (await ask(slow_client, "p-slow"))["id"]
        await mark_running(db, rid, "answering")
        async with slow_client.stream("GET", f"/v1/questions/{rid}/events") as slow:
            assert slow.status_code == 200  # opened, then never read
            chunk = "x" * 65536
            got = 0
            async with fast_client.stream("GET", f"/v1/questions/{rid}/events") as fast:
                stream = events(fast)
                for _ in range(2):
                    await anext(stream)
                for _ in range(120):  # ~8 MB: beyond what loopback socket buffers hold for the slow one
                    await append(db, rid, "delta", {"text": chunk})
                async with asyncio.timeout(20):
                    async for _message in stream:
                        got += 1
                        if got == 120:
                            break
            assert got == 120
            assert server.app.state.hub.streams >= 1


async def test_clear_ends_open_streams_with_cancelled(server: Server, db: Database) -> None:
    async with server.client() as client:
        rid = (await ask(client, "p-clear-stream"))["id"]
        await mark_running(db, rid, "answering")
        got: list[SseMessage] = []
        async with client.stream("GET", f"/v1/questions/{rid}/events") as response:
            async for message in events(response):
                got.append(message)
                if len(got) == 2:
                    assert (await client.delete("/v1/sessions/p-clear-stream/questions")).status_code == 200
        assert [m.event for m in got[-2:]] == ["status", "error"]
        assert got[-2].json()["status"] == "cancelled"
        assert got[-1].json()["code"] == "cancelled" and got[-1].json()["detail"] == {}
        # The cleared request is gone for new readers.
        assert (await client.get(f"/v1/questions/{rid}/events")).status_code == 404


async def test_fresh_session_stream_hides_cleared_history_but_shows_new_requests(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        await ask(client, "p-fresh")
        assert (await client.delete("/v1/sessions/p-fresh/questions")).status_code == 200
        new = (await ask(client, "p-fresh"))["id"]
        async with client.stream("GET", "/v1/sessions/p-fresh/events") as response:
            first = await anext(events(response))
        assert first.json()["request_id"] == new and first.json()["ordinal"] == 2
        assert json.loads(first.data)["status"] == "queued"


async def test_no_stream_replays_what_a_cleared_history_wrote_not_even_one_resuming_from_before(
    server: Server, db: Database
) -> None:
    """SPEC §3: a clear deletes the history, so a session stream resumed from before the clear
    (Last-Event-ID: 0, ?after=0) must not replay the cleared requests' questions and answers. It gets
    what the clear itself wrote (the cancellation of a running request) and what came after."""
    async with server.client() as client:
        done = (await ask(client, "p-gone", "secret question"))["id"]
        await mark_running(db, done, "answering")
        await append(db, done, "delta", {"text": "secret answer"})
        await finish(db, done, "secret answer")
        running = (await ask(client, "p-gone"))["id"]
        await mark_running(db, running, "answering")
        assert (await client.delete("/v1/sessions/p-gone/questions")).status_code == 200
        new = (await ask(client, "p-gone", "after the clear"))["id"]
        for headers, params in (({"Last-Event-ID": "0"}, {}), ({}, {"after": 0})):
            got: list[SseMessage] = []
            async with client.stream(
                "GET", "/v1/sessions/p-gone/events", headers=headers, params=params
            ) as response:
                async for message in events(response):
                    got.append(message)
                    if message.json()["request_id"] == new:
                        break
            assert not any("secret" in m.data for m in got)
            assert [(m.json()["request_id"], m.event) for m in got] == [
                (running, "status"),
                (running, "error"),
                (new, "status"),
            ]
            assert got[1].json()["code"] == "cancelled"


async def test_a_stream_resumed_after_a_clear_is_not_served_the_cleared_history_from_a_live_feed(
    server: Server, db: Database
) -> None:
    """The rule holds while another stream keeps the session's feed (and its buffer of events read
    before the clear) alive: a stream resuming from before the clear gets only the cancellation.
    (The buffer must not serve the cleared deltas; after any clear a resumed session stream reads
    its rows itself, and this checks the result.)"""
    async with server.client() as client:
        rid = (await ask(client, "p-buffered", "kept alive"))["id"]
        seen: list[SseMessage] = []

        async def keep_open() -> None:
            async with client.stream("GET", "/v1/sessions/p-buffered/events") as response:
                async for message in events(response):
                    seen.append(message)

        watcher = asyncio.create_task(keep_open())
        try:
            await mark_running(db, rid, "answering")
            await append(db, rid, "delta", {"text": "secret answer"})
            for _ in range(200):  # the watcher has read the delta (the feed buffered it)
                if any(m.event == "delta" for m in seen):
                    break
                await asyncio.sleep(0.05)
            assert any(m.event == "delta" for m in seen)
            first_id = seen[0].id
            assert (await client.delete("/v1/sessions/p-buffered/questions")).status_code == 200
            got: list[SseMessage] = []
            headers = {"Last-Event-ID": str(first_id)}
            async with client.stream("GET", "/v1/sessions/p-buffered/events", headers=headers) as response:
                async for message in events(response):
                    got.append(message)
                    if message.event == "error":
                        break
            assert not any("secret" in m.data for m in got)
            assert [m.event for m in got] == ["status", "error"] and got[-1].json()["code"] == "cancelled"
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


async def test_a_fresh_session_stream_replays_no_hand_off_of_a_cleared_or_replaced_history(
    server: Server, db: Database
) -> None:
    """After a clear (or an archive restore with mode=replace) a fresh session stream replays none of
    the old history's ``handoff`` events: they would name hand-offs that no longer exist."""
    async with server.client() as client:
        rid = (await ask(client, "p-ho-clear"))["id"]
        await mark_running(db, rid)
        await finish(db, rid)
        assert (await client.post("/v1/sessions/p-ho-clear/handoffs", json={})).status_code == 201
        archive = (await client.get("/v1/sessions/p-ho-clear/archive")).json()
        assert (await client.delete("/v1/sessions/p-ho-clear/questions")).status_code == 200
        new = (await ask(client, "p-ho-clear"))["id"]
        async with client.stream("GET", "/v1/sessions/p-ho-clear/events") as response:
            first = await anext(events(response))
        assert first.event == "status" and first.json()["request_id"] == new
        # The same after a replace: the restored history has its hand-offs, not the old events.
        rid2 = (await ask(client, "p-ho-replace"))["id"]
        await mark_running(db, rid2)
        await finish(db, rid2)
        assert (await client.post("/v1/sessions/p-ho-replace/handoffs", json={})).status_code == 201
        restored = await client.post("/v1/sessions/p-ho-replace/archive?mode=replace", json=archive)
        assert restored.status_code == 200, restored.text
        newer = (await ask(client, "p-ho-replace"))["id"]
        seen = []
        async with client.stream("GET", "/v1/sessions/p-ho-replace/events") as response:
            async for message in events(response):  # the restored history's events, then the new one
                seen.append(message.event)
                if message.json().get("request_id") == newer:
                    break
        assert "handoff" not in seen and seen[-1] == "status", seen


async def test_a_cursor_beyond_any_seq_is_answered_not_crashed(server: Server, db: Database) -> None:
    async with server.client() as client:
        rid = (await ask(client, "p-huge"))["id"]
        await finish(db, rid)
        huge = str(2**40)
        assert (
            await client.get(f"/v1/questions/{rid}/events", headers={"Last-Event-ID": huge})
        ).status_code == 204
        assert (await client.get(f"/v1/questions/{rid}/events?after={huge}")).status_code == 204
        assert (await client.get(f"/v1/questions/{rid}/events?after={2**64}")).status_code == 422
        assert (
            await client.get(f"/v1/questions/{rid}/events", headers={"Last-Event-ID": str(2**64)})
        ).status_code == 400
        open_rid = (await ask(client, "p-huge"))["id"]
        async with client.stream("GET", f"/v1/questions/{open_rid}/events?after={huge}") as response:
            assert response.status_code == 200
            stream = messages(response)
            first = await anext(stream)
            assert first.retry_ms is not None
            # Open and healthy, waiting for more (a failed query would have closed it).
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.0):
                    await anext(stream)
