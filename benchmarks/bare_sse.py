"""The floor for the SSE fan-out benchmark: a bare app fanning out the same events to every subscriber.

Same server as Sidequest's API (uvicorn with what ``loop="auto"`` / ``http="auto"`` pick: uvloop and
httptools when installed), Starlette's own ``StreamingResponse``, the same wire (``id:``, ``event:``,
``data:`` JSON with ``at``, CRLF separators) and the same routes the harness uses, but nothing else:
no database, no NOTIFY, no auth, no middleware, no sse-starlette. One publisher task stamps each
event's ``at`` and appends it to every subscriber's pending list; each subscriber writes what is
pending in one send. ``benchmarks/bench_sse.py --bare`` runs it as its own process and drives it
with the same client processes, so the ratio of the service's delay to this one is what the
service adds over fanning out on this machine:

    python benchmarks/bare_sse.py --port 8124 [--chunks 100] [--rate 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from service.vocabulary import utc_iso


def _wire(seq: int, kind: str, data: dict[str, object]) -> bytes:
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"id: {seq}\r\nevent: {kind}\r\ndata: {body}\r\n\r\n".encode()


class Inbox:
    """One subscriber's pending events (never blocks the publisher)."""

    __slots__ = ("closed", "pending", "wake")

    def __init__(self, first: bytes) -> None:
        self.pending = [first]
        self.wake = asyncio.Event()
        self.wake.set()
        self.closed = False


class Stream:
    """One request's events: the replayed ``queued`` status, then the answer once started."""

    def __init__(self, request_id: str, chunks: int, rate: float) -> None:
        self.request_id = request_id
        self.chunks = chunks
        self.rate = rate
        self.inboxes: set[Inbox] = set()
        self.queued = _wire(1, "status", self._data(1, status="queued"))
        self.started = False

    def _data(self, seq: int, **fields: object) -> dict[str, object]:
        return {"request_id": self.request_id, "ordinal": 1, "seq": seq, "at": utc_iso(), **fields}

    def _publish(self, wire: bytes, *, last: bool = False) -> None:
        for inbox in self.inboxes:
            inbox.pending.append(wire)
            inbox.closed = last
            inbox.wake.set()

    async def run(self) -> None:
        """The answer: ``chunks`` ``delta`` events at ``rate`` per second, then ``done``."""
        seq = 1
        for index in range(self.chunks):
            await asyncio.sleep(1.0 / self.rate)
            seq += 1
            self._publish(_wire(seq, "delta", self._data(seq, text=f"w{index} ")))
        seq += 1
        self._publish(_wire(seq, "done", self._data(seq, status="succeeded")), last=True)

    async def events(self) -> AsyncIterator[bytes]:
        inbox = Inbox(self.queued)
        self.inboxes.add(inbox)
        try:
            while True:
                await inbox.wake.wait()
                inbox.wake.clear()
                batch, inbox.pending = inbox.pending, []
                if batch:
                    yield b"".join(batch)
                if inbox.closed:
                    return
        finally:
            self.inboxes.discard(inbox)


def create_app(chunks: int, rate: float) -> Starlette:
    streams: dict[str, Stream] = {}
    running: set[asyncio.Task[None]] = set()

    async def post_question(request: Request) -> JSONResponse:
        request_id = str(uuid.uuid4())
        streams[request_id] = Stream(request_id, chunks, rate)
        return JSONResponse({"id": request_id, "status": "queued"}, status_code=202)

    async def start(request: Request) -> Response:
        stream = streams[request.path_params["request_id"]]
        if not stream.started:
            stream.started = True
            task = asyncio.create_task(stream.run())
            running.add(task)
            task.add_done_callback(running.discard)
        return Response(status_code=204)

    async def events(request: Request) -> StreamingResponse:
        stream = streams[request.path_params["request_id"]]
        return StreamingResponse(
            stream.events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
        )

    async def readyz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/v1/sessions/{parent_id}/questions", post_question, methods=["POST"]),
            Route("/v1/questions/{request_id}/start", start, methods=["POST"]),
            Route("/v1/questions/{request_id}/events", events),
            Route("/readyz", readyz),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--rate", type=float, default=20.0)
    args = parser.parse_args()
    # The same uvicorn settings as `sidequest api` (service/cli.py).
    uvicorn.run(create_app(args.chunks, args.rate), host="127.0.0.1", port=args.port, access_log=False)


if __name__ == "__main__":
    main()
