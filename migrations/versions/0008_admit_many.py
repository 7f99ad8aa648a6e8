"""group commit for admissions: sidequest_admit_many admits several questions in one CALL

Revision ID: 0008_admit_many
Revises: 0007_admit_notify_async
Create Date: 2026-12-01 19:40:00

Under load, most of an admission's database CPU is what every CALL pays whatever it does: the round
trip, the procedure call, a commit that waits for its WAL flush, the second transaction that sends
the NOTIFYs (0003_h12a, 0007). Measured on this machine with 10 connections: ~210 µs of backend CPU
per ``CALL sidequest_admit_now``; the same admissions 5 to a CALL ~120 µs each, 10–20 to a CALL
~90 µs each. So an API process that has several admissions waiting sends them in one CALL
(``service.store.admission``; one admission alone still takes ``sidequest_admit_now``).

Each admission is exactly ``sidequest_admit()`` (0003_h12a), called in turn: every rule, refusal
and event stays in that one function. Refusals are returned per admission, never raised, so one
admission's refusal cannot undo another's. The caller orders the admissions by (tenant, parent_id)
— keeping arrival order within a session — so that two batches lock sessions in the same order and
cannot deadlock. Everything commits once; the notifications then go out in one transaction that
does not wait for a flush (as in 0007).

Results are arrays aligned with the inputs; ``superseded`` is a JSON array of request ids per
admission (a two-dimensional uuid array cannot be ragged).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008_admit_many"
down_revision: str | None = "0007_admit_notify_async"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ADMIT_MANY = r"""
CREATE OR REPLACE PROCEDURE sidequest_admit_many(
    p_tenant text[],
    p_parent_id text[],
    p_request_id uuid[],
    p_question text[],
    p_snapshot_id text[],
    p_options jsonb[],
    p_model text[],
    p_idempotency_key text[],
    p_body_hash text[],
    p_max_queued integer[],
    p_on_busy text[],
    p_superseded_message text,
    INOUT outcome text[] DEFAULT NULL,
    INOUT detail jsonb[] DEFAULT NULL,
    INOUT superseded jsonb[] DEFAULT NULL,
    INOUT req side_question_requests[] DEFAULT NULL
) LANGUAGE plpgsql AS $fn$
DECLARE
    r record;
    v_notices text[] := '{}';
    i integer;
BEGIN
    outcome := '{}';
    detail := '{}';
    superseded := '{}';
    req := '{}';
    FOR i IN 1 .. coalesce(array_length(p_tenant, 1), 0) LOOP
        r := sidequest_admit(
            p_tenant[i], p_parent_id[i], p_request_id[i], p_question[i], p_snapshot_id[i], false,
            p_options[i], p_model[i], p_idempotency_key[i], p_body_hash[i], p_max_queued[i],
            p_on_busy[i], p_superseded_message, false);
        outcome := outcome || r.outcome;
        detail := detail || r.detail;
        superseded := superseded || to_jsonb(r.superseded);
        req := req || r.req;
        v_notices := v_notices || r.notices;
    END LOOP;
    COMMIT;
    PERFORM set_config('synchronous_commit', 'off', true);  -- this transaction only (see 0007)
    PERFORM pg_notify(v_notices[j], v_notices[j + 1])
       FROM generate_series(1, coalesce(array_length(v_notices, 1), 0), 2) AS j;
END
$fn$;
"""


def upgrade() -> None:
    op.execute(ADMIT_MANY)


def downgrade() -> None:
    op.execute("DROP PROCEDURE IF EXISTS sidequest_admit_many")
