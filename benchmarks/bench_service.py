"""Service benchmarks: admission latency and throughput against the slot limit.

Run: ``.venv/bin/python benchmarks/bench_service.py`` (needs a PostgreSQL found the same way as the
tests: SIDEQUEST_TEST_DATABASE_URL → local server → embedded). It creates and drops its own database.

1. Admission latency — POST /v1/sessions/{parent}/questions against `sidequest api` in its own
   process (no worker, so nothing else competes), N sequential posts with an inline snapshot plus N
   posts from 8 concurrent clients.
2. Throughput — `sidequest serve` (API + worker), the model a scripted OpenAI-compatible server
   that answers each call after a fixed delay; 40 questions over 20 sessions with 4 slots.
   The ideal is ceil(40 / 4) × delay; the overhead above it is what the queue costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import pg
from tests.net import free_port
from tests.scripted_provider import ScriptedServer, Step

SNAPSHOT = {
    "system": "You are a coding agent.",
    "messages": [
        {"role": "user", "content": "Fix the flaky test in tests/test_io.py"},
        {"role": "assistant", "content": "Looking at it now."},
    ],
}


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def admission(url: str, n: int = 200) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        # Warm up connections and the session rows.
        for i in range(5):
            await client.post(f"/v1/sessions/warm-{i}/questions", json={"question": "warm"})
        sequential = []
        for i in range(n):
            body = {"question": f"question {i}", "snapshot": SNAPSHOT}
            start = time.perf_counter()
            r = await client.post(f"/v1/sessions/seq-{i % 10}/questions", json=body)
            sequential.append((time.perf_counter() - start) * 1000)
            assert r.status_code == 202, r.text

        concurrent: list[float] = []

        async def one_client(c: int) -> None:
            for i in range(n // 8):
                start = time.perf_counter()
                r = await client.post(f"/v1/sessions/conc-{c}-{i % 2}/questions", json={"question": f"q{i}"})
                concurrent.append((time.perf_counter() - start) * 1000)
                assert r.status_code in (202, 429), r.text

        start = time.perf_counter()
        await asyncio.gather(*(one_client(c) for c in range(8)))
        wall = time.perf_counter() - start
    return {
        "seq_p50_ms": statistics.median(sequential),
        "seq_p95_ms": percentile(sequential, 95),
        "conc_p50_ms": statistics.median(concurrent),
        "conc_p95_ms": percentile(concurrent, 95),
        "conc_rps": len(concurrent) / wall,
    }


async def throughput(url: str, delay_s: float, total: int = 40, sessions: int = 20) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        ids = []
        for i in range(total):
            r = await client.post(f"/v1/sessions/tp-{i % sessions}/questions", json={"question": f"q{i}"})
            ids.append(r.json()["id"])
        # Poll the cheap session overviews, not every record, so the harness stays out of the way.
        while True:
            done = 0
            for s in range(sessions):
                counts = (await client.get(f"/v1/sessions/tp-{s}")).json()["counts"]
                done += counts["succeeded"] + counts["failed"] + counts["cancelled"]
            if done == total:
                break
            await asyncio.sleep(0.25)
        records = [(await client.get(f"/v1/questions/{rid}")).json() for rid in ids]
    # Wall time of the work itself: first admission to last finish, from the records' own timestamps.
    first = min(datetime.fromisoformat(r["created_at"].rstrip("Z")) for r in records)
    last = max(datetime.fromisoformat(r["finished_at"].rstrip("Z")) for r in records)
    wall = (last - first).total_seconds()
    queue_wait = [
        (
            datetime.fromisoformat(r["started_at"].rstrip("Z"))
            - datetime.fromisoformat(r["created_at"].rstrip("Z"))
        ).total_seconds()
        for r in records
    ]
    run_time = [
        (
            datetime.fromisoformat(r["finished_at"].rstrip("Z"))
            - datetime.fromisoformat(r["started_at"].rstrip("Z"))
        ).total_seconds()
        for r in records
    ]
    ideal = -(-total // 4) * delay_s
    return {
        "wall_s": wall,
        "ideal_s": ideal,
        "overhead_pct": (wall / ideal - 1) * 100,
        "run_p50_s": statistics.median(run_time),
        "queue_wait_max_s": max(queue_wait),
        "succeeded": float(sum(r["status"] == "succeeded" for r in records)),
    }


@asynccontextmanager
async def service_process(command: str, env: dict[str, str]) -> AsyncIterator[str]:
    """Run ``sidequest <command>`` as its own process, as deployed; yield its base URL once ready."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "service.cli",
        command,
        "--port",
        str(port),
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(base + "/readyz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)


async def main() -> None:
    server = await asyncio.to_thread(pg.find_server)
    try:
        # Each part gets its own database: admission leaves hundreds of queued requests behind.
        url = await pg.create_database(server.admin_url)
        try:
            async with service_process("api", {"SIDEQUEST_DATABASE_URL": url}) as base:
                result = await admission(base)
            print("admission (api process, no worker):", {k: round(v, 2) for k, v in result.items()})
        finally:
            await pg.drop_database(server.admin_url, url)

        url = await pg.create_database(server.admin_url)
        delay = 0.5
        try:
            with ScriptedServer() as model:
                model.set_default("answer", Step.text("ok", chunks=1).with_delay(before_s=delay))
                env = {
                    "SIDEQUEST_DATABASE_URL": url,
                    "SIDEQUEST_PROVIDER": "openai",
                    "SIDEQUEST_BASE_URL": model.base_url,
                    "SIDEQUEST_API_KEY": "x",
                    "SIDEQUEST_MODEL": "scripted-model",
                    "SIDEQUEST_MAX_CONCURRENCY": "4",
                }
                async with service_process("serve", env) as base:
                    result = await throughput(base, delay)
            print(
                f"throughput (serve, 4 slots, {delay}s per answer):",
                {k: round(v, 2) for k, v in result.items()},
            )
        finally:
            await pg.drop_database(server.admin_url, url)
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
