"""The shared services of the contract tests (SPEC.md, checked from the outside the way a client would).

Two real ``python -m service.cli serve`` processes (one without auth, one with two tenants) run for the
whole package (package-scoped fixtures: started once for every section file, stopped before the rest of
the suite runs) against the test run's database, with the OpenAI-compatible provider pointed at one
scripted model server; every test talks to them over HTTP (httpx) or through the CLI only. Both
processes run a worker, so any of them may run any request (SPEC §9: workers share nothing but
PostgreSQL); the scripted server hands out its steps per purpose, first in first out, so every test
lets its own requests finish (or cancels them) before it ends.

A third process (``limited``: Anthropic provider, short deadline, one summary call, CORS, short leases)
has its own database and scripted server, for the settings that would disturb the others; the crash
test (test_concurrency.py) kills it and brings up ``sidequest api`` + ``sidequest worker`` with the same
settings instead, so the ``limited`` tests in files after it run against those two.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.contract.helpers import (
    TOKENS,
    Isolated,
    Limited,
    Service,
    _empty_tables,
    _environment,
    _isolated,
    _start,
    _stop,
    _tenant_client,
    _wait_ready,
    limited_env,
)
from tests.scripted_provider import ScriptedServer


@pytest.fixture(scope="package")
def scripted() -> Iterator[ScriptedServer]:
    with ScriptedServer() as server:
        yield server


@pytest.fixture(scope="package")
def services(
    database_url: str,
    scripted: ScriptedServer,
    _limited_box: Isolated,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Service]]:
    """``open`` (no auth, tenant default) and ``auth`` (tenants acme and globex), both ready; and the
    ``limited`` service of the isolated tests below, started at the same time to save a start-up."""
    asyncio.run(_empty_tables(database_url))
    folder = tmp_path_factory.mktemp("contract")
    started: dict[str, Service] = {}
    try:
        started["open"] = _start(_environment(database_url, scripted), folder / "open.log")
        started["auth"] = _start(
            _environment(database_url, scripted, SIDEQUEST_API_TOKENS=TOKENS), folder / "auth.log"
        )
        started["limited"] = _limited_box.launch(**limited_env(_limited_box.scripted))
        for service in started.values():
            _wait_ready(service)
        yield started
    finally:
        for service in started.values():
            if service.proc.poll() is None:
                service.proc.send_signal(signal.SIGTERM)
        for service in started.values():
            _stop(service)


@pytest.fixture(autouse=True)
def _fresh_script(scripted: ScriptedServer) -> None:
    """Each test scripts its own steps and counts its own provider calls."""
    scripted.reset()


@pytest.fixture
async def client(services: dict[str, Service]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=services["open"].url, timeout=10) as http:
        yield http


@pytest.fixture
async def acme(services: dict[str, Service]) -> AsyncIterator[httpx.AsyncClient]:
    async with _tenant_client(services, "tok-a") as http:
        yield http


@pytest.fixture
async def globex(services: dict[str, Service]) -> AsyncIterator[httpx.AsyncClient]:
    async with _tenant_client(services, "tok-g") as http:
        yield http


@pytest.fixture(scope="package")
def _limited_box(pg_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Isolated]:
    with _isolated(pg_server.admin_url, tmp_path_factory.mktemp("limited")) as box:
        yield box


@pytest.fixture(scope="package")
def _limited_service(services: dict[str, Service], _limited_box: Isolated) -> Limited:
    return Limited(_limited_box, services["limited"])


@pytest.fixture
def limited(_limited_service: Limited) -> Limited:
    _limited_service.scripted.reset()
    return _limited_service
