"""The floor for case 2 of ``bench_first_token.py``: a bare FastAPI + asyncpg app doing only what a
first question on a long inline snapshot must do, and nothing else.

What it does per question: parse the body, store the snapshot and the question durably (one
transaction, one commit, before the 202), then in a task of the same process: when the snapshot's
JSON is over the window (~4 bytes a token), summarise all but its last ~32 KB of messages in four
parallel streaming calls and merge their replies in a fifth, then stream the answer (the merged
summary, the recent messages verbatim, the question), handing each text delta to the request's SSE
stream through memory. What it leaves out is everything Sidequest adds to that: auth, events in
PostgreSQL, the queue and its leases, the job row and single flight, the ledger, the reply's
validation and retry, the cache, budgets, calibration, the shared-prefix reuse.

``bench_first_token.py`` runs it as its own process beside the service, with a scripted model of the
same delays, each run right after the service's; case 2's target is this app's time + 0.1 s:

    python benchmarks/bare_first_token.py --port 8124 --dsn postgresql://postgres@127.0.0.1/scratch \\
        --model-url http://127.0.0.1:PORT/v1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import httpx
from bare_app import run  # run as a script from benchmarks/, beside it
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

SCHEMA = """
CREATE TABLE IF NOT EXISTS bare_snapshots (id uuid PRIMARY KEY, content text NOT NULL);
CREATE TABLE IF NOT EXISTS bare_questions (
    id uuid PRIMARY KEY, parent_id text NOT NULL, question text NOT NULL, snapshot_id uuid
);
DO $$ BEGIN
    ALTER TABLE bare_snapshots ALTER COLUMN content SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN NULL;
END $$;
"""
WINDOW_BYTES = 64_000 * 4  # the bench's 64k-token window, at ~4 bytes a token
RECENT_BYTES = 32_000  # ~8000 tokens of recent messages kept verbatim
CHUNKS = 4
DONE = object()


async def _call(
    client: httpx.AsyncClient, purpose: str, messages: list[dict[str, Any]]
) -> AsyncIterator[str]:
    """One streaming Chat Completions call; yields the text of each content delta."""
    body = {"model": "scripted-model", "stream": True, "max_tokens": 2048, "messages": messages}
    headers = {"x-sidequest-purpose": purpose, "authorization": "Bearer bare"}
    async with client.stream("POST", "/chat/completions", json=body, headers=headers) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    yield text


async def _text(client: httpx.AsyncClient, purpose: str, messages: list[dict[str, Any]]) -> str:
    return "".join([piece async for piece in _call(client, purpose, messages)])


def _split(messages: list[Any]) -> tuple[list[list[Any]], list[Any]]:
    """(the old messages in CHUNKS parts of about equal size, the recent messages) by JSON bytes."""
    sizes = [len(json.dumps(m)) for m in messages]
    recent, kept = len(messages), 0
    while recent > 0 and kept + sizes[recent - 1] <= RECENT_BYTES:
        recent -= 1
        kept += sizes[recent]
    old, total = messages[:recent], sum(sizes[:recent])
    parts: list[list[Any]] = [[]]
    size = 0
    for message, n in zip(old, sizes, strict=False):
        if size >= total / CHUNKS * len(parts) and len(parts) < CHUNKS:
            parts.append([])
        parts[-1].append(message)
        size += n
    return parts, messages[recent:]


async def _answer(client: httpx.AsyncClient, body: dict[str, Any], out: asyncio.Queue[object]) -> None:
    try:
        snapshot = body.get("snapshot") or {}
        messages = list(snapshot.get("messages") or [])
        context: list[dict[str, Any]] = messages
        if len(json.dumps(messages)) > WINDOW_BYTES:
            parts, recent = _split(messages)
            summaries = await asyncio.gather(
                *(
                    _text(client, "context_summary", [{"role": "user", "content": json.dumps(part)}])
                    for part in parts
                )
            )
            merged = await _text(
                client, "context_summary", [{"role": "user", "content": "\n".join(summaries)}]
            )
            context = [{"role": "user", "content": f"Summary of earlier context:\n{merged}"}, *recent]
        prompt = [*context, {"role": "user", "content": str(body.get("question"))}]
        async for text in _call(client, "answer", prompt):
            await out.put(text)
    finally:
        await out.put(DONE)


def create_app(dsn: str, model_url: str) -> FastAPI:
    streams: dict[str, asyncio.Queue[object]] = {}
    tasks: set[asyncio.Task[None]] = set()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = await asyncpg.create_pool(dsn, min_size=4, max_size=10)
        async with pool.acquire() as conn:
            await conn.execute(SCHEMA)
        app.state.pool = pool
        async with httpx.AsyncClient(base_url=model_url, timeout=60) as client:
            app.state.client = client
            try:
                yield
            finally:
                await pool.close()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/sessions/{parent_id}/questions", status_code=202)
    async def post_question(request: Request, parent_id: str) -> JSONResponse:
        raw = await request.body()
        body = json.loads(raw)
        question_id, snapshot_id = uuid.uuid4(), None
        async with request.app.state.pool.acquire() as conn, conn.transaction():
            if body.get("snapshot") is not None:
                snapshot_id = uuid.uuid4()
                await conn.execute(
                    "INSERT INTO bare_snapshots (id, content) VALUES ($1, $2)",
                    snapshot_id,
                    raw.decode(),  # the body as sent: the least that keeps the snapshot
                )
            await conn.execute(
                "INSERT INTO bare_questions (id, parent_id, question, snapshot_id) VALUES ($1, $2, $3, $4)",
                question_id,
                parent_id,
                body["question"],
                snapshot_id,
            )
        out: asyncio.Queue[object] = asyncio.Queue()
        streams[str(question_id)] = out
        task = asyncio.create_task(_answer(request.app.state.client, body, out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return JSONResponse({"id": str(question_id), "status": "queued"}, status_code=202)

    @app.get("/v1/questions/{question_id}/events")
    async def events(question_id: str) -> StreamingResponse:
        out = streams.pop(question_id)

        async def sse() -> AsyncIterator[bytes]:
            while (item := await out.get()) is not DONE:
                yield f"event: delta\ndata: {json.dumps({'text': item})}\n\n".encode()
            yield b'event: done\ndata: {"status": "succeeded"}\n\n'

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--model-url", required=True)
    args = parser.parse_args()
    run(create_app(args.dsn, args.model_url), args.port)


if __name__ == "__main__":
    main()
