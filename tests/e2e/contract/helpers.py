"""Shared pieces of the contract tests (SPEC.md checked from the outside): constants, the service
processes, and the request / stream helpers every section file uses."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import asyncpg
import httpx

from service.client.sse import SseMessage
from service.store.models import Base
from tests.api.sse_client import messages
from tests.net import free_port
from tests.scripted_provider import ScriptedServer, Step

READY_WITHIN_S = 30.0
TOKENS = "acme:tok-a,globex:tok-g"
TERMINAL = ("succeeded", "failed", "cancelled")


# Every table of the schema (the models are the one list), emptied between tests.
TABLES = tuple(table.name for table in Base.metadata.sorted_tables)


ISO_UTC_MICROS = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}(Z|\+00:00)$")

SNAPSHOT: dict[str, Any] = {
    "taken_at": "2026-11-29T10:00:00Z",
    "system": "You are a coding agent working on the billing service.",
    "tools": [{"name": "grep", "description": "Search files.", "input_schema": {"type": "object"}}],
    "messages": [
        {"role": "user", "content": "Fix the rounding bug in invoices."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me search for it."},
                {"type": "tool_use", "id": "t1", "name": "grep", "input": {"pattern": "round("}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "billing/invoice.py:12"}],
        },
        {"role": "assistant", "content": "The bug is in billing/invoice.py line 12; editing it now."},
    ],
    "context_window": 200000,
    "max_output_tokens": 32000,
}


@dataclass
class Service:
    """One ``sidequest serve`` process."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path


async def _empty_tables(database_url: str) -> None:
    """Start from empty tables: requests left queued by earlier modules would otherwise be run by
    these workers and consume the scripted steps (the ``db`` fixture empties them per test too)."""
    conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        await conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")
    finally:
        await conn.close()


