"""SPEC §9, concurrency and durability: the shared cap, fairness, crashes, concurrent admissions.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx

from tests.e2e.contract.helpers import (
    TERMINAL,
    Limited,
    ask,
    events_of,
    hang_and_wait_running,
    limited_env,
    new_parent,
    read_stream,
    wait_for,
)
from tests.scripted_provider import ScriptedServer, Step


async def test_max_concurrency_is_shared_by_both_processes(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parents = [new_parent() for _ in range(6)]
    scripted.script("answer", *[Step.hang()] * 6)
    records = [await ask(client, parent, "Hang.") for parent in parents]
    try:
        deadline = time.monotonic() + 10
        while len(scripted.requests("answer")) < 4:
            assert time.monotonic() < deadline, "fewer than 4 requests started"
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # both workers poll every 0.2 s: time enough to over-claim
        statuses = [(await client.get(f"/v1/questions/{r['id']}")).json()["status"] for r in records]
        assert statuses.count("running") == 4 and statuses.count("queued") == 2, statuses
        assert len(scripted.requests("answer")) == 4
    finally:
        for parent in parents:
            await client.delete(f"/v1/sessions/{parent}/questions")


async def test_a_killed_process_loses_nothing_and_separate_api_and_worker_processes_take_over(
    limited: Limited,
) -> None:
    parent = new_parent()
    async with limited.client() as http:
        running = await hang_and_wait_running(http, limited.scripted, parent)
        queued = await ask(http, parent, "Admitted before the crash.")
    limited.service.proc.kill()
    limited.service.proc.wait(10)
    # Restart as the two halves: the worker reruns the request, the API streams what it wrote.
    env = limited_env(limited.scripted)
    worker = limited.box.start("worker", **env)
    limited.service = await asyncio.to_thread(limited.box.start, "api", **env)
    async with limited.client() as http:
        rerun = await wait_for(http, running["id"])
        after = await wait_for(http, queued["id"])
        _, stream = await read_stream(http, f"/v1/questions/{running['id']}/events")
    assert worker.proc.poll() is None
    assert rerun["status"] == "succeeded", rerun["error"]
    assert rerun["attempt"] == 2
    assert after["status"] == "succeeded" and after["ordinal"] == 2
    statuses = [m.json() for m in events_of(stream) if m.event == "status"]
    assert [s.get("stage") for s in statuses if s["status"] == "running"].count("preparing") == 2
    assert events_of(stream)[-1].event == "done"


async def test_concurrent_admissions_while_workers_finish_get_distinct_ordinals_and_never_a_500(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    path = f"/v1/sessions/{parent}/questions"
    responses: list[httpx.Response] = []
    for wave in range(3):  # later waves race the worker finishing (and appending events to) earlier ones
        responses += await asyncio.gather(
            *(client.post(path, json={"question": f"Wave {wave} #{n}?"}) for n in range(6))
        )
        await asyncio.sleep(0.15)
    assert [r.status_code for r in responses] == [202] * 18, [
        r.text for r in responses if r.status_code != 202
    ]
    assert sorted(r.json()["ordinal"] for r in responses) == list(range(1, 19))
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    same = await asyncio.gather(
        *(client.post(path, json={"question": "Once?"}, headers=key) for _ in range(5))
    )
    assert sorted(r.status_code for r in same) == [200, 200, 200, 200, 202]
    assert len({r.json()["id"] for r in same}) == 1
    for response in [*responses, same[0]]:
        assert (await wait_for(client, response.json()["id"], within_s=30))["status"] == "succeeded"


async def test_a_freed_slot_goes_to_the_session_that_never_ran_before_an_older_queued_one(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    ran_before, never_ran = new_parent(), new_parent()
    await wait_for(client, (await ask(client, ran_before, "Runs first."))["id"])
    blockers = [new_parent() for _ in range(4)]
    scripted.script("answer", *[Step.hang()] * 5)
    try:
        hanging = [await ask(client, parent, "Holds a slot.") for parent in blockers]
        deadline = time.monotonic() + 10
        while len(scripted.requests("answer")) < 4:
            assert time.monotonic() < deadline, "the 4 slots did not fill"
            await asyncio.sleep(0.02)
        older = await ask(client, ran_before, "Queued first, but its session ran before.")
        newer = await ask(client, never_ran, "Queued second, in a session that never ran.")
        await asyncio.sleep(0.3)
        assert (await client.get(f"/v1/questions/{older['id']}")).json()["status"] == "queued"
        await client.post(f"/v1/questions/{hanging[0]['id']}/cancel")
        assert (await wait_for(client, newer["id"], ("running", *TERMINAL)))["status"] == "running"
        await asyncio.sleep(0.3)
        assert (await client.get(f"/v1/questions/{older['id']}")).json()["status"] == "queued"
    finally:
        for parent in (*blockers, ran_before, never_ran):
            await client.delete(f"/v1/sessions/{parent}/questions")
