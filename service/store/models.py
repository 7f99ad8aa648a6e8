"""ORM models: the tables of SPEC §2, typed with SQLAlchemy 2. Every timestamp is ``timestamptz`` and set by
PostgreSQL (``now()``) or by the store in UTC.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any, ClassVar, Final

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, MappedColumn, mapped_column

# Stable constraint names so that Alembic autogenerate and downgrade agree.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def empty_memory() -> dict[str, Any]:
    """A session's memory before any summary; a new dict (and list) per call: filling one changes no other."""
    return {"qa_summary": None, "context_summaries": []}


def complete_memory(stored: dict[str, Any] | None) -> dict[str, Any]:
    """A stored memory (a session's, an archive's), missing parts empty as a fresh one's, other keys kept."""
    return {**empty_memory(), **(stored or {})}


def empty_usage() -> dict[str, Any]:
    """A usage object with nothing spent (SPEC §3): a new row's, and a record's when its row has none.
    A new dict (and list) per call, like :func:`empty_memory`."""
    return {"input_tokens": 0, "output_tokens": 0, "reasoning_tokens": 0, "cached_tokens": 0, "calls": []}


class Base(DeclarativeBase):
    # A column's type follows its annotation, and ``Mapped[X | None]`` alone makes it nullable.
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: DateTime(timezone=True),
        uuid.UUID: UUID(as_uuid=True),
        dict[str, Any]: JSONB,
        str: Text,
    }


def _now() -> MappedColumn[Any]:
    return mapped_column(server_default=func.now())


def _session_id(**options: Any) -> MappedColumn[Any]:
    return mapped_column(ForeignKey("side_question_sessions.id", ondelete="CASCADE"), **options)


_EMPTY_USAGE = text(f"'{json.dumps(empty_usage())}'::jsonb")


