"""Test data written straight through the ORM, the way admission would write it.

Used by the store, pipeline and worker tests so they do not depend on the HTTP API:

- :func:`make_session` — a session row for (tenant, parent_id);
- :func:`add_snapshot` — an immutable main snapshot;
- :func:`admit` — a queued request with the next ordinal, the session's ``clear_version`` and its
  ``queued`` status event, then a NOTIFY on ``sidequest_queue`` (as admission does);
- :func:`add_history` — succeeded earlier Q&A (for replay / rolling-summary tests), no events;
- :func:`clear` — the API's own clear of a session (cancel, hide, empty memory, bump clear_version);
- :func:`enqueue_job` — a queued background job of the session's current ``clear_version``.

The API's admission code may replace :func:`admit` later; keep the row shapes identical to it.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

import pytest
from sqlalchemy import select, text, update

from service.config import Settings
from service.store.db import Database, DatabaseUnavailable
from service.store.events import append_event
from service.store.models import RequestRow, SessionRow, SnapshotRow
from service.vocabulary import QUEUE_CHANNEL, JobKind


def scripted_settings(database_url: str, base_url: str, **overrides: Any) -> Settings:
    """Settings whose model is the scripted OpenAI-compatible server at ``base_url``, with short
    leases and polls so tests are quick; ``overrides`` change any field."""
    values: dict[str, Any] = {
        "database_url": database_url,
        "provider": "openai",
        "base_url": base_url,
        "api_key": "test-key",
        "model": "scripted-model",
        "lease_s": 3.0,
        "heartbeat_s": 0.5,
        "poll_s": 0.2,
        "request_timeout_s": 20.0,
        # The 6.1–6.3 tests describe the in-request path, which is also the fallback when background
        # summaries are on (SPEC 6.6): they run with background summaries off unless they opt in.
        "background_summaries": "off",
        # …and in strict order (SPEC 6.3 parallelism 1); the parallel mode has tests of its own.
        "summary_parallelism": 1,
    }
    values.update(overrides)
    return Settings(**values)


async def make_session(
    db: Database,
    parent_id: str = "parent-1",
    tenant: str = "default",
    settings: dict[str, Any] | None = None,
) -> uuid.UUID:
    """Create a session (with these session settings, SPEC §11.2) and return its id."""
    async with db.sessions() as session, session.begin():
        row = SessionRow(tenant=tenant, parent_id=parent_id, settings=settings or {})
        session.add(row)
        await session.flush()
        return row.id


async def add_snapshot(
    db: Database, session_id: uuid.UUID, snapshot_id: str, content: dict[str, Any]
) -> None:
    """Store a main snapshot (content kept as given)."""
    raw = json.dumps(content, ensure_ascii=False, separators=(",", ":"))
    async with db.sessions() as session, session.begin():
        session.add(
            SnapshotRow(
                session_id=session_id,
                snapshot_id=snapshot_id,
                content=content,
                content_hash=hashlib.sha256(raw.encode()).hexdigest(),
                token_estimate=len(raw.encode()) // 3,
                size_bytes=len(raw.encode()),
            )
        )


async def admit(
    db: Database,
    session_id: uuid.UUID,
    question: str,
    *,
    snapshot_id: str | None = None,
    options: dict[str, Any] | None = None,
) -> uuid.UUID:
    """Admit one question: next ordinal, ``queued`` row and event, NOTIFY. Returns the request id."""
    async with db.sessions() as session, session.begin():
        ordinal, clear_version = (
            await session.execute(
                update(SessionRow)
                .where(SessionRow.id == session_id)
                .values(next_ordinal=SessionRow.next_ordinal + 1)
                .returning(SessionRow.next_ordinal - 1, SessionRow.clear_version)
            )
        ).one()
        row = RequestRow(
            session_id=session_id,
            ordinal=ordinal,
            question=question,
            snapshot_id=snapshot_id,
            clear_version=clear_version,
            options=options or {},
        )
        session.add(row)
        await session.flush()
        await append_event(session, row.id, "status", {"status": "queued", "stage": None})
        await session.execute(text("SELECT pg_notify(:c, :p)"), {"c": QUEUE_CHANNEL, "p": str(session_id)})
        return row.id


async def add_history(db: Database, session_id: uuid.UUID, pairs: list[tuple[str, str]]) -> list[uuid.UUID]:
    """Add succeeded earlier Q&A (question, answer) with the next ordinals; returns their ids."""
    ids: list[uuid.UUID] = []
    async with db.sessions() as session, session.begin():
        session_row = (await session.scalars(select(SessionRow).where(SessionRow.id == session_id))).one()
        for question, answer in pairs:
            ordinal = session_row.next_ordinal
            session_row.next_ordinal = ordinal + 1
            row = RequestRow(
                session_id=session_id,
                ordinal=ordinal,
                question=question,
                answer=answer,
                status="succeeded",
                stage="answering",
                clear_version=session_row.clear_version,
            )
            session.add(row)
            await session.flush()
            ids.append(row.id)
    return ids


async def clear(db: Database, parent_id: str, tenant: str = "default") -> None:
    """Clear a session exactly as ``DELETE /v1/sessions/{parent_id}/questions`` does (API store code)."""
    from service.store.admission import clear_session

    async with db.sessions() as session, session.begin():
        assert await clear_session(session, tenant, parent_id) is not None


async def enqueue_job(
    db: Database, session_id: uuid.UUID, kind: JobKind, key: str, params: dict[str, Any] | None = None
) -> uuid.UUID:
    """Queue a background job as the store does (``jobs.enqueue_job``), under the session's current
    ``clear_version``; ``params`` default to ``{"k": key}``."""
    from service.store import jobs

    async with db.sessions() as session, session.begin():
        cv = await session.scalar(
            text("SELECT clear_version FROM side_question_sessions WHERE id = :s"), {"s": session_id}
        )
        job_id = await jobs.enqueue_job(
            session, session_id, kind=kind, key=key, params=params or {"k": key}, clear_version=int(cv)
        )
    assert job_id is not None
    return job_id


async def merge_session_settings(session: Any, session_id: uuid.UUID, fields: dict[str, Any]) -> None:
    """Write session settings directly, bypassing the API's validation (to store what PUT refuses)."""
    await session.execute(
        update(SessionRow)
        .where(SessionRow.id == session_id)
        .values(settings=SessionRow.settings.op("||")(fields))
    )


