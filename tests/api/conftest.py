"""A real uvicorn server per test (SSE needs real sockets: httpx's ASGITransport buffers bodies)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from service.api.app import create_app
from service.api.event_hub import EventHub
from service.config import Settings
from service.store.db import Database


@dataclass
class Server:
    """A running API: its base URL and app (for app.state in tests)."""

    url: str
    app: FastAPI

    def client(self, token: str | None = None, **kwargs: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10, **kwargs)


@asynccontextmanager
async def serve(app: FastAPI, *, access_log: bool = False) -> AsyncIterator[str]:
    """Run ``app`` under uvicorn on a free 127.0.0.1 port; stop it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # log_config=None: keep the test's logging setup (uvicorn's dictConfig would replace handlers).
    config = uvicorn.Config(
        app,
        log_level="info" if access_log else "warning",
        log_config=None,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    # No signal handlers: sse-starlette finds "the" uvicorn server through the SIGTERM handler and
    # ends every stream of the thread when that server exits; with several servers in one test
    # process a stopped one would otherwise end the streams of the others.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(500):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        if task.done():
            task.result()
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


StartServer = Callable[..., Awaitable[Server]]


@pytest.fixture
async def start_server(db: Database, settings: Settings) -> AsyncIterator[StartServer]:
    """Start servers with settings overrides (on the empty test database); all stop at teardown."""
    stack: list[Any] = []

    async def start(ping_s: float | None = None, access_log: bool = False, **overrides: Any) -> Server:
        chosen = settings.model_copy(update=overrides)
        app = create_app(chosen, settings.database_url or "")
        if ping_s is not None:
            hub: EventHub = app.state.hub
            hub.ping_s = ping_s
        context = serve(app, access_log=access_log)
        url = await context.__aenter__()
        stack.append(context)
        return Server(url=url, app=app)

    try:
        yield start
    finally:
        for context in reversed(stack):
            await context.__aexit__(None, None, None)


TOKENS = "acme:tok-acme,globex:tok-globex"


@pytest.fixture(scope="session")
async def _shared_servers(database_url: str) -> AsyncIterator[dict[str, Server]]:
    """Two long-lived servers (no auth; two tenants), reused by tests that need nothing special.

    Their state lives in PostgreSQL, which the ``db`` fixture empties before every test, so sharing
    them only saves the start-up time.
    """
    base = Settings(database_url=database_url, provider="offline", lease_s=3.0, heartbeat_s=0.5, poll_s=0.2)
    servers: dict[str, Server] = {}
    contexts = []
    for name, overrides in (("open", {}), ("auth", {"api_tokens": TOKENS})):
        app = create_app(base.model_copy(update=overrides), database_url)
        context = serve(app)
        servers[name] = Server(url=await context.__aenter__(), app=app)
        contexts.append(context)
    try:
        yield servers
    finally:
        for context in reversed(contexts):
            await context.__aexit__(None, None, None)


@pytest.fixture
async def server(_shared_servers: dict[str, Server], db: Database) -> Server:
    """A server without auth (tenant "default")."""
    return _shared_servers["open"]


@pytest.fixture
async def auth_server(_shared_servers: dict[str, Server], db: Database) -> Server:
    """A server with two tenants: acme (tok-acme) and globex (tok-globex)."""
    return _shared_servers["auth"]
