"""Shared harness of the benchmarks: a scratch database and ``sidequest serve`` in its own process.

Every benchmark runs the service as deployed — its own process, talking HTTP to the scripted
OpenAI-compatible model server of ``tests/`` — so the numbers include everything a client waits for.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import pg  # noqa: E402
from tests.net import free_port  # noqa: E402
from tests.scripted_provider import ScriptedServer  # noqa: E402


def parse_at(value: str) -> datetime:
    """An ISO 8601 UTC timestamp of a record or event (``…Z``)."""
    return datetime.fromisoformat(value.rstrip("Z"))


@dataclass
class Deployed:
    """A running ``sidequest serve`` (or ``api``) and its scripted model."""

    url: str
    pid: int
    scripted: ScriptedServer
    database_url: str


@asynccontextmanager
async def deployed(command: str = "serve", **env_overrides: str) -> AsyncIterator[Deployed]:
    """Start ``sidequest <command>`` on a fresh database with the scripted model; stop it after."""
    server_pg = await asyncio.to_thread(pg.find_server)
    url = await pg.create_database(server_pg.admin_url)
    proc: subprocess.Popen[bytes] | None = None
    try:
        with ScriptedServer() as scripted, tempfile.TemporaryDirectory() as tmp:
            port = free_port()
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SIDEQUEST_", "OPENAI_"))}
            env.update(
                SIDEQUEST_DATABASE_URL=url,
                SIDEQUEST_PROVIDER="openai",
                SIDEQUEST_BASE_URL=scripted.base_url,
                SIDEQUEST_API_KEY="sk-bench",
                SIDEQUEST_MODEL="scripted-model",
                NO_PROXY="127.0.0.1,localhost",
            )
            env.update(env_overrides)
            log = Path(tmp) / "serve.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(  # noqa: ASYNC220 (started once, before any measurement)
                    [sys.executable, "-m", "service.cli", command, "--port", str(port)],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            base = f"http://127.0.0.1:{port}"
            await _ready(base, log)
            yield Deployed(base, proc.pid, scripted, url)
    finally:
        _stop(proc)
        await pg.drop_database(server_pg.admin_url, url)
        server_pg.stop()


@asynccontextmanager
async def bare(script: str, scripted: ScriptedServer) -> AsyncIterator[str]:
    """Run ``benchmarks/<script>`` (a bare FastAPI + asyncpg floor) in its own process on a fresh
    database, its model ``scripted``; yield its base URL; stop it and drop the database after."""
    server_pg = await asyncio.to_thread(pg.find_server)
    url = await pg.create_database(server_pg.admin_url)
    proc: subprocess.Popen[bytes] | None = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            port = free_port()
            dsn = url.replace("postgresql+asyncpg://", "postgresql://", 1)
            log = Path(tmp) / "bare.log"
            with log.open("wb") as out:
                argv = [sys.executable, str(ROOT / "benchmarks" / script), "--port", str(port)]
                proc = subprocess.Popen(  # noqa: ASYNC220 (started once, before any measurement)
                    [*argv, "--dsn", dsn, "--model-url", scripted.base_url],
                    env={**os.environ, "NO_PROXY": "127.0.0.1,localhost"},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            base = f"http://127.0.0.1:{port}"
            await _ready(base, log)
            yield base
    finally:
        _stop(proc)
        await pg.drop_database(server_pg.admin_url, url)
        server_pg.stop()


async def _ready(base: str, log: Path) -> None:
    """Wait until ``base``'s /readyz answers 200 (at most a minute)."""
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        for _ in range(600):
            try:
                if (await client.get("/readyz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit(f"{base} did not start:\n{log.read_text()}")  # noqa: ASYNC240 (it gave up)


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


__all__ = ["Deployed", "bare", "deployed", "free_port", "parse_at", "percentile"]
