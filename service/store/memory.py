"""The session's memory (rolling Q&A summary, context-summary cache): the read and the ONE guarded write
(SPEC §6.5; docs/pipeline.md, "Guarded writes", says why it cannot race a clear). Values are merged
in SQL, so a write never replaces parts of the memory it did not mean to touch.
"""

from __future__ import annotations

import uuid
from typing import Any

from service.store import queries
from service.store.execute import Executor, fetch_value, json_text
from service.store.models import complete_memory

# Newest context summaries kept per session: a cache, not history; old snapshots' prefixes age out.
MAX_CONTEXT_SUMMARIES = 16


async def save_memory(
    tx: Executor,
    request_id: uuid.UUID,
    *,
    owner: str | None,
    qa_summary: dict[str, Any] | None = None,
    context_summary: dict[str, Any] | None = None,
    job: bool = False,
) -> bool:
    """Save a rolling Q&A summary and/or one context summary (replacing the cache entry of its ``key``,
    keeping the newest :data:`MAX_CONTEXT_SUMMARIES`) for the writer's session: the request
    ``request_id``, or with ``job`` that background job, whose lease ``owner`` must hold. False: the
    writer stopped running or the session was cleared; the summary must be dropped, not retried."""
    if qa_summary is None and context_summary is None:
        raise ValueError("save_memory needs a qa_summary or a context_summary")
    if context_summary is not None and "key" not in context_summary:
        raise ValueError("a context summary needs its cache key")
    # The session row locked first, the writer checked after: the guard then sees every earlier
    # clear or cancel (READ COMMITTED, a new statement), and one row lock cannot deadlock a clear.
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
    return complete_memory(await fetch_value(tx, queries.load_memory, {"id": session_id}))
