"""the admission's NOTIFY transaction commits without waiting for a WAL flush

Revision ID: 0007_admit_notify_async
Revises: 0006_snapshot_lz4
Create Date: 2026-12-01 17:15:00

``sidequest_admit_now`` commits the admission's rows, then sends its notifications in a second
transaction (0003_h12a). That transaction writes nothing but its commit record, yet a transaction that
NOTIFYs is given an XID, so with ``synchronous_commit`` on it waited for its own fsync — while holding
the database-wide lock that orders notifications. A notification is never durable (a crash loses the
queue whatever the commit did), so that flush bought nothing: the notifying transaction now commits
with ``synchronous_commit = off`` (SET LOCAL, that transaction only). The rows' transaction is unchanged
and still waits for its flush before the 202.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007_admit_notify_async"
down_revision: str | None = "0006_snapshot_lz4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_HEAD = """
CREATE OR REPLACE PROCEDURE sidequest_admit_now(
    p_tenant text,
    p_parent_id text,
    p_request_id uuid,
    p_question text,
    p_snapshot_id text,
    p_options jsonb,
    p_model text,
    p_idempotency_key text,
    p_body_hash text,
    p_max_queued integer,
    p_on_busy text,
    p_superseded_message text,
    INOUT outcome text DEFAULT NULL,
    INOUT detail jsonb DEFAULT NULL,
    INOUT superseded uuid[] DEFAULT NULL,
    INOUT req side_question_requests DEFAULT NULL
) LANGUAGE plpgsql AS $fn$
DECLARE
    r record;
    v_notices text[];
    i integer;
BEGIN
    SELECT * INTO r FROM sidequest_admit(
        p_tenant, p_parent_id, p_request_id, p_question, p_snapshot_id, false, p_options, p_model,
        p_idempotency_key, p_body_hash, p_max_queued, p_on_busy, p_superseded_message, false);
    outcome := r.outcome;
    detail := r.detail;
    superseded := r.superseded;
    req := r.req;
    v_notices := r.notices;
    COMMIT;
"""
_TAIL = """
    FOR i IN 1 .. coalesce(array_length(v_notices, 1), 0) BY 2 LOOP
        PERFORM pg_notify(v_notices[i], v_notices[i + 1]);
    END LOOP;
END
$fn$;
"""
_ASYNC = "    PERFORM set_config('synchronous_commit', 'off', true);  -- this transaction only\n"


def upgrade() -> None:
    op.execute(_HEAD + _ASYNC + _TAIL)


def downgrade() -> None:
    op.execute(_HEAD + _TAIL)
