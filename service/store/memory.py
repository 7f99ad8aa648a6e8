"""The session's memory (rolling Q&A summary, context-summary cache): reads and the ONE guarded write.

SPEC §6.5: a summary is saved only while its request is still ``running`` and the session's
``clear_version`` still equals the request's. The guard and the write are one ``UPDATE`` of the session
row joined to the request row, so a clear (which bumps ``clear_version`` and empties the memory on the
same session row) and a late summary write are ordered by that row's lock, which the write takes
before it checks anything:

- the clear commits first → the write's re-check sees the new ``clear_version`` (or the cancelled
  request) and writes nothing;
- the write commits first → the clear then empties what it wrote.

Either way nothing survives a clear. Values are merged in SQL (``jsonb_set``) so the write never
replaces parts of the memory it did not mean to touch.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import text

from service.store.execute import Executor, fetch_value, json_text, transaction
from service.store.models import EMPTY_MEMORY

# Newest context summaries kept per session: a cache, not history; old snapshots' prefixes age out.
MAX_CONTEXT_SUMMARIES = 16

_MEMORY_VALUE = """
    SET memory = (
            WITH base AS (
                SELECT CASE WHEN CAST(:set_qa AS boolean)
                            THEN jsonb_set(s.memory, '{qa_summary}', CAST(:qa AS jsonb), true)
                            ELSE s.memory END AS m
            ),
            kept AS (
                SELECT e.c, e.n FROM base,
                    jsonb_array_elements(coalesce(base.m->'context_summaries', '[]'::jsonb))
                        WITH ORDINALITY AS e(c, n)
                WHERE CAST(:ctx AS jsonb) IS NULL OR e.c->>'key' IS DISTINCT FROM CAST(:ctx AS jsonb)->>'key'
                UNION ALL
                SELECT CAST(:ctx AS jsonb), 1000000 WHERE CAST(:ctx AS jsonb) IS NOT NULL
            ),
            newest AS (
                SELECT c, n FROM kept ORDER BY n DESC LIMIT :max_ctx
            )
            SELECT jsonb_set(
                base.m, '{context_summaries}',
                coalesce((SELECT jsonb_agg(c ORDER BY n) FROM newest), '[]'::jsonb), true)
            FROM base
        )
"""
# (No ``updated_at = now()``: the session row's updated_at is its *activity* — what a client did,
# which orders the session list — and a summary written in the background is none; docs/api.md.)

# The writer is a running request (its lease, when ``owner`` is given) …
_GUARDED_WRITE = text(
    "UPDATE side_question_sessions s"
    + _MEMORY_VALUE
    + """
    FROM side_question_requests r
    WHERE r.id = :writer_id
      AND s.id = r.session_id
      AND r.status = 'running'
      AND r.deleted_at IS NULL
      AND s.clear_version = r.clear_version
      AND (CAST(:owner AS text) IS NULL OR r.lease_owner = CAST(:owner AS text))
    RETURNING s.id
    """
)
# … or a running background job (SPEC §6.6: jobs obey §6.5 with their own clear_version).
_GUARDED_JOB_WRITE = text(
    "UPDATE side_question_sessions s"
    + _MEMORY_VALUE
    + """
    FROM side_question_jobs j
    WHERE j.id = :writer_id
      AND s.id = j.session_id
      AND j.status = 'running'
      AND s.clear_version = j.clear_version
      AND (CAST(:owner AS text) IS NULL OR j.lease_owner = CAST(:owner AS text))
    RETURNING s.id
    """
)


# The writer's session row, locked (one round trip); the guarded write then reads the writer again.
_LOCK_WRITER_SESSION = {
    table: text(
        "SELECT s.id FROM side_question_sessions s "
        f"WHERE s.id = (SELECT w.session_id FROM {table} w WHERE w.id = :id) FOR NO KEY UPDATE"
    )
    for table in ("side_question_jobs", "side_question_requests")
}
_LOAD_MEMORY = text("SELECT memory FROM side_question_sessions WHERE id = :id")


async def save_memory(
    x: Executor,
    request_id: uuid.UUID,
    *,
    owner: str | None,
    qa_summary: dict[str, Any] | None = None,
    context_summary: dict[str, Any] | None = None,
    job: bool = False,
) -> bool:
    """Save a rolling Q&A summary and/or one context summary for the writer's session; commits.

    The writer is the request ``request_id`` — or, with ``job``, the background job of that id.
    ``qa_summary`` (when given) replaces the session's rolling summary; ``context_summary`` (a dict with
    a ``key``) replaces the cache entry with the same key or is appended, keeping the newest
    :data:`MAX_CONTEXT_SUMMARIES`. ``owner`` additionally requires the writer's lease to be held by
    that worker (None skips that part). Returns whether anything was written: False means the writer
    stopped running or the session was cleared, and the summary must be dropped, not retried.
    """
    async with transaction(x):
        return await save_memory_in(
            x, request_id, owner=owner, qa_summary=qa_summary, context_summary=context_summary, job=job
        )


async def save_memory_in(
    x: Executor,
    request_id: uuid.UUID,
    *,
    owner: str | None,
    qa_summary: dict[str, Any] | None = None,
    context_summary: dict[str, Any] | None = None,
    job: bool = False,
) -> bool:
    """:func:`save_memory` inside the caller's transaction (a background job's end writes its summary
    and its terminal state in one commit)."""
    if qa_summary is None and context_summary is None:
        raise ValueError("save_memory needs a qa_summary or a context_summary")
    if context_summary is not None and "key" not in context_summary:
        raise ValueError("a context summary needs its cache key")
    table = "side_question_jobs" if job else "side_question_requests"
    # Lock the session row first and only then check the writer: the guard below is the next
    # statement, so it runs on a snapshot taken after every earlier clear/cancel committed (READ
    # COMMITTED, new statement), and a single row lock can never deadlock with the API's multi-row
    # clear.
    if await fetch_value(x, _LOCK_WRITER_SESSION[table], {"id": request_id}) is None:
        return False
    written = await fetch_value(
        x,
        _GUARDED_JOB_WRITE if job else _GUARDED_WRITE,
        {
            "writer_id": request_id,
            "owner": owner,
            "set_qa": qa_summary is not None,
            "qa": json_text(qa_summary),
            "ctx": None if context_summary is None else json_text(context_summary),
            "max_ctx": MAX_CONTEXT_SUMMARIES,
        },
    )
    return written is not None


async def load_memory(x: Executor, session_id: uuid.UUID) -> dict[str, Any]:
    """The session's memory (``{qa_summary, context_summaries}``), empty if never written."""
    memory = await fetch_value(x, _LOAD_MEMORY, {"id": session_id})
    result = dict(EMPTY_MEMORY)
    result.update(memory or {})
    return result
