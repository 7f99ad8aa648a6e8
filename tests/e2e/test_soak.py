"""Soak (marked ``slow``; run with ``scripts/test -m slow``): scale-out processes under a mixed load.

One ``sidequest api`` and two ``sidequest worker`` processes share the run's database; the model is the
scripted server answering every call after a short delay. 20 sessions get 8 questions each; about one
in ten is cancelled while queued or running and two sessions are cleared half way. Throughout, the
running count read from ``/metrics`` never exceeds the slot limit; at the end every visible request is
terminal, every request stream replays gap-free from ``queued`` to its terminal event, and one session
stream followed live saw exactly the events the database holds, in order.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.client.sse import SseMessage
from tests.api.sse_client import events
from tests.net import free_port
from tests.scripted_provider import ScriptedServer, Step, Usage

pytestmark = pytest.mark.slow

SESSIONS = 20
QUESTIONS_PER_SESSION = 8
SLOTS = 4
TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
def deployment(database_url: str, tmp_path: Path) -> Iterator[str]:
    """api + 2 workers as separate processes; yields the API's base URL."""
    with ScriptedServer() as model:
        model.set_default(
            "answer",
            Step.text("an answer in parts", chunks=3, usage=Usage(50, 5)).with_delay(
                before_s=0.05, between_s=0.02
            ),
        )
        port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SIDEQUEST_")},
            "SIDEQUEST_DATABASE_URL": database_url,
            "SIDEQUEST_PROVIDER": "openai",
            "SIDEQUEST_BASE_URL": model.base_url,
            "SIDEQUEST_API_KEY": "x",
            "SIDEQUEST_MODEL": "scripted-model",
            "SIDEQUEST_MAX_CONCURRENCY": str(SLOTS),
        }
        commands = [["api", "--port", str(port)], ["worker"], ["worker"]]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "service.cli", *command],
                env=env,
                stdout=(tmp_path / f"{i}.log").open("wb"),
                stderr=subprocess.STDOUT,
            )
            for i, command in enumerate(commands)
        ]
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            yield base
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                proc.wait(30)


def _running(metrics: str) -> int:
    for line in metrics.splitlines():
        if line.startswith("sidequest_requests_running "):
            return int(float(line.split()[1]))
    raise AssertionError("no sidequest_requests_running in /metrics")


async def test_mixed_load_keeps_the_cap_ends_every_request_and_streams_have_no_gap(deployment: str) -> None:
    rng = random.Random(7)
    parents = [f"soak-{uuid.uuid4().hex[:8]}-{i}" for i in range(SESSIONS)]
    watched = parents[0]
    peak = 0
    done = asyncio.Event()
    live: list[SseMessage] = []

    async with httpx.AsyncClient(base_url=deployment, timeout=30) as client:

        async def sample_cap() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _running((await client.get("/metrics")).text))
                await asyncio.sleep(0.05)

        async def follow_session() -> None:
            async with httpx.AsyncClient(base_url=deployment, timeout=None) as streamer:
                await streamer.put(f"/v1/sessions/{watched}/snapshots/s", json={"messages": []})
                async with streamer.stream("GET", f"/v1/sessions/{watched}/events") as response:
                    async for message in events(response):
                        live.append(message)
                        if done.is_set():
                            return

        sampler = asyncio.create_task(sample_cap())
        follower = asyncio.create_task(follow_session())
        await asyncio.sleep(0.5)

        ids: list[str] = []
        for round_no in range(QUESTIONS_PER_SESSION):
            for parent in parents:
                r = await client.post(f"/v1/sessions/{parent}/questions", json={"question": f"q{round_no}"})
                assert r.status_code == 202, r.text
                ids.append(r.json()["id"])
                if rng.random() < 0.1:
                    assert (await client.post(f"/v1/questions/{rng.choice(ids)}/cancel")).status_code in (
                        200,
                        404,
                    )
            if round_no == QUESTIONS_PER_SESSION // 2:
                for parent in parents[-2:]:
                    assert (await client.delete(f"/v1/sessions/{parent}/questions")).status_code == 200

        async with asyncio.timeout(240):
            while True:
                counts = [(await client.get(f"/v1/sessions/{p}")).json()["counts"] for p in parents]
                if all(c["queued"] == 0 and c["running"] == 0 for c in counts):
                    break
                await asyncio.sleep(0.5)
        done.set()
        await sampler
        await client.post(
            f"/v1/sessions/{watched}/questions", json={"question": "last"}
        )  # wakes the follower
        async with asyncio.timeout(30):
            await follower

        assert 1 <= peak <= SLOTS
        visible = 0
        for rid in ids:
            record = await client.get(f"/v1/questions/{rid}")
            if record.status_code == 404:
                continue  # cleared
            visible += 1
            assert record.json()["status"] in TERMINAL
            async with client.stream("GET", f"/v1/questions/{rid}/events") as response:
                got = [m async for m in events(response)]
            assert [int(m.id or 0) for m in got] == list(range(1, len(got) + 1))
            assert got[0].json()["status"] == "queued"
            assert got[-1].event in ("done", "error") and got[-2].json()["status"] in TERMINAL
        assert visible >= (SESSIONS - 2) * QUESTIONS_PER_SESSION * 0.8

        async with client.stream("GET", f"/v1/sessions/{watched}/events") as response:
            replay: list[SseMessage] = []
            async for message in events(response):
                replay.append(message)
                if len(replay) == len(live):
                    break
        assert [(m.id, m.event, m.data) for m in live] == [(m.id, m.event, m.data) for m in replay]
