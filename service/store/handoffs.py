"""Hand-offs (SPEC §11.1) and pins: select the Q&A, record the block, move ``handed_off_through``.

One hand-off is one short transaction on the locked session row (``FOR NO KEY UPDATE``, like
admission), so two concurrent hand-offs of a session never carry the same new Q&A twice, and an
idempotent replay sees the first one's record. The block itself is built by the pure
:func:`service.budget.handoff.build_handoff`; this module only reads its inputs and writes its result.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from sqlalchemy import and_, delete, func, literal_column, or_, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from service.budget.handoff import HandoffItem, HandoffSummary, build_handoff, handoff_marks
from service.errors import SidequestError
from service.store.events import append_session_event
from service.store.models import HandoffRow, RequestRow, SessionRow, SnapshotRow, snapshot_taken_at_sql
from service.store.records import request_record
from service.store.session_list import InvalidCursor
from service.store.sessions import find_request, find_session, lock_session
from service.vocabulary import Status, utc_iso, utc_iso_seconds

HandoffFormat = Literal["anthropic", "openai", "text"]
HANDOFF_FORMATS: Final = ("anthropic", "openai", "text")
Include = Literal["new", "all"]


class UnknownOrdinals(SidequestError):
    """Some requested ordinals are not succeeded requests of the session (422)."""

    code = "unknown_ordinals"
    status = 422

    def __init__(self, ordinals: Sequence[int]) -> None:
        listed = ", ".join(str(o) for o in ordinals[:20])
        super().__init__(
            f"ordinals {listed} are not succeeded side questions of this session; "
            "only succeeded answers can be handed off",
            {"ordinals": list(ordinals)},
        )
        self.ordinals = list(ordinals)


class HandoffIdempotencyConflict(SidequestError):
    """The Idempotency-Key was used for another hand-off body (409)."""

    code = "idempotency_conflict"
    status = 409

    def __init__(self) -> None:
        super().__init__("this Idempotency-Key was already used with a different hand-off body")


class NotPinnable(SidequestError):
    """Only a succeeded request can be pinned (409); ``request_status`` is the request's own status."""

    code = "not_pinnable"
    status = 409

    def __init__(self, request_status: str) -> None:
        super().__init__(
            f"only a succeeded side question can be pinned; this one is {request_status}",
            {"status": request_status},
        )
        self.request_status = request_status


@dataclass(frozen=True)
class HandoffAsk:
    """A validated hand-off request."""

    format: HandoffFormat = "anthropic"
    max_tokens: int = 2000
    include: Include = "new"
    ordinals: tuple[int, ...] | None = None
    idempotency_key: str | None = None
    body_hash: str | None = None


@dataclass(frozen=True)
class HandoffOutcome:
    """The public hand-off object, and whether it was recorded now (False: a replay or nothing to do)."""

    handoff: dict[str, Any]
    created: bool


def public_handoff(row: HandoffRow, parent_id: str) -> dict[str, Any]:
    """The public object of a recorded hand-off (its stored body plus id and parent id)."""
    return {"id": str(row.id), "parent_id": parent_id, **row.body}


def _empty(parent_id: str, ask: HandoffAsk) -> dict[str, Any]:
    return {
        "id": None,
        "parent_id": parent_id,
        "created_at": utc_iso(),
        "format": ask.format,
        "ordinals": [],
        "from_ordinal": None,
        "through_ordinal": None,
        "estimate_tokens": 0,
        "summarized_ordinals": [],
        "shortened_ordinals": [],
        "omitted_ordinals": [],
        "truncated": False,
        "message": None,
        "text": "",
    }


def _summary_of(memory: dict[str, Any] | None) -> HandoffSummary | None:
    """The rolling Q&A summary as stored with its rendered text (``StoredQASummary.to_json``).

    A summary without one (written before it was kept) or unreadable is as good as none: the Q&A
    then go verbatim or shortened.
    """
    value = (memory or {}).get("qa_summary")
    if not isinstance(value, dict):
        return None
    rendered, first, through = (
        value.get("rendered"),
        value.get("first_ordinal"),
        value.get("covered_through_ordinal"),
    )
    if not isinstance(rendered, str) or not isinstance(first, int) or not isinstance(through, int):
        return None
    return HandoffSummary(rendered, first, through)


