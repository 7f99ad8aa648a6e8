"""Sessions, history pages, request lookups and main snapshots: the read side of the API. Every lookup takes
the tenant, so another tenant's session or request is "not found" (SPEC §3: 404, never 403); so are requests
hidden by a clear (``deleted_at`` set).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy.ext.asyncio import AsyncSession

from service.archive.model import public_settings
from service.budget import plan_window, positive_setting, resolve_output_cap, resolve_window
from service.budget.ladder import needs_summary, snapshot_room
from service.budget.messages import snapshot_shape_problem
from service.budget.prepared import (
    PREPARED_VERSION,
    EncodedSnapshot,
    PreparedSnapshot,
    UnstorableSnapshot,
    encode_snapshot,
    prepare_snapshot,
)
from service.config import Settings
from service.errors import SidequestError
from service.store import queries
from service.store.execute import execute, fetch_all, fetch_models, fetch_one, fetch_value, json_text
from service.store.jobs import background_overviews, enqueue_job
from service.store.models import RequestRow, SessionRow
from service.store.records import request_record
from service.vocabulary import JobKind, Status, iso_or_none, masks_tool_results, utc_iso


class SnapshotConflict(SidequestError):
    """A snapshot id already holds other content (snapshots are immutable)."""

    code = "snapshot_conflict"
    status = 409


class InvalidSnapshot(SidequestError):
    """The snapshot cannot be read as a main-session context (the pipeline could never use it)."""

    code = "invalid_snapshot"
    status = 422


def prepare_or_refuse(content: dict[str, Any], encoded: EncodedSnapshot | None = None) -> PreparedSnapshot:
    """Prepare a snapshot once (:mod:`service.budget.prepared`), refusing (:class:`InvalidSnapshot`)
    one that does not normalise or no provider would take: better at admission than in the worker."""
    problem = snapshot_shape_problem(content)
    if problem is not None:
        raise InvalidSnapshot(f"snapshot is not a valid main-session context: {problem}")
    try:
        return prepare_snapshot(content, encoded)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise InvalidSnapshot(f"snapshot is not a valid main-session context: {exc}") from None


def encode_or_refuse(content: dict[str, Any]) -> EncodedSnapshot:
    """:func:`service.budget.prepared.encode_snapshot`, refusing (422 ``invalid_snapshot``) what
    PostgreSQL could not store or the pipeline could not use."""
    try:
        return encode_snapshot(content)
    except UnstorableSnapshot as exc:
        raise InvalidSnapshot(str(exc)) from None


async def find_session(tx: AsyncSession, tenant: str, parent_id: str) -> SessionRow | None:
    found = await fetch_models(
        tx, SessionRow, queries.find_session, {"tenant": tenant, "parent_id": parent_id}
    )
    return found[0] if found else None


async def lock_or_create_session(tx: AsyncSession, tenant: str, parent_id: str) -> SessionRow:
    """Get-or-create the session and lock its row for the caller's (short) transaction: it serialises
    the session's admissions, clears and restores. ``FOR NO KEY UPDATE``, never ``FOR UPDATE``, which
    deadlocks with a worker's event insert (docs/architecture.md, "Admission")."""
    await execute(tx, queries.create_session, {"tenant": tenant, "parent_id": parent_id})
    session_row = await lock_session(tx, tenant, parent_id)
    assert session_row is not None  # inserted or already there, and sessions are never deleted here
    return session_row


async def lock_session(tx: AsyncSession, tenant: str, parent_id: str) -> SessionRow | None:
    """:func:`lock_or_create_session` of an existing session; None when the tenant has none."""
    found = await fetch_models(
        tx, SessionRow, queries.lock_session, {"tenant": tenant, "parent_id": parent_id}
    )
    return found[0] if found else None


async def find_request(
    tx: AsyncSession, tenant: str, request_id: uuid.UUID
) -> tuple[RequestRow, SessionRow] | None:
    """A visible (not cleared) request of the tenant, with its session; None otherwise."""
    found = await fetch_models(
        tx, RequestRow, queries.find_request, {"tenant": tenant, "request_id": request_id}
    )
    if not found:
        return None
    session_row = await tx.get(SessionRow, found[0].session_id)
    assert session_row is not None  # the request's foreign key
    return found[0], session_row


async def request_record_for(tx: AsyncSession, tenant: str, request_id: uuid.UUID) -> dict[str, Any] | None:
    """The public record of a visible request of the tenant, or None."""
    found = await find_request(tx, tenant, request_id)
    return None if found is None else request_record(found[0], found[1].parent_id)


async def status_counts_of(tx: AsyncSession, session_ids: list[uuid.UUID]) -> dict[uuid.UUID, dict[str, int]]:
    """Visible requests of each session by status (every status present, 0 when none), in one query."""
    result: dict[uuid.UUID, dict[str, int]] = {sid: dict.fromkeys(Status, 0) for sid in session_ids}
    if session_ids:
        for row in await fetch_all(tx, queries.status_counts, {"session_ids": session_ids}):
            result[row["session_id"]][row["status"]] = int(row["n"])
    return result


