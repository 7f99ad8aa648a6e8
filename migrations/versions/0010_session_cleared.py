"""the session remembers where its last clear cut its session-level events

Revision ID: 0010_session_cleared
Revises: 0009_claim_job
Create Date: 2026-12-02 00:40:00

A clear (or an archive restore) replaces a session's history. Its requests are hidden at once
(``deleted_at``) so that a session stream opened afterwards does not replay them, while one that
resumes still gets every event after its cursor. Session-level events (``memory``, ``handoff``: no
request) had no such mark, and a fresh session stream replayed the old history's hand-offs.
``cleared_through_event`` is the highest session-level event id of the history
replaced, ``cleared_at`` when: the same visibility rule as a request's ``deleted_at``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_session_cleared"
down_revision: str | None = "0009_claim_job"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "side_question_sessions", sa.Column("cleared_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column(
        "side_question_sessions", sa.Column("cleared_through_event", sa.BigInteger(), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("side_question_sessions", "cleared_through_event")
    op.drop_column("side_question_sessions", "cleared_at")
