"""A real browser (Debian's headless chromium): EventSource through a connection dropped mid-answer.

The page is served from another origin (CORS), opens the stream with a stream token (an EventSource
cannot send Authorization), and reports every event it sees back to the page server. Between the
browser and the API sits a TCP proxy the test controls: mid-answer it cuts every connection, the
browser reconnects by itself with ``Last-Event-ID`` on the same URL, and must end up with every
event exactly once. After the terminal event the server closes the stream; the browser reconnects
once more, gets 204, and stops (readyState CLOSED).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from service.store.db import Database
from tests.api.conftest import TOKENS, StartServer, serve
from tests.api.helpers import append, ask, finish, mark_running

PAGE = """<!doctype html>
<html><body><pre id="log"></pre><script>
const stream = new URLSearchParams(location.search).get("stream");
// One report at a time: parallel fetches may reach the page server in any order, and the test
// reads the order in which the browser saw the events.
let reported = Promise.resolve();
function report(body) {
  const text = JSON.stringify(body);
  reported = reported.then(() => fetch("/report", {method: "POST", body: text}).catch(() => {}));
}
const source = new EventSource(stream);
for (const type of ["status", "progress", "delta", "usage", "done", "error"]) {
  source.addEventListener(type, (e) => {
    if (type === "error" && !(e instanceof MessageEvent)) return;  // a transport error, see onerror
    report({kind: "event", type: type, id: e.lastEventId, data: e.data ? JSON.parse(e.data) : null});
  });
}
source.onopen = () => report({kind: "open"});
source.onerror = () => report({kind: "transport_error", readyState: source.readyState});
</script></body></html>
"""


class Proxy:
    """A TCP proxy that can cut every open connection, and remembers each request's head."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.heads: list[str] = []
        self._pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.drop_all()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def drop_all(self) -> None:
        for client, upstream in self._pairs:
            for writer in (client, upstream):
                transport = writer.transport
                transport.abort()  # an abrupt cut, like a network failure
        self._pairs.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._pairs.append((writer, up_writer))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, record: bool) -> None:
            try:
                while data := await src.read(65536):
                    if record and data[:4] in (b"GET ", b"POST", b"OPTI"):  # a request head (keep-alive too)
                        self.heads.append(data.decode("latin-1"))
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))


@asynccontextmanager
async def page_server() -> AsyncIterator[tuple[str, asyncio.Queue[dict[str, Any]]]]:
    """Serves the page and collects the browser's reports."""
    reports: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def page(_request: Request) -> Response:
        return HTMLResponse(PAGE)

    async def report(request: Request) -> Response:
        reports.put_nowait(json.loads(await request.body()))
        return Response(status_code=204)

    async def favicon(_request: Request) -> Response:
        return Response(status_code=404)

    app = Starlette(
        routes=[
            Route("/page.html", page),
            Route("/report", report, methods=["POST"]),
            Route("/favicon.ico", favicon),
        ]
    )
    async with serve(app) as url:  # type: ignore[arg-type]
        yield url, reports


async def _next(reports: asyncio.Queue[dict[str, Any]], kind: str, within: float = 20) -> dict[str, Any]:
    async with asyncio.timeout(within):
        while True:
            item = await reports.get()
            if item["kind"] == kind:
                return item


async def test_browser_event_source_resumes_through_a_dropped_connection(
    start_server: StartServer, db: Database
) -> None:
    chromium = shutil.which("chromium")
    assert chromium is not None, "apt-get install -y chromium"
    async with page_server() as (page_url, reports):
        api = await start_server(api_tokens=TOKENS, cors_origins=page_url)
        proxy = Proxy(int(api.url.rsplit(":", 1)[1]))
        await proxy.start()
        profile = tempfile.mkdtemp(prefix="sidequest-chromium-")
        browser: asyncio.subprocess.Process | None = None
        try:
            async with api.client("tok-acme") as client:
                rid = (await ask(client, "p-browser", "Which file?"))["id"]
                token = (await client.post(f"/v1/questions/{rid}/stream-token")).json()
            stream_url = f"http://127.0.0.1:{proxy.port}/v1/questions/{rid}/events?token={token['token']}"
            await mark_running(db, rid, "answering")
            await append(db, rid, "delta", {"text": "It is "})
            browser = await asyncio.create_subprocess_exec(
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                f"{page_url}/page.html?stream={stream_url.replace('&', '%26').replace('?', '%3F')}",
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            events: list[dict[str, Any]] = []
            await _next(reports, "open", within=60)
            async with asyncio.timeout(30):
                while len(events) < 3:  # queued, running, first delta
                    item = await reports.get()
                    if item["kind"] == "event":
                        events.append(item)
            # Mid-answer: the network drops; more of the answer is written meanwhile.
            proxy.drop_all()
            await _next(reports, "transport_error")
            for part in ("editing ", "billing/", "invoice.py"):
                await append(db, rid, "delta", {"text": part})
            await _next(reports, "open")  # the browser reconnected by itself
            await finish(db, rid, answer="It is editing billing/invoice.py")
            async with asyncio.timeout(30):
                while True:
                    item = await reports.get()
                    if item["kind"] == "event":
                        events.append(item)
                    if item["kind"] == "transport_error" and item["readyState"] == 2:
                        break  # CLOSED: the 204 told it to stop
        finally:
            if browser is not None:
                browser.kill()
                await asyncio.wait_for(browser.wait(), 10)
            await proxy.stop()
            shutil.rmtree(profile, ignore_errors=True)

    ids = [int(e["id"]) for e in events]
    assert ids == list(range(1, 9)), ids  # every event exactly once, in order
    assert [e["type"] for e in events] == ["status", "status", *["delta"] * 4, "status", "done"]
    text = "".join(e["data"]["text"] for e in events if e["type"] == "delta")
    assert text == "It is editing billing/invoice.py"
    assert events[-1]["data"]["record"]["status"] == "succeeded"
    requests = [head for head in proxy.heads if head.startswith("GET /v1/questions/")]
    assert len(requests) >= 3  # first open, reconnect after the drop, the final 204
    assert "last-event-id: 3" in requests[1].lower()
    assert "last-event-id: 8" in requests[-1].lower()
