"""Side-question archives: the SQL of export and restore (what is exported, how a restore writes it:
docs/archive.md); the format (validation, upgrades, encoding, the JSON Schemas) is :mod:`service.archive`'s.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from service.archive import (
    QUESTION_FIELDS,
    Archive,
    ArchivedHandoff,
    ArchivedRequest,
    ArchiveError,
    archived_error,
    encode_archive,
    superseding_ids,
)
from service.store import queries
from service.store.events import mark_session_events_cleared
from service.store.execute import execute, fetch_all, fetch_models, json_text, notify
from service.store.models import EventRow, HandoffRow, RequestRow, complete_memory, empty_usage
from service.store.records import request_record
from service.store.sessions import find_session, lock_or_create_session, status_counts_of
from service.vocabulary import EVENTS_CHANNEL, TERMINAL, Status, utc_iso


class SessionNotFound(ArchiveError):
    """No session with this parent id for this tenant (404, also for another tenant's session)."""

    status = 404
    code = "not_found"


class SessionHasHistory(ArchiveError):
    """Restoring would mix two histories; ``mode=replace`` is the explicit way to discard one (409)."""

    status = 409
    code = "session_has_history"


class SessionBusy(ArchiveError):
    """Replace refused while requests are queued or running: their workers would write into it (409)."""

    status = 409
    code = "session_busy"


@dataclass(frozen=True)
class RestoreResult:
    """What a restore did; the API returns it as JSON."""

    parent_id: str
    version: int
    restored: int
    replaced: int
    next_ordinal: int
    clear_version: int


async def _ordinals_of(tx: AsyncSession, session_id: uuid.UUID, ids: set[str]) -> dict[str, int]:
    """Request id → ordinal of the session's requests among ``ids`` (an error's ``superseded_by``);
    text that is no id (stored by a restore before ids were checked) names none."""
    valid = []
    for text_id in ids:
        with contextlib.suppress(ValueError):
            valid.append(uuid.UUID(text_id))
    if not valid:
        return {}
    rows = await fetch_all(tx, queries.request_ordinals, {"session_id": session_id, "ids": sorted(valid)})
    return {str(row["id"]): row["ordinal"] for row in rows}


async def export_archive(tx: AsyncSession, tenant: str, parent_id: str, version: int) -> dict[str, Any]:
    """Export the session's finished history as a version ``version`` archive (1, 2 or 3, as the route bounds
    it). The memory is read first (written while requests run): requests read later cover all it covers."""
    session_row = await find_session(tx, tenant, parent_id)
    if session_row is None:
        raise SessionNotFound(f"no session {parent_id!r}")
    exportable = [Status.SUCCEEDED] if version == 1 else sorted(TERMINAL)
    params = {"session_id": session_row.id, "statuses": [str(s) for s in exportable]}
    rows = await fetch_models(tx, RequestRow, queries.archive_requests, params)
    ordinal_of = await _ordinals_of(tx, session_row.id, superseding_ids(r.error for r in rows))
    handoffs = await fetch_all(tx, queries.archive_handoffs, {"session_id": session_row.id})
    archive = Archive(
        version=version,
        parent_id=parent_id,
        requests=tuple(_archived(r, ordinal_of) for r in rows),
        memory=complete_memory(session_row.memory),
        handoffs=tuple(ArchivedHandoff(h["created_at"], h["body"], h["through_ordinal"]) for h in handoffs),
        handed_off_through=session_row.handed_off_through,
        settings=session_row.settings,
    )
    return encode_archive(archive)


def _archived(row: RequestRow, ordinal_of: dict[str, int]) -> ArchivedRequest:
    values = {name: getattr(row, name) for name in QUESTION_FIELDS[3]}
    values["error"] = archived_error(row.error, ordinal_of)
    values["usage"] = row.usage or empty_usage()
    values["context_info"] = row.context_info or {}
    return ArchivedRequest(**values)


def _terminal_events(row: RequestRow, parent_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The two events a finished request ends its stream with: its terminal status, then done/error."""
    events: list[tuple[str, dict[str, Any]]] = [("status", {"status": row.status, "stage": row.stage})]
    if row.status == Status.SUCCEEDED:
        events.append(("done", {"record": request_record(row, parent_id)}))
    else:
        error = row.error or {}
        code, message = error.get("code", row.status), error.get("message", f"the request was {row.status}")
        events.append(("error", {"code": code, "message": message, "detail": error.get("detail") or {}}))
    return events


async def restore_archive(
    tx: AsyncSession, tenant: str, parent_id: str, archive: Archive, *, replace: bool = False
) -> RestoreResult:
    """Write ``archive`` into the session (tenant, parent_id), creating it if needed; a refusal
    (history without ``replace``, requests in flight) raises, and the caller's rollback undoes all."""
    session_row = await lock_or_create_session(tx, tenant, parent_id)
    counts = (await status_counts_of(tx, [session_row.id]))[session_row.id]
    existing = sum(counts.values())
    in_flight = sum(n for status, n in counts.items() if status not in TERMINAL)
    if existing and not replace:
        raise SessionHasHistory(
            f"session {parent_id!r} already has {existing} requests; "
            "restore with mode=replace to discard them, or restore under another parent id",
            {"requests": existing},
        )
    if in_flight:
        raise SessionBusy(
            f"session {parent_id!r} has {in_flight} queued or running requests; "
            "cancel them or clear the session before replacing its history",
            {"in_flight": in_flight},
        )

    clear_version = session_row.clear_version
    if replace and existing:
        # A clear, then the restore (docs/archive.md, "Restore" 2): clear_version bumped, so no summary
        # of the old history lands on the restored memory; the old requests hidden as a clear hides them.
        clear_version += 1
        await execute(tx, queries.hide_session_requests, {"session_id": session_row.id})
    ordinals = [r.ordinal for r in archive.requests]
    if ordinals:
        await execute(
            tx, queries.purge_cleared_ordinals, {"session_id": session_row.id, "ordinals": ordinals}
        )
    next_ordinal = max([session_row.next_ordinal, *(o + 1 for o in ordinals)])
    settings = None
    if archive.settings is not None:
        # Its set fields over the session's own; its null ones clear nothing (SPEC 11.2: only a PUT
        # clears a setting; docs/archive.md, "Hand-offs, settings and pins").
        written = {k: v for k, v in archive.settings.items() if v is not None}
        settings = json_text({**(session_row.settings or {}), **written})
    session_values = {
        "session_id": session_row.id,
        "memory": json_text(complete_memory(archive.memory)),
        "clear_version": clear_version,
        "next_ordinal": next_ordinal,
        "handed_off_through": archive.handed_off_through,
        "settings": settings,
    }
    await execute(tx, queries.restore_session, session_values)
    # Streams opened later hide the replaced history's session-level events (hand-offs, background summaries).
    await mark_session_events_cleared(tx, session_row.id)
    tx.add_all(
        HandoffRow(
            id=uuid.uuid4(),
            session_id=session_row.id,
            body=item.body,
            through_ordinal=item.through_ordinal,
            created_at=item.created_at,
        )
        for item in archive.handoffs
    )

    # Each request as the archive has it (a pin only on a succeeded one: the archive refuses another),
    # never run here: no stage, no attempt, its two terminal events.
    rows = [
        RequestRow(
            **{name: getattr(item, name) for name in QUESTION_FIELDS[3] if name != "usage"},
            usage=item.usage if item.usage is not None else empty_usage(),
            id=uuid.uuid4(),
            session_id=session_row.id,
            stage=None,
            options={},
            clear_version=clear_version,
            attempt=0,
            event_seq=2,
        )
        for item in archive.requests
    ]
    tx.add_all(rows)
    await tx.flush()

    if rows:
        # Same ordering rule as append_event: global event ids of a session are allocated under
        # its advisory lock. One NOTIFY is enough: it is a wake-up call, readers read the rows.
        await execute(tx, queries.lock_session_events, {"session_id": session_row.id})
        at = utc_iso()
        events = []
        for row in rows:
            for seq, (event_type, fields) in enumerate(_terminal_events(row, parent_id), start=1):
                data = {"request_id": str(row.id), "ordinal": row.ordinal, "seq": seq, "at": at, **fields}
                events.append(
                    EventRow(
                        request_id=row.id, session_id=session_row.id, seq=seq, type=event_type, data=data
                    )
                )
        tx.add_all(events)
        await tx.flush()
        payload = json.dumps(
            {"id": events[-1].id, "request_id": str(rows[-1].id), "session_id": str(session_row.id)}
        )
        await notify(tx, EVENTS_CHANNEL, payload)

    return RestoreResult(
        parent_id=parent_id,
        version=archive.version,
        restored=len(rows),
        replaced=existing if replace else 0,
        next_ordinal=next_ordinal,
        clear_version=clear_version,
    )
