"""A notification is only a hint (SPEC 9.1), against the real PostgreSQL.

- The LISTEN connection is terminated (``pg_terminate_backend``) and kept from reconnecting while a
  question is admitted: its NOTIFYs reach nobody. Once the listener is back, every waiter re-reads at
  once — the worker claims the question, the open session stream delivers it — long before any poll
  would have (the polls are set to 30 s here).
- Every notification is lost (the listener delivers none): claims, streams and cancels still
  complete, by their bounded polls alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest

from service.client.sse import SseMessage
from service.config import Settings
from service.serve import create_serving_app
from service.store.db import Database, plain_dsn
from service.store.listener import Listener
from tests.api.conftest import serve
from tests.api.sse_client import events
from tests.pg import with_hosts
from tests.scripted_provider import ScriptedServer, Step, Usage

SNAPSHOT = {"messages": [{"role": "user", "content": "Rename the loader."}]}


class TcpProxy:
    """A loopback TCP proxy to PostgreSQL that can refuse new connections (``refusing``)."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.refusing = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        for task in (
            asyncio.create_task(pipe(reader, up_writer)),
            asyncio.create_task(pipe(up_reader, writer)),
        ):
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)


async def _status(client: httpx.AsyncClient, request_id: str) -> str:
    response = await client.get(f"/v1/questions/{request_id}")
    assert response.status_code == 200, response.text
    status: str = response.json()["status"]
    return status


async def _until(check: Callable[[], Awaitable[bool]], within_s: float, what: str) -> float:
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < within_s, f"{what}: not within {within_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@contextlib.asynccontextmanager
async def _session_stream(client: httpx.AsyncClient, parent: str) -> AsyncIterator[list[SseMessage]]:
    got: list[SseMessage] = []

    async def follow() -> None:
        async with client.stream("GET", f"/v1/sessions/{parent}/events") as response:
            assert response.status_code == 200
            async for message in events(response):
                got.append(message)

    task = asyncio.create_task(follow())
    try:
        yield got
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_every_waiter_re_reads_after_the_listen_connection_is_terminated(
    settings: Settings, db: Database
) -> None:
    url = settings.database_url or ""
    parts = urlsplit(plain_dsn(url))
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432) as proxy:
        # Polls far longer than the test: only a notification or the reconnect's re-read can wake.
        chosen = settings.model_copy(
            update={"listen_database_url": with_hosts(url, f"127.0.0.1:{proxy.port}"), "poll_s": 30.0}
        )
        app = create_serving_app(chosen, url)
        app.state.hub.poll_s = 30.0
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
            listener: Listener = app.state.listener
            first = (await client.post("/v1/sessions/p-listen/questions", json={"question": "one?"})).json()
            async with _session_stream(client, "p-listen") as stream:
                await _until(lambda: _done(client, first["id"]), 10, "the first answer (notified)")
                await _until(lambda: _streamed_done(stream, first["id"]), 5, "the session stream")
                assert listener.connects == 1

                proxy.refusing = True
                admin = await asyncpg.connect(plain_dsn(url))
                try:
                    await admin.execute("SELECT pg_terminate_backend($1)", listener.backend_pid)
                finally:
                    await admin.close()
                await _until(lambda: _false(listener.backend_pid is not None), 5, "the listener noticing")

                second = (
                    await client.post("/v1/sessions/p-listen/questions", json={"question": "two?"})
                ).json()
                await asyncio.sleep(1.5)
                # Its NOTIFYs reached nobody, and nothing polls this soon: it waits.
                assert await _status(client, second["id"]) == "queued"
                assert not any(m.data and second["id"] in m.data for m in stream)

                proxy.refusing = False
                waited = await _until(lambda: _done(client, second["id"]), 10, "the second answer")
                assert listener.connects == 2
                # The listener's backoff (≤ 1.6 s after 1.5 s of refusals) plus the answer itself.
                assert waited < 8
                await _until(lambda: _streamed_done(stream, second["id"]), 5, "the session stream")


async def _done(client: httpx.AsyncClient, request_id: str) -> bool:
    return await _status(client, request_id) == "succeeded"


async def _false(value: bool) -> bool:
    return not value


async def _streamed_done(stream: list[SseMessage], request_id: str) -> bool:
    return any(m.event == "done" and m.data is not None and request_id in m.data for m in stream)


@pytest.fixture
def deaf_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every notification is lost: the listener delivers only its own reconnect wake-ups."""
    original = Listener._dispatch

    def dispatch(self: Listener, conn: object, pid: int, channel: str, payload: str) -> None:
        if payload == "":
            original(self, conn, pid, channel, payload)

    monkeypatch.setattr(Listener, "_dispatch", dispatch)


async def test_claims_streams_and_cancels_complete_by_polling_when_every_notification_is_lost(
    settings: Settings, db: Database, deaf_listener: None
) -> None:
    with ScriptedServer() as model:
        model.set_default(
            "answer", Step.text("a b c d", chunks=4, usage=Usage(20, 4)).with_delay(between_s=0.1)
        )
        chosen = settings.model_copy(
            update={
                "provider": "openai",
                "base_url": model.base_url,
                "api_key": "x",
                "model": "scripted-model",
                "poll_s": 0.5,
            }
        )
        app = create_serving_app(chosen, chosen.database_url or "")
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
            admitted = (
                await client.post(
                    "/v1/sessions/p-deaf/questions", json={"question": "q?", "snapshot": SNAPSHOT}
                )
            ).json()
            got: list[SseMessage] = []
            async with (
                asyncio.timeout(20),
                client.stream("GET", f"/v1/questions/{admitted['id']}/events") as r,
            ):
                async for message in events(r):
                    got.append(message)
            assert got[-1].event == "done"
            seqs = [int(m.id or 0) for m in got]
            assert seqs == list(range(1, len(seqs) + 1))

            model.set_default("answer", Step.hang(text="thinking"))
            slow = (await client.post("/v1/sessions/p-deaf/questions", json={"question": "slow?"})).json()
            await _until(lambda: _running(client, slow["id"]), 10, "the slow question running")
            cancelled = await client.post(f"/v1/questions/{slow['id']}/cancel")
            assert cancelled.status_code == 200
            # The worker's liveness check (every second at most) stops it, with no NOTIFY.
            worker = app.state.worker
            await _until(
                lambda: _false(bool(worker.requests.tasks)), 5, "the worker stopping the cancelled run"
            )


async def _running(client: httpx.AsyncClient, request_id: str) -> bool:
    return await _status(client, request_id) == "running"