def _environment(database_url: str, scripted: ScriptedServer, **extra: str) -> dict[str, str]:
    prefixes = ("SIDEQUEST_", "OPENAI_", "ANTHROPIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(
        SIDEQUEST_DATABASE_URL=database_url,
        SIDEQUEST_PROVIDER="openai",
        SIDEQUEST_BASE_URL=scripted.base_url,
        SIDEQUEST_API_KEY="sk-scripted",
        SIDEQUEST_MODEL="scripted-model",
        SIDEQUEST_LEASE_S="3",
        SIDEQUEST_HEARTBEAT_S="0.5",
        SIDEQUEST_POLL_S="0.2",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    env.update(extra)
    return env


def _start(env: dict[str, str], log: Path, command: str = "serve") -> Service:
    """Start ``sidequest <command>`` (serve, api: on a free port; worker: no port)."""
    port = free_port()
    args = ["--port", str(port)] if command in ("serve", "api") else []
    # A file, not a pipe: nobody reads a pipe while the server runs, and a full one would block it.
    out: IO[bytes] = log.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", command, *args],
        env=env,
        cwd=log.parent,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    out.close()
    return Service(f"http://127.0.0.1:{port}", proc, log)


def _wait_ready(service: Service) -> None:
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise AssertionError(f"serve exited with {service.proc.returncode}:\n{service.log.read_text()}")
        try:
            if httpx.get(service.url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"/readyz not 200 within {READY_WITHIN_S} s:\n{service.log.read_text()}")


def _stop(service: Service) -> None:
    if service.proc.poll() is None:
        service.proc.send_signal(signal.SIGTERM)
        try:
            service.proc.wait(20)
        except subprocess.TimeoutExpired:
            service.proc.kill()
            service.proc.wait(10)


def _tenant_client(services: dict[str, Service], token: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=services["auth"].url, headers=headers, timeout=10)


def new_parent() -> str:
    """A parent id no other test (or earlier run on this database) uses."""
    return f"e2e-{uuid.uuid4().hex[:12]}"


async def ask(
    http: httpx.AsyncClient, parent: str, question: str = "What is the agent doing?", **body: Any
) -> dict[str, Any]:
    response = await http.post(f"/v1/sessions/{parent}/questions", json={"question": question, **body})
    assert response.status_code == 202, response.text
    record: dict[str, Any] = response.json()
    return record


async def wait_for(
    http: httpx.AsyncClient, request_id: str, statuses: tuple[str, ...] = TERMINAL, within_s: float = 15.0
) -> dict[str, Any]:
    """Poll the record until its status is one of ``statuses``."""
    deadline = time.monotonic() + within_s
    while True:
        response = await http.get(f"/v1/questions/{request_id}")
        assert response.status_code == 200, response.text
        record: dict[str, Any] = response.json()
        if record["status"] in statuses:
            return record
        if time.monotonic() > deadline:
            raise AssertionError(f"{request_id} still {record['status']} after {within_s} s")
        await asyncio.sleep(0.05)


async def read_stream(
    http: httpx.AsyncClient,
    path: str,
    *,
    headers: Mapping[str, str] | None = None,
    params: Mapping[str, Any] | None = None,
    within_s: float = 15.0,
) -> tuple[int, list[SseMessage]]:
    """Status and every message (retry hint and comments included) of a stream that ends by itself."""
    async with asyncio.timeout(within_s):
        async with http.stream("GET", path, headers=headers, params=params) as response:
            if response.status_code != 200:
                await response.aread()
                return response.status_code, []
            return 200, [m async for m in messages(response)]


def events_of(stream: list[SseMessage]) -> list[SseMessage]:
    return [m for m in stream if m.event is not None]


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The response is ``status`` with SPEC's error envelope (and ``code``, when given)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert {"code", "message", "detail"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["detail"], dict)
    if code is not None:
        assert error["code"] == code, error
    return error


def parse_utc(value: str) -> datetime:
    assert ISO_UTC_MICROS.match(value), value
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


async def hang_and_wait_running(
    http: httpx.AsyncClient, scripted: ScriptedServer, parent: str, **body: Any
) -> dict[str, Any]:
    """A request whose answer call never returns, once it runs (cancel or clear it afterwards)."""
    scripted.script("answer", Step.hang())
    record = await ask(http, parent, "This one hangs.", **body)
    running = await wait_for(http, record["id"], ("running", *TERMINAL))
    assert running["status"] == "running", running
    deadline = time.monotonic() + 10
    while not any(r.request_id == record["id"] for r in scripted.requests("answer")):
        assert time.monotonic() < deadline, "the hanging answer call never reached the provider"
        await asyncio.sleep(0.02)
    return running


def _long_transcript(turns: int) -> list[dict[str, Any]]:
    """A main transcript of ``turns`` user/assistant pairs, each a few hundred tokens."""
    out: list[dict[str, Any]] = []
    for n in range(turns):
        out.append({"role": "user", "content": f"Step {n}: " + "please look at the billing module. " * 20})
        out.append({"role": "assistant", "content": f"Done with step {n}. " + "Edited invoice totals. " * 20})
    return out


# Settings that would disturb the shared services (a short deadline, a summary-call cap, another
# provider, a killed process) get their own database, scripted server and process, so that no other
# worker claims their requests.
@dataclass
class Isolated:
    """A fresh database and scripted server; ``start`` runs ``sidequest serve`` on them."""

    database_url: str
    scripted: ScriptedServer
    folder: Path
    started: list[Service]

    def launch(self, command: str = "serve", **env: str) -> Service:
        """Start ``sidequest <command>`` without waiting for it."""
        log = self.folder / f"isolated-{len(self.started)}-{command}.log"
        service = _start(_environment(self.database_url, self.scripted, **env), log, command)
        self.started.append(service)
        return service

    def start(self, command: str = "serve", **env: str) -> Service:
        """Start ``sidequest <command>`` and wait until it is ready (a worker has no /readyz)."""
        service = self.launch(command, **env)
        if command != "worker":
            _wait_ready(service)
        return service


@contextmanager
def _isolated(admin_url: str, folder: Path) -> Iterator[Isolated]:
    from tests import pg

    url = asyncio.run(pg.create_database(admin_url))  # empty: serve migrates it itself
    try:
        with ScriptedServer() as server:
            box = Isolated(url, server, folder, [])
            try:
                yield box
            finally:
                for service in box.started:
                    _stop(service)
    finally:
        asyncio.run(pg.drop_database(admin_url, url))


@dataclass
class Limited:
    """One process with the Anthropic provider, a 1.5 s deadline, one summary call per request, CORS
    for two origins and 1 s leases (the crash test replaces the process by a new one)."""

    box: Isolated
    service: Service

    @property
    def scripted(self) -> ScriptedServer:
        return self.box.scripted

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.service.url, timeout=10)


def limited_env(scripted: ScriptedServer) -> dict[str, str]:
    return {
        "SIDEQUEST_PROVIDER": "anthropic",
        "SIDEQUEST_BASE_URL": scripted.root_url,
        "SIDEQUEST_REQUEST_TIMEOUT_S": "1.5",
        "SIDEQUEST_MAX_SUMMARY_CALLS": "1",
        "SIDEQUEST_CORS_ORIGINS": "https://app.example,https://other.example",
        # Short leases, so that a killed process's request is taken over within a second.
        "SIDEQUEST_LEASE_S": "1",
        "SIDEQUEST_HEARTBEAT_S": "0.2",
    }