async def _candidates(session: AsyncSession, session_row: SessionRow, ask: HandoffAsk) -> list[RequestRow]:
    visible = and_(
        RequestRow.session_id == session_row.id,
        RequestRow.deleted_at.is_(None),
        RequestRow.status == Status.SUCCEEDED,
        RequestRow.answer.is_not(None),
    )
    query = select(RequestRow).where(visible)
    if ask.ordinals is not None:
        query = query.where(RequestRow.ordinal.in_(ask.ordinals))
    elif ask.include == "new":
        query = query.where(
            or_(RequestRow.ordinal > session_row.handed_off_through, RequestRow.pinned.is_(True))
        )
    rows = list(await session.scalars(query.order_by(RequestRow.ordinal)))
    if ask.ordinals is not None:
        found = {r.ordinal for r in rows}
        missing = sorted(set(ask.ordinals) - found)
        if missing:
            raise UnknownOrdinals(missing)
    return rows


async def _summary_for(
    session: AsyncSession, session_row: SessionRow, ask: HandoffAsk
) -> HandoffSummary | None:
    """The rolling summary the block may use: with ``ordinals`` (SPEC 11.1: exactly those), only when
    every succeeded Q&A it covers was asked for — it cannot carry part of what it summarises."""
    summary = _summary_of(session_row.memory)
    if summary is None or ask.ordinals is None:
        return summary
    covered = await session.scalars(
        select(RequestRow.ordinal).where(
            RequestRow.session_id == session_row.id,
            RequestRow.deleted_at.is_(None),
            RequestRow.status == Status.SUCCEEDED,
            RequestRow.ordinal.between(summary.first_ordinal, summary.covered_through_ordinal),
        )
    )
    return summary if set(covered) <= set(ask.ordinals) else None


async def _snapshot_times(
    session: AsyncSession, session_id: uuid.UUID, snapshot_ids: set[str]
) -> dict[str, tuple[str | None, str | None]]:
    """``(taken_at, stored)`` of each named snapshot: its own ``taken_at`` when it has one, and when
    the service stored it (UTC, seconds)."""
    if not snapshot_ids:
        return {}
    taken: ColumnElement[str | None] = literal_column(snapshot_taken_at_sql(SnapshotRow.__tablename__))
    rows = await session.execute(
        select(SnapshotRow.snapshot_id, taken, SnapshotRow.created_at).where(
            SnapshotRow.session_id == session_id, SnapshotRow.snapshot_id.in_(sorted(snapshot_ids))
        )
    )
    return {
        snapshot_id: (None if value is None else str(value), utc_iso_seconds(stored))
        for snapshot_id, value, stored in rows
    }


async def create_handoff(
    session: AsyncSession, tenant: str, parent_id: str, ask: HandoffAsk
) -> HandoffOutcome | None:
    """Build and record a hand-off inside the caller's transaction; None when the session is unknown.

    Raises :class:`UnknownOrdinals` (an asked ordinal is not a succeeded request) and
    :class:`HandoffIdempotencyConflict`, before any write, so a refusal writes nothing. Nothing to
    hand off → an empty object (``ordinals: []``), nothing recorded.
    """
    session_row = await lock_session(session, tenant, parent_id)
    if session_row is None:
        return None
    if ask.idempotency_key is not None:
        earlier = await session.scalar(
            select(HandoffRow).where(
                HandoffRow.session_id == session_row.id, HandoffRow.idempotency_key == ask.idempotency_key
            )
        )
        if earlier is not None:
            if earlier.body_hash != ask.body_hash:
                raise HandoffIdempotencyConflict()
            return HandoffOutcome(public_handoff(earlier, session_row.parent_id), created=False)
    rows = await _candidates(session, session_row, ask)
    times = await _snapshot_times(session, session_row.id, {r.snapshot_id for r in rows if r.snapshot_id})
    items: list[HandoffItem] = []
    for r in rows:
        taken, stored = times.get(r.snapshot_id, (None, None)) if r.snapshot_id else (None, None)
        items.append(
            HandoffItem(
                ordinal=r.ordinal,
                question=r.question,
                answer=r.answer or "",
                asked_at=utc_iso_seconds(r.created_at),
                snapshot_id=r.snapshot_id,
                snapshot_time=taken,
                snapshot_stored=stored,
                pinned=r.pinned,
            )
        )
    block = build_handoff(items, await _summary_for(session, session_row, ask), ask.max_tokens)
    if block is None:
        return HandoffOutcome(_empty(session_row.parent_id, ask), created=False)

    handoff_id = uuid.uuid4()
    created_at = await session.scalar(select(func.now()))
    ordinals = list(block.ordinals)
    body: dict[str, Any] = {
        "created_at": utc_iso(created_at),
        "format": ask.format,
        "ordinals": ordinals,
        "from_ordinal": ordinals[0],
        "through_ordinal": ordinals[-1],
        "estimate_tokens": block.estimate_tokens,
        "summarized_ordinals": list(block.summarized_ordinals),
        "shortened_ordinals": list(block.shortened_ordinals),
        "omitted_ordinals": list(block.omitted_ordinals),
        "truncated": block.truncated,
        "message": None if ask.format == "text" else {"role": "user", "content": block.text},
        "text": block.text,
    }
    row = HandoffRow(
        id=handoff_id,
        session_id=session_row.id,
        body=body,
        through_ordinal=ordinals[-1],
        idempotency_key=ask.idempotency_key,
        body_hash=ask.body_hash,
        created_at=created_at,
    )
    session.add(row)
    marks = handoff_marks(block, session_row.handed_off_through)
    session_row.handed_off_through = marks.handed_off_through
    session_row.updated_at = func.now()
    await session.execute(
        update(RequestRow)
        .where(
            RequestRow.session_id == session_row.id,
            RequestRow.ordinal.in_([*marks.unpin, *marks.pin]),
            RequestRow.status == Status.SUCCEEDED,
            RequestRow.deleted_at.is_(None),
        )
        .values(pinned=RequestRow.ordinal.in_(marks.pin))
        .execution_options(synchronize_session=False)
    )
    await session.flush()
    await append_session_event(
        session,
        session_row.id,
        "handoff",
        {
            "handoff": {
                k: v
                for k, v in public_handoff(row, session_row.parent_id).items()
                if k not in ("text", "message")
            },
            "handed_off_through": session_row.handed_off_through,
        },
    )
    return HandoffOutcome(public_handoff(row, session_row.parent_id), created=True)


