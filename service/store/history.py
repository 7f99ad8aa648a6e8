"""Reads the pipeline needs: its snapshot as prepared when stored, and the session's Q&A history.

Read-only and lock-free: each runs in its own short transaction and is never held across a model call.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.budget import HISTORY_BATCH_SIZE
from service.budget.prepared import PREPARED_VERSION, PreparedSnapshot, prepare_snapshot
from service.store.models import RequestRow, SnapshotRow
from service.vocabulary import Status


@dataclass(frozen=True)
class HistoryItem:
    """One earlier successful side Q&A of the session."""

    ordinal: int
    question: str
    answer: str
    created_at: datetime
    # The estimate of the rendered Q&A group, stored when the request succeeded (None: older rows).
    qa_tokens: int | None = None


async def load_snapshot(
    session: AsyncSession, session_id: uuid.UUID, snapshot_id: str
) -> dict[str, Any] | None:
    """The stored snapshot content (as posted), or None when it is not stored for this session."""
    content = await session.scalar(
        select(SnapshotRow.content).where(
            SnapshotRow.session_id == session_id, SnapshotRow.snapshot_id == snapshot_id
        )
    )
    return dict(content) if content is not None else None


async def load_prepared_snapshot(
    session: AsyncSession, session_id: uuid.UUID, snapshot_id: str
) -> PreparedSnapshot | None:
    """The snapshot as prepared when it was stored (issue 12), or None when it is not stored.

    A snapshot stored before preparation existed, or prepared by another format version, is prepared
    now from its content and the result written back (once: snapshots are immutable).
    """
    row = (
        await session.execute(
            select(
                SnapshotRow.prepared,
                SnapshotRow.prepared_version,
                # The transcript itself, only when the preparation left it out (messages_as_posted).
                case(
                    (func.json_typeof(SnapshotRow.prepared["messages"]) == "array", None),
                    else_=SnapshotRow.content["messages"],
                ).label("posted_messages"),
            ).where(SnapshotRow.session_id == session_id, SnapshotRow.snapshot_id == snapshot_id)
        )
    ).one_or_none()
    if row is None:
        return None
    if row.prepared is not None and row.prepared_version == PREPARED_VERSION:
        return PreparedSnapshot.from_json(row.prepared, row.posted_messages)
    content = await load_snapshot(session, session_id, snapshot_id)
    if content is None:
        return None
    prepared = prepare_snapshot(content)
    await session.execute(
        update(SnapshotRow)
        .where(SnapshotRow.session_id == session_id, SnapshotRow.snapshot_id == snapshot_id)
        .values(prepared=prepared.to_json(), prepared_version=PREPARED_VERSION)
    )
    await session.commit()
    return prepared


async def iter_history(
    sessions: async_sessionmaker[AsyncSession],
    session_id: uuid.UUID,
    *,
    before_ordinal: int,
    clear_version: int,
    after_ordinal: int = 0,
    batch_size: int = HISTORY_BATCH_SIZE,
) -> AsyncIterator[list[HistoryItem]]:
    """Yield the session's succeeded, visible Q&A in ``(after_ordinal, before_ordinal)`` in batches.

    Only requests of the same ``clear_version`` count: history from before a clear is gone even if the
    purge has not run yet. Each batch is its own short read (keyset pagination on the ordinal).
    """
    after = after_ordinal
    while True:
        async with sessions() as session:
            rows = (
                await session.execute(
                    select(
                        RequestRow.ordinal,
                        RequestRow.question,
                        RequestRow.answer,
                        RequestRow.created_at,
                        RequestRow.qa_tokens,
                    )
                    .where(
                        RequestRow.session_id == session_id,
                        RequestRow.status == Status.SUCCEEDED,
                        RequestRow.deleted_at.is_(None),
                        RequestRow.clear_version == clear_version,
                        RequestRow.answer.is_not(None),
                        RequestRow.ordinal > after,
                        RequestRow.ordinal < before_ordinal,
                    )
                    .order_by(RequestRow.ordinal)
                    .limit(batch_size)
                )
            ).all()
        if not rows:
            return
        yield [HistoryItem(r.ordinal, r.question, r.answer or "", r.created_at, r.qa_tokens) for r in rows]
        if len(rows) < batch_size:
            return
        after = rows[-1].ordinal
