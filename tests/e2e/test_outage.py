"""PostgreSQL goes away and comes back while Sidequest runs (SPEC §9), against a server of the test's own.

``sidequest serve`` (API + worker in one process) runs against a private PostgreSQL that the test
stops with ``pg_ctl stop -m fast`` (every connection dropped) while a request is being answered and
a stream is open, and starts again six seconds later. Meanwhile: ``/healthz`` 200, ``/readyz`` 503,
every database route 503 ``service_unavailable`` with ``Retry-After`` within a few seconds (never a
500, never a hang). Afterwards, without restarting Sidequest: ready again, new questions work, the
open stream and a resumed one (``Last-Event-ID``) continue with no gap and no duplicate, the
in-flight request ends, nothing stays ``running``, and nothing refused during the outage was stored.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import pytest

from service.client.sse import SseMessage as Message
from tests.api.sse_client import events
from tests.net import free_port
from tests.own_postgres import OwnPostgres
from tests.scripted_provider import ScriptedServer, Step, Usage

OUTAGE_S = 6.0
# "Within a few seconds": the slowest acceptable answer of any route while PostgreSQL is away.
ANSWER_WITHIN_S = 5.0
TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass
class Deployment:
    base: str
    pg: OwnPostgres
    model: ScriptedServer
    log: Path


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    pg = OwnPostgres()
    proc: subprocess.Popen[bytes] | None = None
    try:
        pg.start()

        async def create() -> None:
            conn = await asyncpg.connect(pg.admin_url)
            try:
                await conn.execute("CREATE DATABASE sidequest")
            finally:
                await conn.close()

        asyncio.run(create())
        with ScriptedServer() as model:
            # Slow answers: the first one is still streaming when PostgreSQL stops.
            model.set_default(
                "answer",
                Step.text("one two three four five six", chunks=6, usage=Usage(50, 6)).with_delay(
                    before_s=0.5, between_s=0.6
                ),
            )
            port = free_port()
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("SIDEQUEST_")},
                "SIDEQUEST_DATABASE_URL": pg.url("sidequest"),
                "SIDEQUEST_PROVIDER": "openai",
                "SIDEQUEST_BASE_URL": model.base_url,
                "SIDEQUEST_API_KEY": "x",
                "SIDEQUEST_MODEL": "scripted-model",
                "SIDEQUEST_LEASE_S": "3",
                "SIDEQUEST_HEARTBEAT_S": "0.5",
                "SIDEQUEST_POLL_S": "0.2",
            }
            log = tmp_path / "serve.log"
            proc = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
                env=env,
                cwd=tmp_path,
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
            )
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()
                try:
                    if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            else:
                raise AssertionError("serve not ready:\n" + log.read_text())
            yield Deployment(base, pg, model, log)
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        pg.destroy()


def _seqs(messages: list[Message]) -> list[int]:
    return [int(m.id) for m in messages if m.id is not None]


async def _follow(client: httpx.AsyncClient, url: str, into: list[Message], headers: dict[str, str]) -> None:
    async with client.stream("GET", url, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for message in events(response):
            into.append(message)
            if message.event in ("done", "error"):
                return


async def _timed(
    client: httpx.AsyncClient, method: str, url: str, **kw: object
) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = await client.request(method, url, **kw)  # type: ignore[arg-type]
    return response, time.monotonic() - started


async def test_postgres_outage_is_survived_without_a_restart(deployment: Deployment) -> None:
    base, parent = deployment.base, "outage-parent"
    async with (
        httpx.AsyncClient(base_url=base, timeout=ANSWER_WITHIN_S * 3) as client,
        httpx.AsyncClient(base_url=base, timeout=None) as streamer,
    ):
        admitted = await client.post(f"/v1/sessions/{parent}/questions", json={"question": "in flight?"})
        assert admitted.status_code == 202, admitted.text
        rid = admitted.json()["id"]
        # A stream that stays open through the outage, and one we drop at the outage and resume.
        live: list[Message] = []
        follower = asyncio.create_task(_follow(streamer, f"/v1/questions/{rid}/events", live, {}))
        dropped: list[Message] = []
        dropper = asyncio.create_task(_follow(streamer, f"/v1/sessions/{parent}/events", dropped, {}))
        # Wait until the answer is streaming (the request is in flight at the model).
        async with asyncio.timeout(20):
            while True:
                if any(m.event == "delta" for m in live):
                    break
                await asyncio.sleep(0.05)

        await asyncio.to_thread(deployment.pg.stop, "fast")
        stopped_at = time.monotonic()
        dropper.cancel()
        await asyncio.gather(dropper, return_exceptions=True)
        resume_after = dropped[-1].id
        assert resume_after is not None

        # ---- PostgreSQL is away ----------------------------------------------------------------
        checks = 0
        while time.monotonic() - stopped_at < OUTAGE_S:
            health, took = await _timed(client, "GET", "/healthz")
            assert health.status_code == 200 and took < ANSWER_WITHIN_S
            ready, took = await _timed(client, "GET", "/readyz")
            assert ready.status_code == 503 and took < ANSWER_WITHIN_S
            assert ready.json()["error"]["code"] == "service_unavailable"  # SPEC's error body
            assert ready.json()["database"] == "unreachable" and int(ready.headers["Retry-After"]) > 0
            for method, url, body in (
                ("POST", f"/v1/sessions/{parent}/questions", {"question": "during the outage"}),
                ("GET", f"/v1/questions/{rid}", None),
                ("GET", f"/v1/sessions/{parent}/questions", None),
                ("GET", f"/v1/sessions/{parent}", None),
                ("PUT", f"/v1/sessions/{parent}/snapshots/s-out", {"messages": []}),
                ("POST", f"/v1/questions/{rid}/cancel", None),
                ("GET", f"/v1/questions/{rid}/events", None),
            ):
                response, took = await _timed(client, method, url, json=body)
                assert response.status_code == 503, (method, url, response.status_code, response.text)
                assert took < ANSWER_WITHIN_S, (method, url, took)
                assert response.json()["error"]["code"] == "service_unavailable"
                assert int(response.headers["Retry-After"]) > 0
                checks += 1
            await asyncio.sleep(0.3)
        assert checks >= 7
        assert not follower.done()  # the open stream waits through the outage; it did not 500

        await asyncio.to_thread(deployment.pg.start)

        # ---- PostgreSQL is back: recovery without restarting Sidequest ---------------------------
        async with asyncio.timeout(30):
            while True:
                if (await client.get("/readyz")).status_code == 200:
                    break
                await asyncio.sleep(0.2)
        after = await client.post(f"/v1/sessions/{parent}/questions", json={"question": "after the outage"})
        assert after.status_code == 202, after.text
        resumed: list[Message] = []
        async with asyncio.timeout(90):
            await follower
            await _follow(
                streamer, f"/v1/questions/{after.json()['id']}/events", [], {}
            )  # the new question is answered
            # The session stream resumed from its last id: everything after it, ending with the new
            # question's terminal event.
            async with streamer.stream(
                "GET", f"/v1/sessions/{parent}/events", headers={"Last-Event-ID": resume_after}
            ) as response:
                assert response.status_code == 200
                async for message in events(response):
                    resumed.append(message)
                    if message.event == "done" and message.json()["request_id"] == after.json()["id"]:
                        break

    # The stream that stayed open: every seq once, in order, from 1 to the terminal event.
    seqs = _seqs(live)
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    assert live[-1].event in ("done", "error")
    # The resumed session stream: continues right after its cursor — no gap, no duplicate with what
    # it had before the outage (global ids strictly increase; the in-flight request's seqs go on).
    before_ids = _seqs(dropped)
    resumed_ids = _seqs(resumed)
    assert resumed_ids == sorted(set(resumed_ids)) and resumed_ids[0] > before_ids[-1]
    in_flight = [m.json()["seq"] for m in dropped + resumed if m.json().get("request_id") == rid]
    assert in_flight == list(range(1, len(in_flight) + 1)), in_flight

    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        record = (await client.get(f"/v1/questions/{rid}")).json()
        assert record["status"] in TERMINAL
        # Either it finished, or its writes failed and it was run again after the lease expired.
        assert record["status"] == "succeeded" or record["error"]["code"] == "worker_lost", record
        session = (await client.get(f"/v1/sessions/{parent}")).json()
        # Nothing stays running, and nothing refused during the outage was stored: two questions.
        assert session["counts"]["running"] == 0 and session["counts"]["queued"] == 0
        assert sum(session["counts"].values()) == 2
        page = (await client.get(f"/v1/sessions/{parent}/questions")).json()
        assert [item["question"] for item in page["items"]] == ["in flight?", "after the outage"]
    log = deployment.log.read_text()
    assert "internal_error" not in log and "unhandled error" not in log
