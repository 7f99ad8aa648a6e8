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

from service.store import queries
from service.store.execute import Executor, fetch_value, json_text
from service.store.models import EMPTY_MEMORY

# Newest context summaries kept per session: a cache, not history; old snapshots' prefixes age out.
MAX_CONTEXT_SUMMARIES = 16

# The guarded writes (the writer a running request or a running background job), the lock of the
# writer's session row before them, the read: named queries in service/store/sql/memory.sql.


async def save_memory(
    tx: Executor,
    request_id: uuid.UUID,
    *,
    owner: str | None,
    qa_summary: dict[str, Any] | None = None,
    context_summary: dict[str, Any] | None = None,
    job: bool = False,
) -> bool:
    """Save a rolling Q&A summary and/or one context summary for the writer's session, inside the
    caller's transaction (a background job's end writes its summary and its terminal state in one
    commit).

    The writer is the request ``request_id`` — or, with ``job``, the background job of that id.
    ``qa_summary`` (when given) replaces the session's rolling summary; ``context_summary`` (a dict with
    a ``key``) replaces the cache entry with the same key or is appended, keeping the newest
    :data:`MAX_CONTEXT_SUMMARIES`. ``owner`` additionally requires the writer's lease to be held by
    that worker (None skips that part). Returns whether anything was written: False means the writer
    stopped running or the session was cleared, and the summary must be dropped, not retried.
    """
    if qa_summary is None and context_summary is None:
        raise ValueError("save_memory needs a qa_summary or a context_summary")
    if context_summary is not None and "key" not in context_summary:
        raise ValueError("a context summary needs its cache key")
    # Lock the session row first and only then check the writer: the guard below is the next
    # statement, so it runs on a snapshot taken after every earlier clear/cancel committed (READ
    # COMMITTED, new statement), and a single row lock can never deadlock with the API's multi-row
    # clear.
    lock_session = queries.lock_session_of_job if job else queries.lock_session_of_request
    if await fetch_value(tx, lock_session, {"id": request_id}) is None:
        return False
    written = await fetch_value(
        tx,
        queries.save_memory_of_job if job else queries.save_memory_of_request,
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


async def load_memory(tx: Executor, session_id: uuid.UUID) -> dict[str, Any]:
    """The session's memory (``{qa_summary, context_summaries}``), empty if never written."""
    memory = await fetch_value(tx, queries.load_memory, {"id": session_id})
    result = dict(EMPTY_MEMORY)
    result.update(memory or {})
    return result
