"""The floor for admission benchmarks: a bare FastAPI + asyncpg app doing one INSERT per POST.

Same framework, server and driver as Sidequest (FastAPI on uvicorn, asyncpg, a pool of 10), the same
route shape and a pydantic body, but nothing else: no auth, no ORM, no events, no NOTIFY, no limits.
``benchmarks/bench_admission.py`` runs it as its own process beside the service:

    python benchmarks/bare_app.py --port 8123 --dsn postgresql://postgres@127.0.0.1/scratch
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

SCHEMA = """
CREATE TABLE IF NOT EXISTS bare_questions (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    parent_id text NOT NULL,
    question text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""
INSERT = "INSERT INTO bare_questions (parent_id, question) VALUES ($1, $2) RETURNING id, created_at"


class QuestionIn(BaseModel):
    question: str = Field(min_length=1)


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Nothing to reset: the app runs one INSERT per connection use."""


def create_app(dsn: str, pool_size: int = 10) -> FastAPI:
    """The bare app on ``dsn`` (a plain ``postgresql://`` DSN)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # No reset query on release, like Sidequest's own pool (service/store/db.py): a floor pays
        # for the INSERT and nothing else.
        pool = await asyncpg.create_pool(dsn, min_size=pool_size, max_size=pool_size, reset=_keep_session)
        async with pool.acquire() as conn:
            await conn.execute(SCHEMA)
        app.state.pool = pool
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/sessions/{parent_id}/questions", status_code=202)
    async def post_question(request: Request, parent_id: str, body: QuestionIn) -> JSONResponse:
        pool: Any = request.app.state.pool
        async with pool.acquire() as conn:
            row = await conn.fetchrow(INSERT, parent_id, body.question)
        record = {
            "id": str(row["id"]),
            "parent_id": parent_id,
            "question": body.question,
            "status": "queued",
            "created_at": row["created_at"].isoformat(),
        }
        return JSONResponse(record, status_code=202)

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def run(app: FastAPI, port: int) -> None:
    """Serve a floor app with the same uvicorn settings as `sidequest serve` / `api` (service/cli.py)."""
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="info", access_log=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dsn", required=True)
    args = parser.parse_args()
    run(create_app(args.dsn), args.port)


if __name__ == "__main__":
    main()
