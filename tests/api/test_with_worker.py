"""The API with the real worker (offline provider): in-process and as a second process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest

from service.client.sse import SseMessage
from service.config import Settings
from service.serve import create_serving_app
from service.store.db import Database
from tests.api.conftest import Server, serve
from tests.api.helpers import ask
from tests.api.sse_client import events

SNAPSHOT = {
    "system": "You are the main agent.",
    "messages": [
        {"role": "user", "content": "Please rename the config loader."},
        {"role": "assistant", "content": "The config loader lives in service/config.py; renaming it now."},
    ],
}


@pytest.fixture
async def worker_process(settings: Settings, db: Database) -> AsyncIterator[asyncio.subprocess.Process]:
    """``sidequest worker`` on the test database: a worker in another process."""
    env = {
        **os.environ,
        "SIDEQUEST_DATABASE_URL": settings.database_url or "",
        "SIDEQUEST_PROVIDER": "offline",
        "SIDEQUEST_POLL_S": "0.2",
        "SIDEQUEST_HEARTBEAT_S": "0.5",
        "SIDEQUEST_LEASE_S": "3",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "service.cli",
        "worker",
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _until_done(server: Server, parent: str, count: int) -> list[SseMessage]:
    got: list[SseMessage] = []
    done = 0
    async with server.client() as client, client.stream("GET", f"/v1/sessions/{parent}/events") as response:
        async with asyncio.timeout(60):
            async for message in events(response):
                got.append(message)
                if message.event in ("done", "error"):
                    done += 1
                    if done == count:
                        break
    return got


async def test_session_stream_fed_by_a_worker_in_a_second_process(
    server: Server, worker_process: asyncio.subprocess.Process
) -> None:
    async with server.client() as client:
        first = await ask(client, "p-worker", "Where is the config loader?", snapshot=SNAPSHOT)
        second = await ask(client, "p-worker", "What is being renamed?", snapshot_id=first["snapshot_id"])
    got = await _until_done(server, "p-worker", 2)
    ids = [int(m.id or 0) for m in got]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for rid in (first["id"], second["id"]):
        mine = [m for m in got if m.json()["request_id"] == rid]
        statuses = [m.json()["status"] for m in mine if m.event == "status"]
        assert statuses[0] == "queued" and "preparing" in [
            m.json().get("stage") for m in mine if m.event == "status"
        ]
        assert statuses[-1] == "succeeded" and mine[-1].event == "done"
        assert [m.json()["seq"] for m in mine] == list(range(1, len(mine) + 1))
        assert any(m.event == "delta" for m in mine)
        record = mine[-1].json()["record"]
        assert record["status"] == "succeeded" and record["answer"]
    async with server.client() as client:
        stored = (await client.get(f"/v1/questions/{first['id']}")).json()
        assert stored["status"] == "succeeded" and stored["finished_at"] is not None
        page = (await client.get("/v1/sessions/p-worker/questions")).json()
        assert [r["status"] for r in page["items"]] == ["succeeded", "succeeded"]
        overview = (await client.get("/v1/sessions/p-worker")).json()
        assert overview["counts"]["succeeded"] == 2


async def test_serve_mode_runs_the_worker_in_process(settings: Settings, db: Database) -> None:
    # The entry point's app: the worker runs in the app's lifespan (what `sidequest serve` runs).
    app = create_serving_app(settings, settings.database_url or "")
    async with serve(app) as base:
        server = Server(url=base, app=app)
        async with server.client() as client:
            record = await ask(client, "p-serve", "Hello?")
            async with client.stream("GET", f"/v1/questions/{record['id']}/events") as response:
                async with asyncio.timeout(60):
                    got = [m async for m in events(response)]
        assert got[-1].event == "done" and got[-2].json()["status"] == "succeeded"
        # API and worker share the process's one LISTEN connection.
        assert app.state.worker.listener is app.state.listener


async def test_serve_mode_hands_a_stored_snapshots_preparation_to_its_worker(
    settings: Settings, db: Database
) -> None:
    # The API prepared the inline snapshot when it stored it; the worker of the same process gets that
    # preparation instead of reading 600 KB back (a miss would show in its counters).
    app = create_serving_app(settings, settings.database_url or "")
    async with serve(app) as base:
        server = Server(url=base, app=app)
        async with server.client() as client:
            posted = await client.post(
                "/v1/sessions/p-handed/questions", json={"question": "what now?", "snapshot": SNAPSHOT}
            )
            assert posted.status_code == 202, posted.text
            async with client.stream("GET", f"/v1/questions/{posted.json()['id']}/events") as response:
                async with asyncio.timeout(60):
                    got = [m async for m in events(response)]
            put = await client.put("/v1/sessions/p-handed/snapshots/s2", json={**SNAPSHOT, "system": "v2"})
            assert put.status_code == 201, put.text
        assert got[-1].event == "done"
        snapshots = app.state.worker.snapshots
        assert snapshots.misses == 0 and snapshots.hits >= 1
        assert len(snapshots) == 2  # the PUT one too, ready for its first question