class SessionRow(Base):
    """One side-question session per (tenant, parent_id)."""

    __tablename__ = "side_question_sessions"
    __table_args__ = (
        UniqueConstraint("tenant", "parent_id", name="uq_sessions_tenant_parent"),
        # GET /v1/sessions: the tenant's sessions, most recently active first (keyset pagination).
        Index("ix_sessions_tenant_activity", "tenant", "updated_at", "id"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant: Mapped[str] = mapped_column(String(200))
    parent_id: Mapped[str] = mapped_column(String(500))
    clear_version: Mapped[int] = mapped_column(server_default=text("0"))
    next_ordinal: Mapped[int] = mapped_column(server_default=text("1"))
    memory: Mapped[dict[str, Any]] = mapped_column(
        server_default=text(f"'{json.dumps(empty_memory())}'::jsonb")
    )
    # Per-session settings (SPEC §11.2): every field optional; unset fields are absent or null.
    settings: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    # Highest ordinal handed back to the main conversation (SPEC §11.1); never moves down, 0 after a clear.
    handed_off_through: Mapped[int] = mapped_column(server_default=text("0"))
    # Round-robin fairness (SPEC §9): the session that last started a request longest ago goes first.
    last_started_at: Mapped[datetime | None]
    # The last clear or archive restore (migration 0010): session-level events up to this id belong to
    # the history it replaced, hidden from session streams opened after ``cleared_at``.
    cleared_at: Mapped[datetime | None]
    cleared_through_event: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = _now()
    updated_at: Mapped[datetime] = _now()


class RequestRow(Base):
    """One side question and everything that happened to it."""

    __tablename__ = "side_question_requests"
    __table_args__ = (
        UniqueConstraint("session_id", "ordinal", name="uq_requests_session_ordinal"),
        # The queue: oldest queued first; partial so it stays small.
        Index(
            "ix_requests_queued",
            "session_id",
            "ordinal",
            postgresql_where=text("status = 'queued' AND deleted_at IS NULL"),
        ),
        Index("ix_requests_running_lease", "lease_expires_at", postgresql_where=text("status = 'running'")),
        Index(
            "uq_requests_idempotency",
            "session_id",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL AND deleted_at IS NULL"),
        ),
        Index("ix_requests_deleted", "deleted_at", postgresql_where=text("deleted_at IS NOT NULL")),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    session_id: Mapped[uuid.UUID] = _session_id()
    ordinal: Mapped[int]
    question: Mapped[str]
    snapshot_id: Mapped[str | None] = mapped_column(String(500))
    status: Mapped[str] = mapped_column(String(20), server_default=text("'queued'"))
    stage: Mapped[str | None] = mapped_column(String(40))
    answer: Mapped[str | None]
    truncated: Mapped[bool] = mapped_column(server_default=text("false"))
    stop_reason: Mapped[str | None] = mapped_column(String(60))
    error: Mapped[dict[str, Any] | None]
    usage: Mapped[dict[str, Any]] = mapped_column(server_default=_EMPTY_USAGE)
    context_info: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    # The options the request was admitted with (model, context_window, max_output_tokens, …).
    options: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    clear_version: Mapped[int]
    model: Mapped[str | None] = mapped_column(String(200))
    attempt: Mapped[int] = mapped_column(server_default=text("0"))
    # The last event seq handed out; bumped with UPDATE … RETURNING so seqs never collide.
    event_seq: Mapped[int] = mapped_column(server_default=text("0"))
    idempotency_key: Mapped[str | None] = mapped_column(String(300))
    body_hash: Mapped[str | None] = mapped_column(String(64))
    cancel_requested: Mapped[bool] = mapped_column(server_default=text("false"))
    # Pinned for the next hand-off (SPEC §11.1); only a succeeded request can be pinned.
    pinned: Mapped[bool] = mapped_column(server_default=text("false"))
    # SPEC §5 estimate of its rendered Q&A group, stored on success so organizing_history never re-encodes it.
    qa_tokens: Mapped[int | None]
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    # A clear hides requests at once (404) and a sweep purges them later, so that streams
    # already open can still read their final `cancelled` events (docs/architecture.md).
    deleted_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = _now()
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class EventRow(Base):
    """One event; ``id`` is global and increasing, ``seq`` per request. A session-level event
    (``memory``, ``handoff``) has no request: ``request_id`` and ``seq`` are NULL."""

    __tablename__ = "side_question_events"
    __table_args__ = (
        UniqueConstraint("request_id", "seq", name="uq_events_request_seq"),
        Index("ix_events_session_id", "session_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    request_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("side_question_requests.id", ondelete="CASCADE")
    )
    session_id: Mapped[uuid.UUID] = _session_id()
    seq: Mapped[int | None]
    type: Mapped[str] = mapped_column(String(20))
    data: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = _now()


class SnapshotRow(Base):
    """An immutable main-session snapshot. ``content`` keeps the JSON exactly as posted (key order too)."""

    __tablename__ = "main_snapshots"

    session_id: Mapped[uuid.UUID] = _session_id(primary_key=True)
    snapshot_id: Mapped[str] = mapped_column(String(500), primary_key=True)
    content: Mapped[dict[str, Any]] = mapped_column(JSON)
    content_hash: Mapped[str] = mapped_column(String(64))
    token_estimate: Mapped[int]
    size_bytes: Mapped[int]
    # The snapshot prepared once when stored: normalised messages, per-message estimates,
    # groups. ``prepared_version`` names the format, so a change of the estimator can recompute it.
    # JSON (text), not JSONB: it is only ever read whole, and text costs PostgreSQL no parsing.
    prepared: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prepared_version: Mapped[int | None]
    created_at: Mapped[datetime] = _now()


class JobRow(Base):
    """A background summary job (SPEC §6.6) or a request's single-flight registration
    (:mod:`service.store.jobs`); ``uq_jobs_active`` keeps one active per (session, kind, key)."""

    __tablename__ = "side_question_jobs"
    __table_args__ = (
        Index(
            "uq_jobs_active",
            "session_id",
            "kind",
            "key",
            unique=True,
            postgresql_where=text("status IN ('queued', 'running')"),
        ),
        Index("ix_jobs_queued", "created_at", postgresql_where=text("status = 'queued'")),
        Index("ix_jobs_running_lease", "lease_expires_at", postgresql_where=text("status = 'running'")),
        Index("ix_jobs_session", "session_id", "created_at"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    session_id: Mapped[uuid.UUID] = _session_id()
    kind: Mapped[str] = mapped_column(String(40))
    key: Mapped[str] = mapped_column(String(200))
    # What the job needs to run (snapshot id, ordinal range, model, …).
    params: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    status: Mapped[str] = mapped_column(String(20), server_default=text("'queued'"))
    clear_version: Mapped[int]
    attempt: Mapped[int] = mapped_column(server_default=text("0"))
    calls: Mapped[int] = mapped_column(server_default=text("0"))
    # What the finished job covers (e.g. {"covered_messages": n} or {"covered_through_ordinal": n}).
    covered: Mapped[dict[str, Any] | None]
    usage: Mapped[dict[str, Any]] = mapped_column(server_default=_EMPTY_USAGE)
    error: Mapped[dict[str, Any] | None]
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = _now()
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class HandoffRow(Base):
    """One hand-off of side findings back to the main conversation (SPEC §11.1)."""

    __tablename__ = "side_question_handoffs"
    __table_args__ = (
        Index("ix_handoffs_session", "session_id", "created_at"),
        Index(
            "uq_handoffs_idempotency",
            "session_id",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    session_id: Mapped[uuid.UUID] = _session_id()
    # The whole public hand-off object as returned by POST (SPEC §11.1), minus id/parent_id.
    body: Mapped[dict[str, Any]]
    through_ordinal: Mapped[int | None]
    idempotency_key: Mapped[str | None] = mapped_column(String(300))
    body_hash: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = _now()


# The calibration key's sizes (service.store.calibration cuts longer names to them).
CALIBRATION_PROVIDER_CHARS: Final = 40
CALIBRATION_MODEL_CHARS: Final = 200


class CalibrationRow(Base):
    """Calibration counters per (provider, model), shared by every process and tenant (SPEC §5.1)."""

    __tablename__ = "sidequest_calibration"

    provider: Mapped[str] = mapped_column(String(CALIBRATION_PROVIDER_CHARS), primary_key=True)
    model: Mapped[str] = mapped_column(String(CALIBRATION_MODEL_CHARS), primary_key=True)
    samples: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    sum_estimate: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    sum_provider: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    updated_at: Mapped[datetime] = _now()
