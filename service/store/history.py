"""Reads the pipeline needs: its snapshot as prepared when stored, and the session's Q&A history;
lock-free, each in its own short transaction, never held across a model call."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession

from service.budget import HISTORY_BATCH_SIZE
from service.budget.prepared import PREPARED_VERSION, PreparedSnapshot, prepare_snapshot
from service.store import queries
from service.store.db import Database
from service.store.execute import Executor, execute, fetch_all, fetch_one, fetch_value, json_text


@dataclass(frozen=True)
class HistoryItem:
    """One earlier successful side Q&A of the session."""

    ordinal: int
    question: str
    answer: str
    created_at: datetime
    # The estimate of the rendered Q&A group, stored when the request succeeded (None: older rows).
    qa_tokens: int | None = None


async def snapshot_content_hash(x: Executor, session_id: uuid.UUID, snapshot_id: str) -> str | None:
    """The content hash of a stored snapshot (None when the session does not have it): what names its
    preparation, which is a pure function of the content."""
    value = await fetch_value(
        x, queries.snapshot_content_hash, {"sid": session_id, "snapshot_id": snapshot_id}
    )
    return None if value is None else str(value)


async def load_prepared_snapshot(
    tx: AsyncSession, session_id: uuid.UUID, snapshot_id: str
) -> tuple[str, PreparedSnapshot] | None:
    """The snapshot as prepared when it was stored, with its content hash; None when not stored. One
    prepared by another format version (or none) is prepared now and written back."""
    params = {"sid": session_id, "snapshot_id": snapshot_id, "prepared_version": PREPARED_VERSION}
    row = await fetch_one(tx, queries.prepared_snapshot, params)
    if row is None:
        return None
    if row["content"] is None:
        return str(row["content_hash"]), PreparedSnapshot.from_json(row["prepared"], row["posted_messages"])
    prepared = prepare_snapshot(dict(row["content"]))
    await execute(tx, queries.store_preparation, {**params, "prepared": json_text(prepared.to_json())})
    return str(row["content_hash"]), prepared


async def latest_context_time(
    x: Executor, session_id: uuid.UUID, *, after_ordinal: int, through_ordinal: int, clear_version: int
) -> str | None:
    """When the main context was taken for the newest succeeded Q&A in ``(after, through]`` asked on a
    snapshot with a ``taken_at`` (SPEC 6.1: a rolling summary states its context time), or None."""
    value = await fetch_value(
        x,
        queries.latest_context_time,
        {"sid": session_id, "cv": clear_version, "after": after_ordinal, "through": through_ordinal},
    )
    return None if value is None else str(value)


async def iter_history(
    db: Database,
    session_id: uuid.UUID,
    *,
    before_ordinal: int,
    clear_version: int,
    after_ordinal: int = 0,
) -> AsyncIterator[list[HistoryItem]]:
    """Yield the session's succeeded, visible Q&A in ``(after_ordinal, before_ordinal)`` in batches,
    each its own short read on a plain connection. Only requests of the same ``clear_version``
    count: history from before a clear is gone even if the purge has not run yet."""
    while True:
        async with db.connection() as conn:
            rows = await fetch_all(
                conn,
                queries.history_page,
                {
                    "sid": session_id,
                    "cv": clear_version,
                    "after": after_ordinal,
                    "before": before_ordinal,
                    "limit": HISTORY_BATCH_SIZE,
                },
            )
        if not rows:
            return
        yield [
            HistoryItem(r["ordinal"], r["question"], r["answer"] or "", r["created_at"], r["qa_tokens"])
            for r in rows
        ]
        if len(rows) < HISTORY_BATCH_SIZE:
            return
        after_ordinal = rows[-1]["ordinal"]