def fail_once(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, error: Exception | None = None
) -> list[int]:
    """Make the coroutine function ``owner.name`` raise ``error`` (by default DatabaseUnavailable, a
    dropped connection) on its first call and run as itself after; the returned list gets an entry
    when it failed."""
    real = getattr(owner, name)
    failed: list[int] = []

    async def once(*args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(1)
            raise error if error is not None else DatabaseUnavailable("connection dropped")
        return await real(*args, **kwargs)

    monkeypatch.setattr(owner, name, once)
    return failed


def tool_session(groups: int, *, payload_bytes: int = 6000, start: int = 0) -> list[dict[str, Any]]:
    """A coding-agent transcript: each group reads a file (a large result) and says a sentence."""
    messages: list[dict[str, Any]] = []
    for n in range(start, start + groups):
        messages.append({"role": "user", "content": f"step {n}: look at module {n}"})
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Reading module {n}."},
                    {
                        "type": "tool_use",
                        "id": f"t{n}",
                        "name": "Read",
                        "input": {"file_path": f"/src/mod_{n}.py"},
                    },
                ],
            }
        )
        half = f"value_{n} = compute({n})\n" * (payload_bytes // 48)
        body = f"# module {n}\n{half}inner_{n} = 1\n{half}"
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{n}", "content": body}]}
        )
        messages.append({"role": "assistant", "content": f"Module {n} computes value_{n}."})
    return messages
