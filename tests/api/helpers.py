"""Test helpers: admit over HTTP, write events and states directly with the store code."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
from sqlalchemy import select, update

from service.store.db import Database
from service.store.events import Event, append_event
from service.store.models import RequestRow
from service.store.records import request_record


async def ask(
    client: httpx.AsyncClient, parent_id: str, question: str = "why?", **extra: Any
) -> dict[str, Any]:
    """Admit a question and return its record (asserting 202)."""
    response = await client.post(f"/v1/sessions/{parent_id}/questions", json={"question": question, **extra})
    assert response.status_code == 202, response.text
    record: dict[str, Any] = response.json()
    return record


async def append(db: Database, request_id: str, event_type: str, fields: dict[str, Any]) -> Event:
    """Append one event in its own transaction (as a worker would)."""
    async with db.sessions() as tx:
        event = await append_event(tx, uuid.UUID(request_id), event_type, fields)
        await tx.commit()
    return event


async def mark_running(db: Database, request_id: str, stage: str = "preparing") -> None:
    """Put a request in ``running`` as a worker's claim would (lease included) and emit its status."""
    async with db.sessions() as tx:
        await tx.execute(
            update(RequestRow)
            .where(RequestRow.id == uuid.UUID(request_id))
            .values(status="running", stage=stage, attempt=1, lease_owner="test-worker")
        )
        await append_event(tx, uuid.UUID(request_id), "status", {"status": "running", "stage": stage})
        await tx.commit()


async def finish(db: Database, request_id: str, answer: str = "because") -> None:
    """Finish a request successfully: terminal status event, then ``done`` with the record."""
    async with db.sessions() as tx:
        await tx.execute(
            update(RequestRow)
            .where(RequestRow.id == uuid.UUID(request_id))
            .values(status="succeeded", stage=None, answer=answer)
        )
        row = await tx.scalar(
            select(RequestRow)
            .where(RequestRow.id == uuid.UUID(request_id))
            .execution_options(populate_existing=True)
        )
        assert row is not None
        await append_event(tx, row.id, "status", {"status": "succeeded", "stage": None})
        await append_event(tx, row.id, "done", {"record": request_record(row, "p")})
        await tx.commit()
