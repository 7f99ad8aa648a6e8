"""one event in one round trip: the sidequest_append_event() SQL function

Revision ID: 0004_append_event
Revises: 0003_h12a
Create Date: 2026-12-01 12:40:00

A request event was four round trips through the ORM (bump the request's ``seq``, take the session's
event lock, insert the row with a flush, NOTIFY): on a 0.5 s answer, 60 % of the worker's own CPU
(docs/benchmarks.md, "Where the time went"). The function does the same statements, in the same order
— the session's advisory lock is taken before the row's global id is drawn, so a session stream never
sees a later id commit before an earlier one — in one call, inside the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004_append_event"
down_revision: str | None = "0003_h12a"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

APPEND_EVENT = r"""
CREATE OR REPLACE FUNCTION sidequest_append_event(
    p_request_id uuid,
    p_type text,
    p_fields jsonb,   -- the event's own fields; the envelope (request_id, ordinal, seq, at) is added
    p_at text         -- the envelope's ``at`` (ISO 8601 UTC with microseconds, as the caller formats it)
) RETURNS TABLE (event_id bigint, session_id uuid, seq integer, ordinal integer)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_seq integer;
    v_sid uuid;
    v_ordinal integer;
    v_id bigint;
BEGIN
    UPDATE side_question_requests r SET event_seq = r.event_seq + 1
     WHERE r.id = p_request_id
    RETURNING r.event_seq, r.session_id, r.ordinal INTO v_seq, v_sid, v_ordinal;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'request % does not exist', p_request_id USING ERRCODE = 'no_data_found';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended(v_sid::text, 7));
    INSERT INTO side_question_events (request_id, session_id, seq, type, data)
    VALUES (
        p_request_id, v_sid, v_seq, p_type,
        jsonb_build_object('request_id', p_request_id::text, 'ordinal', v_ordinal, 'seq', v_seq, 'at', p_at)
            || p_fields
    )
    RETURNING id INTO v_id;
    PERFORM pg_notify(
        'sidequest_events',
        json_build_object('id', v_id, 'request_id', p_request_id::text, 'session_id', v_sid::text)::text
    );
    RETURN QUERY SELECT v_id, v_sid, v_seq, v_ordinal;
END
$fn$;
"""


def upgrade() -> None:
    op.execute(APPEND_EVENT)


def downgrade() -> None:
    op.execute("DROP FUNCTION IF EXISTS sidequest_append_event")
