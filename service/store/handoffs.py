"""Hand-offs (SPEC §11.1) and pins: select the Q&A, record the block (built by the pure
:func:`service.budget.handoff.build_handoff`), move ``handed_off_through``. One hand-off is one short
transaction on the locked session row, so two concurrent hand-offs of a session never carry the same new Q&A
twice, and an idempotent replay sees the first one's record.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy.ext.asyncio import AsyncSession

from service.budget.handoff import HandoffBlock, HandoffItem, HandoffSummary, build_handoff, handoff_marks
from service.errors import SidequestError
from service.store import queries
from service.store.admission import IdempotencyConflict
from service.store.events import append_session_event
from service.store.execute import execute, fetch_all, fetch_one, fetch_value, json_text
from service.store.models import SessionRow
from service.store.records import request_record
from service.store.session_list import InvalidCursor
from service.store.sessions import find_request, find_session, lock_session
from service.vocabulary import Status, utc_iso, utc_iso_seconds

HandoffFormat = Literal["anthropic", "openai", "text"]
Include = Literal["new", "all"]


class UnknownOrdinals(SidequestError):
    """Some requested ordinals are not succeeded requests of the session (422)."""

    code = "unknown_ordinals"
    status = 422


class NotPinnable(SidequestError):
    """Only a succeeded request can be pinned (409)."""

    code = "not_pinnable"
    status = 409


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


def _public(handoff_id: object, body: dict[str, Any], parent_id: str) -> dict[str, Any]:
    return {"id": str(handoff_id), "parent_id": parent_id, **body}


def _body(created_at: str, ask: HandoffAsk, block: HandoffBlock) -> dict[str, Any]:
    """The public object of a hand-off but its id and parent id (what is stored); of an empty block,
    the object that says there was nothing to hand off."""
    ordinals = list(block.ordinals)
    return {
        "created_at": created_at,
        "format": ask.format,
        "ordinals": ordinals,
        "from_ordinal": ordinals[0] if ordinals else None,
        "through_ordinal": ordinals[-1] if ordinals else None,
        "estimate_tokens": block.estimate_tokens,
        "summarized_ordinals": list(block.summarized_ordinals),
        "shortened_ordinals": list(block.shortened_ordinals),
        "omitted_ordinals": list(block.omitted_ordinals),
        "truncated": block.truncated,
        "message": None if ask.format == "text" or not ordinals else {"role": "user", "content": block.text},
        "text": block.text,
    }


def _summary_of(memory: dict[str, Any]) -> HandoffSummary | None:
    """The rolling Q&A summary as stored with its rendered text (``StoredQASummary.to_json``); one
    without it (older) or unreadable is as good as none: the Q&A then go verbatim or shortened."""
    match memory.get("qa_summary"):
        case {
            "rendered": str(rendered),
            "first_ordinal": int(first),
            "covered_through_ordinal": int(through),
        }:
            return HandoffSummary(rendered, first, through)
    return None


async def _items(tx: AsyncSession, session_row: SessionRow, ask: HandoffAsk) -> list[HandoffItem]:
    params = {
        "session_id": session_row.id,
        "ordinals": None if ask.ordinals is None else list(ask.ordinals),
        "include": ask.include,
        "handed_off_through": session_row.handed_off_through,
    }
    rows = await fetch_all(tx, queries.handoff_candidates, params)
    if ask.ordinals is not None:
        missing = sorted(set(ask.ordinals) - {r["ordinal"] for r in rows})
        if missing:
            raise UnknownOrdinals(
                f"ordinals {', '.join(str(o) for o in missing[:20])} are not succeeded side questions of "
                "this session; only succeeded answers can be handed off",
                {"ordinals": missing},
            )
    return [
        HandoffItem(
            ordinal=r["ordinal"],
            question=r["question"],
            answer=r["answer"] or "",
            asked_at=utc_iso_seconds(r["created_at"]),
            snapshot_id=r["snapshot_id"],
            snapshot_time=r["snapshot_time"],
            snapshot_stored=utc_iso_seconds(r["snapshot_stored"]),
            pinned=r["pinned"],
        )
        for r in rows
    ]


async def _summary_for(tx: AsyncSession, session_row: SessionRow, ask: HandoffAsk) -> HandoffSummary | None:
    """The rolling summary the block may use: with ``ordinals`` (SPEC 11.1: exactly those), only when
    every succeeded Q&A it covers was asked for."""
    summary = _summary_of(session_row.memory)
    if summary is None or ask.ordinals is None:
        return summary
    params = {
        "session_id": session_row.id,
        "first": summary.first_ordinal,
        "through": summary.covered_through_ordinal,
    }
    covered = {r["ordinal"] for r in await fetch_all(tx, queries.succeeded_ordinals_between, params)}
    return summary if covered <= set(ask.ordinals) else None


async def create_handoff(
    tx: AsyncSession, tenant: str, parent_id: str, ask: HandoffAsk
) -> HandoffOutcome | None:
    """Build and record a hand-off; None when the session is unknown. A refusal is raised before any
    write; nothing to hand off → an empty object (``ordinals: []``), nothing recorded."""
    session_row = await lock_session(tx, tenant, parent_id)
    if session_row is None:
        return None
    if ask.idempotency_key is not None:
        params = {"session_id": session_row.id, "idempotency_key": ask.idempotency_key}
        earlier = await fetch_one(tx, queries.handoff_by_key, params)
        if earlier is not None:
            if earlier["body_hash"] != ask.body_hash:
                raise IdempotencyConflict(
                    "this Idempotency-Key was already used with a different hand-off body"
                )
            return HandoffOutcome(
                _public(earlier["id"], earlier["body"], session_row.parent_id), created=False
            )
    items = await _items(tx, session_row, ask)
    block = build_handoff(items, await _summary_for(tx, session_row, ask), ask.max_tokens)
    if block is None:
        empty = _body(utc_iso(), ask, HandoffBlock(text="", estimate_tokens=0, ordinals=()))
        return HandoffOutcome({"id": None, "parent_id": session_row.parent_id, **empty}, created=False)

    handoff_id = uuid.uuid4()
    created_at = await fetch_value(tx, queries.transaction_now, {})
    body = _body(utc_iso(created_at), ask, block)
    row = {
        "id": handoff_id,
        "session_id": session_row.id,
        "body": json_text(body),
        "through_ordinal": body["through_ordinal"],
        "idempotency_key": ask.idempotency_key,
        "body_hash": ask.body_hash,
        "created_at": created_at,
    }
    await execute(tx, queries.insert_handoff, row)
    # The session row is locked (lock_session): its marks move as the one rule says.
    marks = handoff_marks(block, session_row.handed_off_through)
    mark = marks.handed_off_through
    await execute(tx, queries.mark_handed_off, {"session_id": session_row.id, "handed_off_through": mark})
    params = {"session_id": session_row.id, "ordinals": [*marks.unpin, *marks.pin], "pin": list(marks.pin)}
    await execute(tx, queries.repin_after_handoff, params)
    public = _public(handoff_id, body, session_row.parent_id)
    summary = {k: v for k, v in public.items() if k not in ("text", "message")}
    await append_session_event(
        tx, session_row.id, "handoff", {"handoff": summary, "handed_off_through": mark}
    )
    return HandoffOutcome(public, created=True)


async def list_handoffs(
    tx: AsyncSession, tenant: str, parent_id: str, *, limit: int, before: str | None
) -> dict[str, Any] | None:
    """A page of the session's hand-offs, newest first (None: no such session); ``before`` is the previous
    page's ``next_before`` (its last id); an id unknown here (one a clear deleted) gives an empty page."""
    cursor_id = None
    if before is not None:
        try:
            cursor_id = uuid.UUID(before)
        except ValueError:
            # Not an id at all, so not a next_before this service issued: 400, like the session list's.
            raise InvalidCursor(
                "before must be the next_before of an earlier page (a hand-off id)", {"before": before[:100]}
            ) from None
    session_row = await find_session(tx, tenant, parent_id)
    if session_row is None:
        return None
    params = {"session_id": session_row.id, "before": cursor_id, "limit": limit + 1}
    rows = await fetch_all(tx, queries.handoff_page, params)
    has_more = len(rows) > limit
    page = rows[:limit]
    return {
        "items": [_public(r["id"], r["body"], session_row.parent_id) for r in page],
        "has_more": has_more,
        "next_before": str(page[-1]["id"]) if has_more and page else None,
    }


async def set_pinned(
    tx: AsyncSession, tenant: str, request_id: uuid.UUID, pinned: bool
) -> dict[str, Any] | None:
    """Pin (a succeeded request only) or unpin, idempotent; None for another tenant's or a cleared request."""
    found = await find_request(tx, tenant, request_id)
    if found is None:
        return None
    request_row, session_row = found
    if pinned and request_row.status != Status.SUCCEEDED:
        raise NotPinnable(
            f"only a succeeded side question can be pinned; this one is {request_row.status}",
            {"status": request_row.status},
        )
    if request_row.pinned != pinned:
        request_row.pinned = pinned
        await tx.flush()
    return request_record(request_row, session_row.parent_id)