# SPEC's memory overview: of each summary, its coverage and cache key with their types, never the
# document (a field of another type, or missing, is null).
_QA_SUMMARY_VIEW = {"first_ordinal": int, "covered_through_ordinal": int, "tokens": int, "updated_at": str}
_CONTEXT_SUMMARY_VIEW = {
    "key": str,
    "snapshot_id": str,
    "covered_messages": int,
    "tokens": int,
    "created_at": str,
}


def _view(item: dict[str, Any], fields: dict[str, type]) -> dict[str, Any]:
    return {
        name: value if isinstance(value := item.get(name), kind) and not isinstance(value, bool) else None
        for name, kind in fields.items()
    }


def memory_overview(memory: dict[str, Any]) -> dict[str, Any]:
    qa = memory.get("qa_summary")
    summaries = memory.get("context_summaries") or []
    return {
        "qa_summary": _view(qa, _QA_SUMMARY_VIEW) if isinstance(qa, dict) else None,
        "context_summaries": [
            _view(item, _CONTEXT_SUMMARY_VIEW) for item in summaries if isinstance(item, dict)
        ],
    }


async def read_one_snapshot(tx: AsyncSession) -> None:
    """Make ``tx``'s next transaction read one snapshot (under READ COMMITTED an admission committing
    between a session row's read and its counts' showed counts beyond ``next_ordinal``)."""
    if not tx.in_transaction():
        await tx.connection(execution_options={"isolation_level": "REPEATABLE READ"})


async def session_overview(tx: AsyncSession, tenant: str, parent_id: str) -> dict[str, Any] | None:
    """SPEC's session object, its parts read from one snapshot; None when the tenant has no such session."""
    await read_one_snapshot(tx)
    session_row = await find_session(tx, tenant, parent_id)
    return None if session_row is None else (await session_overviews(tx, [session_row]))[0]


async def session_overviews(tx: AsyncSession, session_rows: list[SessionRow]) -> list[dict[str, Any]]:
    """SPEC's session object for each of ``session_rows``, in their order (the one builder of it),
    with one query per kind of data, never one per session."""
    ids = [session_row.id for session_row in session_rows]
    counts = await status_counts_of(tx, ids)
    background = await background_overviews(tx, ids)
    return [
        {
            "parent_id": session_row.parent_id,
            "clear_version": session_row.clear_version,
            "next_ordinal": session_row.next_ordinal,
            "handed_off_through": session_row.handed_off_through,
            "settings": public_settings(session_row.settings),
            "counts": counts[session_row.id],
            "background": background[session_row.id],
            "memory": memory_overview(session_row.memory),
            "created_at": iso_or_none(session_row.created_at),
            "updated_at": iso_or_none(session_row.updated_at),
        }
        for session_row in session_rows
    ]


async def history_page(
    tx: AsyncSession, tenant: str, parent_id: str, *, limit: int, before: int | None
) -> dict[str, Any] | None:
    """The newest ``limit`` visible requests below ordinal ``before``, ascending; None: no such session."""
    session_row = await find_session(tx, tenant, parent_id)
    if session_row is None:
        return None
    params = {"session_id": session_row.id, "before": before, "limit": limit + 1}
    rows = await fetch_models(tx, RequestRow, queries.request_page, params)
    has_more = len(rows) > limit
    page = list(reversed(rows[:limit]))
    return {
        "items": [request_record(r, session_row.parent_id) for r in page],
        "has_more": has_more,
        "next_before": page[0].ordinal if has_more and page else None,
    }


@dataclass(frozen=True)
class SnapshotJobPolicy:
    """When storing a snapshot queues a background context summary (SPEC §6.6, second trigger). The
    window and cap are the service's defaults, after the session's and the snapshot's (SPEC §5).
    ``expecting`` is told of a snapshot whose job will be queued before it is written (``sidequest
    serve``: this process's worker renders the summary's material meanwhile)."""

    enabled: bool
    context_window: int | None
    max_output_tokens: int
    expecting: Callable[[PreparedSnapshot], None] | None = None

    @classmethod
    def of(
        cls, settings: Settings, expecting: Callable[[PreparedSnapshot], None] | None = None
    ) -> SnapshotJobPolicy:
        """The service's part, from its settings (the session's come from its row)."""
        return cls(settings.background_on, settings.context_window, settings.max_output_tokens, expecting)

    def needs_summary(
        self, prepared: PreparedSnapshot, session_row: SessionRow, expected: dict[str, int]
    ) -> bool:
        """Would a question on this snapshot need a summary (tier 2: masking needs none), with the
        session's expected numbers? The snapshot alone, raw estimate: the question and the side Q&A
        only add to it, and the job decides again (calibrated) and ends with no call if unneeded."""
        window = resolve_window(
            expected.get("context_window"), prepared.snapshot.context_window, self.context_window
        )
        cap = resolve_output_cap(
            expected.get("max_output_tokens"), self.max_output_tokens, prepared.snapshot.max_output_tokens
        )
        room = snapshot_room(prepared, plan_window(window, cap).input_budget)
        return needs_summary(prepared, room, mask=masks_tool_results(session_row.settings or {}))