def _handoff_cursor(before: str) -> uuid.UUID:
    try:
        return uuid.UUID(before)
    except ValueError:
        # Not an id at all, so not a next_before this service issued: 400, like the session list's.
        raise InvalidCursor(
            "before must be the next_before of an earlier page (a hand-off id)", {"before": before[:100]}
        ) from None


async def list_handoffs(
    session: AsyncSession, tenant: str, parent_id: str, *, limit: int, before: str | None
) -> dict[str, Any] | None:
    """A page of the session's hand-offs, newest first: ``{items, has_more, next_before}``.

    ``before`` is the previous page's ``next_before`` (the id of its last hand-off): anything that is
    not an id raises :class:`InvalidCursor` (400); an id that is not one of this session's hand-offs
    (one a clear deleted) gives an empty page. None when the session does not exist.
    """
    cursor_id = None if before is None else _handoff_cursor(before)
    session_row = await find_session(session, tenant, parent_id)
    if session_row is None:
        return None
    query = select(HandoffRow).where(HandoffRow.session_id == session_row.id)
    if cursor_id is not None:
        cursor = (
            await session.execute(
                select(HandoffRow.created_at, HandoffRow.id).where(
                    HandoffRow.session_id == session_row.id, HandoffRow.id == cursor_id
                )
            )
        ).first()
        if cursor is None:
            return {"items": [], "has_more": False, "next_before": None}
        query = query.where(tuple_(HandoffRow.created_at, HandoffRow.id) < tuple_(cursor[0], cursor[1]))
    rows = list(
        await session.scalars(
            query.order_by(HandoffRow.created_at.desc(), HandoffRow.id.desc()).limit(limit + 1)
        )
    )
    has_more = len(rows) > limit
    page = rows[:limit]
    return {
        "items": [public_handoff(r, session_row.parent_id) for r in page],
        "has_more": has_more,
        "next_before": str(page[-1].id) if has_more and page else None,
    }


async def set_pinned(
    session: AsyncSession, tenant: str, request_id: uuid.UUID, pinned: bool
) -> dict[str, Any] | None:
    """Pin (a succeeded request only, else :class:`NotPinnable`) or unpin; idempotent; inside the
    caller's transaction.

    None when the request is not the tenant's or was cleared.
    """
    found = await find_request(session, tenant, request_id)
    if found is None:
        return None
    row, session_row = found
    if pinned and row.status != Status.SUCCEEDED:
        raise NotPinnable(row.status)
    if row.pinned != pinned:
        row.pinned = pinned
        await session.flush()
    return request_record(row, session_row.parent_id)


async def delete_handoffs(session: AsyncSession, session_id: uuid.UUID) -> int:
    """Delete every hand-off of a session in the caller's transaction (a clear); returns how many."""
    result: Any = await session.execute(
        delete(HandoffRow)
        .where(HandoffRow.session_id == session_id)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount or 0)


__all__ = [
    "HANDOFF_FORMATS",
    "HandoffAsk",
    "HandoffIdempotencyConflict",
    "HandoffOutcome",
    "NotPinnable",
    "UnknownOrdinals",
    "create_handoff",
    "delete_handoffs",
    "list_handoffs",
    "public_handoff",
    "set_pinned",
]
