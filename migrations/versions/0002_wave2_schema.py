"""wave 2 schema: jobs, hand-offs, calibration, settings, pins, prepared snapshots, session events

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 08:46:12.855750
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sidequest_calibration",
        sa.Column("provider", sa.String(length=40), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("samples", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("sum_estimate", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("sum_provider", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("provider", "model", name=op.f("pk_sidequest_calibration")),
    )
    op.create_table(
        "side_question_handoffs",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("session_id", sa.UUID(), nullable=False),
        sa.Column("body", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("through_ordinal", sa.Integer(), nullable=True),
        sa.Column("idempotency_key", sa.String(length=300), nullable=True),
        sa.Column("body_hash", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["side_question_sessions.id"],
            name=op.f("fk_side_question_handoffs_session_id_side_question_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_side_question_handoffs")),
    )
    op.create_index(
        "ix_handoffs_session", "side_question_handoffs", ["session_id", "created_at"], unique=False
    )
    op.create_index(
        "uq_handoffs_idempotency",
        "side_question_handoffs",
        ["session_id", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.create_table(
        "side_question_jobs",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("session_id", sa.UUID(), nullable=False),
        sa.Column("kind", sa.String(length=40), nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column(
            "params",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("status", sa.String(length=20), server_default=sa.text("'queued'"), nullable=False),
        sa.Column("clear_version", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("calls", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("covered", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column(
            "usage",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text(
                '\'{"input_tokens": 0, "output_tokens": 0, "reasoning_tokens": 0, "cached_tokens": 0, "calls": []}\'::jsonb'
            ),
            nullable=False,
        ),
        sa.Column("error", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("lease_owner", sa.String(length=200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["side_question_sessions.id"],
            name=op.f("fk_side_question_jobs_session_id_side_question_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_side_question_jobs")),
    )
    op.create_index(
        "ix_jobs_queued",
        "side_question_jobs",
        ["created_at"],
        unique=False,
        postgresql_where=sa.text("status = 'queued'"),
    )
    op.create_index(
        "ix_jobs_running_lease",
        "side_question_jobs",
        ["lease_expires_at"],
        unique=False,
        postgresql_where=sa.text("status = 'running'"),
    )
    op.create_index("ix_jobs_session", "side_question_jobs", ["session_id", "created_at"], unique=False)
    op.create_index(
        "uq_jobs_active",
        "side_question_jobs",
        ["session_id", "kind", "key"],
        unique=True,
        postgresql_where=sa.text("status IN ('queued', 'running')"),
    )
    op.add_column(
        "main_snapshots", sa.Column("prepared", sa.JSON(), nullable=True)
    )
    op.add_column("main_snapshots", sa.Column("prepared_version", sa.Integer(), nullable=True))
    op.alter_column("side_question_events", "request_id", existing_type=sa.UUID(), nullable=True)
    op.alter_column("side_question_events", "seq", existing_type=sa.INTEGER(), nullable=True)
    op.add_column(
        "side_question_requests",
        sa.Column("pinned", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.add_column("side_question_requests", sa.Column("qa_tokens", sa.Integer(), nullable=True))
    op.add_column(
        "side_question_sessions",
        sa.Column(
            "settings",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
    )
    op.add_column(
        "side_question_sessions",
        sa.Column("handed_off_through", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.create_index(
        "ix_sessions_tenant_activity", "side_question_sessions", ["tenant", "updated_at", "id"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_sessions_tenant_activity", table_name="side_question_sessions")
    op.drop_column("side_question_sessions", "handed_off_through")
    op.drop_column("side_question_sessions", "settings")
    op.drop_column("side_question_requests", "qa_tokens")
    op.drop_column("side_question_requests", "pinned")
    # Session-level events (memory, handoff) have no request: they cannot survive the old schema.
    op.execute("DELETE FROM side_question_events WHERE request_id IS NULL OR seq IS NULL")
    op.alter_column("side_question_events", "seq", existing_type=sa.INTEGER(), nullable=False)
    op.alter_column("side_question_events", "request_id", existing_type=sa.UUID(), nullable=False)
    op.drop_column("main_snapshots", "prepared_version")
    op.drop_column("main_snapshots", "prepared")
    op.drop_index(
        "uq_jobs_active",
        table_name="side_question_jobs",
        postgresql_where=sa.text("status IN ('queued', 'running')"),
    )
    op.drop_index("ix_jobs_session", table_name="side_question_jobs")
    op.drop_index(
        "ix_jobs_running_lease",
        table_name="side_question_jobs",
        postgresql_where=sa.text("status = 'running'"),
    )
    op.drop_index(
        "ix_jobs_queued", table_name="side_question_jobs", postgresql_where=sa.text("status = 'queued'")
    )
    op.drop_table("side_question_jobs")
    op.drop_index(
        "uq_handoffs_idempotency",
        table_name="side_question_handoffs",
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.drop_index("ix_handoffs_session", table_name="side_question_handoffs")
    op.drop_table("side_question_handoffs")
    op.drop_table("sidequest_calibration")