def expected_numbers(
    session_settings: dict[str, Any], latest_options: dict[str, Any] | None
) -> dict[str, int]:
    """SPEC §6.6: the window and output cap a question on a newly stored snapshot is expected to have —
    the session's settings, else those of the session's latest question (a chat UI that sends its
    model's window with every question and never writes settings), else none."""
    expected: dict[str, int] = {}
    for name in ("context_window", "max_output_tokens"):
        value = positive_setting(session_settings.get(name)) or positive_setting(
            (latest_options or {}).get(name)
        )
        if value is not None:
            expected[name] = value
    return expected


@dataclass(frozen=True)
class StoredSnapshot:
    """What a snapshot write or read reports back (never the content itself): the API's answer."""

    snapshot_id: str
    content_hash: str
    token_estimate: int
    size_bytes: int
    created_at: str
    created: bool


def posted_json(content: dict[str, Any], encoded: EncodedSnapshot) -> str:
    """``content`` as compact JSON text in its posted key order, for the ``json`` column: orjson
    writes 600 KB in ~1 ms where ``json.dumps`` takes ~8 ms (on the inline admission's path). The same
    JSON value, not always the same bytes (``1e16`` for ``1e+16``); an encoded snapshot holds no
    non-finite number (orjson would write null)."""
    try:
        return orjson.dumps(content).decode("utf-8")
    except TypeError:  # orjson.JSONEncodeError: an integer beyond 64 bits, say
        return json_text(content)


async def store_snapshot(
    tx: AsyncSession,
    session_row: SessionRow,
    snapshot_id: str | None,
    content: dict[str, Any],
    *,
    jobs: SnapshotJobPolicy | None = None,
    encoded: EncodedSnapshot | None = None,
    prepared: PreparedSnapshot | None = None,
) -> StoredSnapshot:
    """Store ``content`` under ``snapshot_id`` (or its content hash); idempotent for identical content, else
    :class:`SnapshotConflict`. Given a ``jobs`` policy, a new snapshot may queue its background context
    summary (SPEC §6.6). ``encoded`` / ``prepared``: the caller's own (the API needs them first), so a 600 KB
    snapshot is serialised once, not five times."""
    if encoded is None:
        encoded = encode_or_refuse(content)
    digest = encoded.content_hash
    key = snapshot_id or digest
    if prepared is None:
        prepared = prepare_or_refuse(content, encoded)
    tokens = prepared.total_tokens
    expected: dict[str, int] = {}
    queues_job = False
    # Weighed for a job at all (SPEC §6.6): background summaries on and the session asked before.
    if jobs is not None and jobs.enabled and session_row.next_ordinal > 1:
        latest = await fetch_value(tx, queries.latest_question_options, {"session_id": session_row.id})
        expected = expected_numbers(dict(session_row.settings or {}), latest)
        queues_job = jobs.needs_summary(prepared, session_row, expected)
        if queues_job and jobs.expecting is not None:
            jobs.expecting(prepared)  # before the INSERT: the longest wait of the admission
    inserted = await fetch_value(
        tx,
        queries.insert_snapshot,
        {
            "session_id": session_row.id,
            "snapshot_id": key,
            "content": posted_json(content, encoded),
            "content_hash": digest,
            "token_estimate": tokens,
            "size_bytes": encoded.size,
            "prepared": prepared.to_json_text(encoded),
            "prepared_version": PREPARED_VERSION,
        },
    )
    if inserted is not None:
        if queues_job:
            await enqueue_job(
                tx,
                session_row.id,
                kind=JobKind.CONTEXT_SUMMARY,
                key=f"snapshot:{key}",
                params={"snapshot_id": key, **expected},
                clear_version=session_row.clear_version,
            )
        return StoredSnapshot(key, digest, tokens, encoded.size, utc_iso(inserted), created=True)
    existing = await fetch_one(
        tx, queries.stored_snapshot, {"session_id": session_row.id, "snapshot_id": key}
    )
    assert existing is not None
    if existing["content_hash"] != digest:
        raise SnapshotConflict(f"snapshot {key!r} already exists with other content", {"snapshot_id": key})
    return StoredSnapshot(
        key,
        digest,
        existing["token_estimate"],
        existing["size_bytes"],
        utc_iso(existing["created_at"]),
        created=False,
    )
