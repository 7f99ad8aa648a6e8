"""The lease guard: every write a worker makes to a request it runs is conditional on still holding it.

A claim (:mod:`service.store.queue`) sets ``lease_owner`` and ``lease_expires_at``; heartbeats extend
them. :func:`lock_if_held` locks the row inside the caller's transaction only while the request is
``running`` under this worker, so a request cancelled, cleared or taken over by the sweep is never
written by a worker that lost it, and no event ever follows a terminal one.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import text

from service.store.events import append_event
from service.store.execute import Executor, execute, fetch_value, transaction

_LOCK_IF_HELD = text(
    """
    SELECT id FROM side_question_requests
    WHERE id = :id AND status = 'running' AND lease_owner = :owner AND deleted_at IS NULL
    FOR UPDATE
    """
)
_MOVE_TO_STAGE = text(
    "UPDATE side_question_requests SET stage = :stage, "
    "context_info = context_info || CAST(:info AS jsonb) WHERE id = :id"
)


async def lock_if_held(session: Executor, request_id: uuid.UUID, owner: str) -> bool:
    """Inside the caller's transaction: lock the request row if this worker still runs it.

    Used before every worker write; a concurrent cancel or clear holding the row makes this wait, then
    see the new status, so the worker's write is skipped rather than landing after a terminal event.
    """
    held = await fetch_value(session, _LOCK_IF_HELD, {"id": request_id, "owner": owner})
    return held is not None


async def emit_batch_if_held(
    session: Executor,
    request_id: uuid.UUID,
    owner: str,
    events: list[tuple[str, dict[str, Any]]],
    *,
    stage: str | None = None,
    context_info: dict[str, Any] | None = None,
) -> bool:
    """Append ``events`` in order — and, with ``stage``, move the request to it and store
    ``context_info`` — in ONE transaction, only while this worker holds the request.

    The pipeline batches what happens between two slow steps (a stage change, the replay plan, the
    next stage change) into one commit instead of one each. Returns False, writing nothing, when the
    request is no longer this worker's.
    """
    async with transaction(session):
        if not await lock_if_held(session, request_id, owner):
            return False
        if stage is not None:
            info = dict(context_info or {})
            info["stage"] = stage
            await execute(
                session,
                _MOVE_TO_STAGE,
                {
                    "stage": stage,
                    "info": json.dumps(info, ensure_ascii=False, separators=(",", ":")),
                    "id": request_id,
                },
            )
        for event_type, fields in events:
            await append_event(session, request_id, event_type, fields)
        return True


async def emit_if_held(
    session: Executor,
    request_id: uuid.UUID,
    owner: str,
    event_type: str,
    fields: dict[str, Any],
) -> bool:
    """Append one event in its own transaction, only while this worker holds the request."""
    return await emit_batch_if_held(session, request_id, owner, [(event_type, fields)])


__all__ = ["emit_batch_if_held", "emit_if_held", "lock_if_held"]
