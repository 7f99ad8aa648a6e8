"""SPEC §3 and §9, cancel and clear: idempotent cancels, clears, the cancelled call's usage.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx

from tests.e2e.contract.helpers import (
    SNAPSHOT,
    ask,
    assert_error,
    events_of,
    hang_and_wait_running,
    new_parent,
    read_stream,
    wait_for,
)
from tests.scripted_provider import ScriptedServer


async def test_cancel_queued_and_running_is_idempotent_and_ends_the_stream_with_cancelled(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    running = await hang_and_wait_running(client, scripted, parent)
    queued = await ask(client, parent, "Behind the hanging one.")
    assert (await client.get(f"/v1/questions/{queued['id']}")).json()["status"] == "queued"

    cancelled_queued = await client.post(f"/v1/questions/{queued['id']}/cancel")
    assert cancelled_queued.status_code == 200
    assert cancelled_queued.json()["status"] == "cancelled"
    assert cancelled_queued.json()["error"]["code"] == "cancelled"
    again = await client.post(f"/v1/questions/{queued['id']}/cancel")
    assert again.status_code == 200 and again.json() == cancelled_queued.json()

    live = asyncio.create_task(read_stream(client, f"/v1/questions/{running['id']}/events"))
    await asyncio.sleep(0.2)
    cancelled_running = await client.post(f"/v1/questions/{running['id']}/cancel")
    assert cancelled_running.status_code == 200 and cancelled_running.json()["status"] == "cancelled"
    status, stream = await live
    events = events_of(stream)
    assert status == 200
    assert events[-2].event == "status" and events[-2].json()["status"] == "cancelled"
    assert events[-1].event == "error" and events[-1].json()["code"] == "cancelled"
    settled = await wait_for(client, running["id"])
    assert settled["status"] == "cancelled"
    await asyncio.sleep(0.3)  # a worker that notices late must not change the terminal state
    later = (await client.get(f"/v1/questions/{running['id']}")).json()
    # …except usage: the answer call cut by the cancel is recorded when the worker stops it (SPEC 7:
    # cancelled calls count), which may land after the API's terminal write — and with it the answer
    # model the record names (the cancel itself does not know it).
    late = ("usage", "model")
    assert {k: v for k, v in later.items() if k not in late} == {
        k: v for k, v in settled.items() if k not in late
    }
    assert all(call["status"] == "cancelled" for call in later["usage"]["calls"])
    assert later["model"] == (later["usage"]["calls"][0]["model"] if later["usage"]["calls"] else None)
    for rid in (queued["id"], running["id"]):
        _, replay = await read_stream(client, f"/v1/questions/{rid}/events")
        assert events_of(replay)[-1].event == "error" and events_of(replay)[-1].json()["code"] == "cancelled"
        assert [m.event for m in events_of(replay)].count("error") == 1

    # A terminal request comes back unchanged.
    finished = await ask(client, parent, "Now an ordinary one.")
    done = await wait_for(client, finished["id"])
    assert done["status"] == "succeeded"
    unchanged = await client.post(f"/v1/questions/{finished['id']}/cancel")
    assert unchanged.status_code == 200 and unchanged.json() == done
    assert_error(await client.post(f"/v1/questions/{uuid.uuid4()}/cancel"), 404)


async def test_clear_cancels_deletes_history_bumps_clear_version_and_keeps_snapshots_and_ordinals(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    put = await client.put(f"/v1/sessions/{parent}/snapshots/s-1", json=SNAPSHOT)
    assert put.status_code == 201
    earlier = await ask(client, parent, "Before the clear?", snapshot_id="s-1")
    await wait_for(client, earlier["id"])
    running = await hang_and_wait_running(client, scripted, parent)
    queued = await ask(client, parent, "Queued behind it.")
    live = asyncio.create_task(read_stream(client, f"/v1/questions/{running['id']}/events"))
    await asyncio.sleep(0.2)

    cleared = await client.delete(f"/v1/sessions/{parent}/questions")
    assert cleared.status_code == 200
    _, stream = await live
    assert events_of(stream)[-1].event == "error" and events_of(stream)[-1].json()["code"] == "cancelled"

    session = (await client.get(f"/v1/sessions/{parent}")).json()
    assert session["clear_version"] == 1
    assert session["counts"] == {"queued": 0, "running": 0, "succeeded": 0, "failed": 0, "cancelled": 0}
    assert session["memory"] == {"qa_summary": None, "context_summaries": []}
    assert session["next_ordinal"] == 4
    page = (await client.get(f"/v1/sessions/{parent}/questions")).json()
    assert page == {"items": [], "has_more": False, "next_before": None}
    for rid in (earlier["id"], running["id"], queued["id"]):
        assert_error(await client.get(f"/v1/questions/{rid}"), 404)
        assert_error(await client.post(f"/v1/questions/{rid}/cancel"), 404)
        assert (await read_stream(client, f"/v1/questions/{rid}/events"))[0] == 404

    # Snapshots survive a clear; ordinals keep counting.
    after = await ask(client, parent, "After the clear?", snapshot_id="s-1")
    assert after["ordinal"] == 4
    done = await wait_for(client, after["id"])
    assert done["status"] == "succeeded", done["error"]
    assert (await client.put(f"/v1/sessions/{parent}/snapshots/s-1", json=SNAPSHOT)).status_code == 200
    assert_error(await client.delete(f"/v1/sessions/{new_parent()}/questions"), 404)


async def test_a_cancelled_running_call_is_recorded_in_usage(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    running = await hang_and_wait_running(client, scripted, new_parent())
    assert (await client.post(f"/v1/questions/{running['id']}/cancel")).status_code == 200
    deadline = time.monotonic() + 5
    while True:
        record = (await client.get(f"/v1/questions/{running['id']}")).json()
        calls = record["usage"]["calls"]
        if calls or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert record["status"] == "cancelled"
    assert [(c["purpose"], c["status"], c["reported"]) for c in calls] == [("answer", "cancelled", False)]
