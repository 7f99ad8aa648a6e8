"""SPEC §4, events (SSE): ids, resumption, live tails, deltas, terminal events.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping

import httpx

from service.client.sse import SseMessage
from tests.api.sse_client import messages
from tests.e2e.contract.helpers import (
    SNAPSHOT,
    ask,
    assert_error,
    events_of,
    new_parent,
    parse_utc,
    read_stream,
    wait_for,
)
from tests.scripted_provider import ScriptedServer, Step, Usage

STAGES = ("preparing", "organizing_history", "compacting_context", "answering")


async def session_events_until(
    http: httpx.AsyncClient, parent: str, done: int, *, headers: Mapping[str, str] | None = None
) -> list[SseMessage]:
    """Session stream events until ``done`` terminal events (done / error) were seen (it never ends)."""
    seen: list[SseMessage] = []
    async with asyncio.timeout(15):
        async with http.stream("GET", f"/v1/sessions/{parent}/events", headers=headers) as response:
            assert response.status_code == 200
            async for message in messages(response):
                if message.event is None:
                    continue
                seen.append(message)
                if sum(m.event in ("done", "error") for m in seen) >= done:
                    return seen
    raise AssertionError("unreachable")


async def test_request_stream_ids_are_seq_with_spec_data_and_status_order(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.text("It is editing billing/invoice.py.", chunks=3, usage=Usage(200, 9)))
    record = await ask(client, new_parent(), "Which file?", snapshot=SNAPSHOT)
    status, stream = await read_stream(client, f"/v1/questions/{record['id']}/events")
    assert status == 200
    assert any(m.retry_ms is not None and m.retry_ms > 0 for m in stream), "no retry: hint"
    events = events_of(stream)
    assert [int(m.id or 0) for m in events] == list(range(1, len(events) + 1))
    for message in events:
        data = message.json()
        assert message.event in ("status", "progress", "delta", "usage", "done", "error")
        assert data["request_id"] == record["id"] and data["ordinal"] == record["ordinal"]
        assert data["seq"] == int(message.id or 0)
        parse_utc(data["at"])
    statuses = [m.json() for m in events if m.event == "status"]
    assert statuses[0]["status"] == "queued"
    assert statuses[1]["status"] == "running" and statuses[1]["stage"] == "preparing"
    stages = [s["stage"] for s in statuses[1:-1]]
    assert stages == sorted(stages, key=STAGES.index) and len(set(stages)) == len(stages)
    assert "answering" in stages
    assert events[-2].event == "status" and events[-2].json()["status"] == "succeeded"
    assert events[-1].event == "done"
    final = events[-1].json()["record"]
    assert final["status"] == "succeeded" and final["answer"] == "It is editing billing/invoice.py."
    assert "".join(m.json()["text"] for m in events if m.event == "delta") == final["answer"]
    assert any(m.event == "usage" for m in events)
    times = [parse_utc(m.json()["at"]) for m in events]
    assert times == sorted(times)


async def test_request_stream_resumes_exactly_after_last_event_id_or_after_and_the_header_wins(
    client: httpx.AsyncClient,
) -> None:
    record = await ask(client, new_parent())
    await wait_for(client, record["id"])
    path = f"/v1/questions/{record['id']}/events"
    _, full = await read_stream(client, path)  # opened after the end: replays and closes
    events = events_of(full)
    assert events[-1].event == "done"
    cut = len(events) // 2
    expected = [(m.id, m.event, m.data) for m in events[cut:]]
    last_id = events[cut - 1].id or ""

    _, by_header = await read_stream(client, path, headers={"Last-Event-ID": last_id})
    assert [(m.id, m.event, m.data) for m in events_of(by_header)] == expected
    _, by_query = await read_stream(client, path, params={"after": last_id})
    assert [(m.id, m.event, m.data) for m in events_of(by_query)] == expected
    _, both = await read_stream(client, path, headers={"Last-Event-ID": last_id}, params={"after": 1})
    assert [(m.id, m.event, m.data) for m in events_of(both)] == expected

    terminal = events[-1].id or ""
    assert (await read_stream(client, path, headers={"Last-Event-ID": terminal}))[0] == 204
    assert (await read_stream(client, path, params={"after": int(terminal) + 3}))[0] == 204
    assert (await read_stream(client, path, headers={"Last-Event-ID": terminal}, params={"after": 1}))[
        0
    ] == 204


async def test_live_request_stream_resumed_mid_request_has_no_gap_and_no_duplicate(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.text("one two three four", chunks=4, delay_between_s=0.1))
    record = await ask(client, new_parent())
    path = f"/v1/questions/{record['id']}/events"
    first: list[SseMessage] = []
    async with client.stream("GET", path) as response:
        async for message in messages(response):
            if message.event is not None:
                first.append(message)
            if message.event == "status" and message.json().get("stage") == "answering":
                break  # the connection drops mid-request
    _, rest = await read_stream(client, path, headers={"Last-Event-ID": first[-1].id or ""})
    seqs = [int(m.id or 0) for m in first + events_of(rest)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert events_of(rest)[-1].event == "done"


async def test_session_stream_ids_are_global_event_ids_across_requests(client: httpx.AsyncClient) -> None:
    parent = new_parent()
    first = await ask(client, parent, "First?")
    second = await ask(client, parent, "Second?")
    await wait_for(client, second["id"])
    session_events = await session_events_until(client, parent, 2)
    ids = [int(m.id or 0) for m in session_events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    by_request: dict[str, list[SseMessage]] = {}
    for message in session_events:
        by_request.setdefault(message.json()["request_id"], []).append(message)
    assert set(by_request) == {first["id"], second["id"]}
    for rid, own in by_request.items():
        _, stream = await read_stream(client, f"/v1/questions/{rid}/events")
        # Same events in the same order; the session stream's id is not the per-request seq.
        assert [(m.event, m.data) for m in own] == [(m.event, m.data) for m in events_of(stream)]
    assert by_request[second["id"]][0].json()["seq"] == 1
    assert int(by_request[second["id"]][0].id or 0) > int(by_request[first["id"]][0].id or 0) >= 1
    # Resuming the session stream with a global id continues exactly after it.
    resumed = await session_events_until(client, parent, 1, headers={"Last-Event-ID": str(ids[2])})
    assert [int(m.id or 0) for m in resumed] == ids[3 : 3 + len(resumed)]


async def test_done_record_equals_the_stored_record_and_error_event_matches_record_error(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    ok = await ask(client, new_parent())
    final = await wait_for(client, ok["id"])
    _, stream = await read_stream(client, f"/v1/questions/{ok['id']}/events")
    assert events_of(stream)[-1].json()["record"] == final
    scripted.script("answer", Step.model_not_found())
    bad = await ask(client, new_parent())
    failed = await wait_for(client, bad["id"])
    _, stream = await read_stream(client, f"/v1/questions/{bad['id']}/events")
    error = events_of(stream)[-1].json()
    assert {k: error[k] for k in ("code", "message", "detail")} == {
        k: failed["error"][k] for k in ("code", "message", "detail")
    }


async def test_stream_edges_unknown_ids_bad_cursor_and_no_cors_by_default(client: httpx.AsyncClient) -> None:
    assert_error(await client.get(f"/v1/questions/{uuid.uuid4()}/events"), 404)
    assert_error(await client.get(f"/v1/sessions/{new_parent()}/events"), 404)
    record = await ask(client, new_parent())
    await wait_for(client, record["id"])
    assert_error(
        await client.get(f"/v1/questions/{record['id']}/events", headers={"Last-Event-ID": "abc"}), 400
    )
    assert_error(await client.get(f"/v1/questions/{record['id']}/events", params={"after": -1}), 422)
    cors = await client.get(f"/v1/questions/{record['id']}", headers={"Origin": "https://example.com"})
    assert not any(h.lower().startswith("access-control-") for h in cors.headers)
    assert_error(await client.patch(f"/v1/questions/{record['id']}"), 405)


async def test_deltas_are_coalesced_to_about_20_per_second(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    text = "".join(f"w{n} " for n in range(80))
    scripted.script("answer", Step.text(text, chunks=80, delay_between_s=0.01))
    record = await ask(client, new_parent())
    started = time.monotonic()
    _, stream = await read_stream(client, f"/v1/questions/{record['id']}/events")
    elapsed = time.monotonic() - started
    deltas = [m.json()["text"] for m in events_of(stream) if m.event == "delta"]
    assert "".join(deltas) == text
    assert len(deltas) <= elapsed * 20 + 2, (len(deltas), elapsed)


async def test_a_session_stream_opened_before_any_question_tails_new_requests_live(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    assert (await client.put(f"/v1/sessions/{parent}/snapshots/s-1", json=SNAPSHOT)).status_code == 201
    live = asyncio.create_task(session_events_until(client, parent, 2))
    await asyncio.sleep(0.3)
    first = await ask(client, parent, "Live one?", snapshot_id="s-1")
    second = await ask(client, parent, "Live two?")
    events = await live
    assert [m.json()["request_id"] for m in events if m.event == "done"] == [first["id"], second["id"]]
    assert events[0].event == "status" and events[0].json()["status"] == "queued"
    ids = [int(m.id or 0) for m in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
