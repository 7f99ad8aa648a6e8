"""admission in one round trip: the sidequest_admit() SQL function

Revision ID: 0003_h12a
Revises: 0002
Create Date: 2026-12-01 09:10:00

One call does what admission used to do in a dozen ORM round trips: lock (or create) the session,
answer an idempotent replay, apply on_busy (SPEC 11.2) and the queue limit, check a named snapshot,
cancel the requests an ``interrupt`` supersedes, take the ordinal, insert the request and its events,
and NOTIFY. Refusals are returned (``outcome``), not raised, and every check runs before the first
write, so a refusal leaves nothing behind — not even the session a first request would have created.
``alembic check`` does not compare functions: tests/store/test_admission_statement.py calls it.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003_h12a"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ADMIT = r"""
CREATE OR REPLACE FUNCTION sidequest_admit(
    p_tenant text,
    p_parent_id text,
    p_request_id uuid,
    p_question text,
    p_snapshot_id text,
    p_snapshot_stored boolean,   -- true: the caller stored the (inline) snapshot in this transaction
    p_options jsonb,
    p_model text,
    p_idempotency_key text,
    p_body_hash text,
    p_max_queued integer,
    p_on_busy text,              -- null: the session's settings->>'on_busy', else 'enqueue'
    p_superseded_message text,
    OUT outcome text,            -- created | replay | idempotency_conflict | session_busy
                                 -- | queue_full | snapshot_missing
    OUT detail jsonb,
    OUT superseded uuid[],       -- requests an interrupt cancelled, in ordinal order
    OUT req side_question_requests
) LANGUAGE plpgsql AS $fn$
DECLARE
    s side_question_sessions%ROWTYPE;
    v_on_busy text;
    v_queued integer;
    v_running integer;
    v_ordinal integer;
    v_event_id bigint;
    v_at text;
    v_ids uuid[];
    v_ordinals integer[];
    v_stages text[];
    v_seqs integer[];
    i integer;
BEGIN
    superseded := '{}';
    -- NO KEY UPDATE, not UPDATE: a worker appending an event holds the session's event advisory
    -- lock and inserts a row whose foreign key takes KEY SHARE on this row (see sessions.py).
    SELECT * INTO s FROM side_question_sessions
     WHERE tenant = p_tenant AND parent_id = p_parent_id
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        -- A session that does not exist has no snapshot: refuse before creating it.
        IF p_snapshot_id IS NOT NULL AND NOT p_snapshot_stored THEN
            outcome := 'snapshot_missing';
            RETURN;
        END IF;
        INSERT INTO side_question_sessions (id, tenant, parent_id)
        VALUES (gen_random_uuid(), p_tenant, p_parent_id)
        ON CONFLICT ON CONSTRAINT uq_sessions_tenant_parent DO NOTHING;
        -- Ours, or one a concurrent first request just committed: lock it either way. A session
        -- created here has no requests, so none of the refusals below can apply to it.
        SELECT * INTO s FROM side_question_sessions
         WHERE tenant = p_tenant AND parent_id = p_parent_id
           FOR NO KEY UPDATE;
    END IF;

    -- An idempotent replay answers before any limit or on_busy applies.
    IF p_idempotency_key IS NOT NULL THEN
        SELECT * INTO req FROM side_question_requests
         WHERE session_id = s.id AND idempotency_key = p_idempotency_key AND deleted_at IS NULL;
        IF FOUND THEN
            IF req.body_hash IS DISTINCT FROM p_body_hash THEN
                req := NULL;
                outcome := 'idempotency_conflict';
            ELSE
                outcome := 'replay';
            END IF;
            RETURN;
        END IF;
    END IF;

    v_on_busy := coalesce(p_on_busy, s.settings->>'on_busy', 'enqueue');
    IF v_on_busy NOT IN ('enqueue', 'reject', 'interrupt') THEN
        v_on_busy := 'enqueue';
    END IF;
    SELECT count(*) INTO v_queued FROM side_question_requests
     WHERE session_id = s.id AND status = 'queued' AND deleted_at IS NULL;
    IF v_on_busy = 'reject' THEN
        SELECT count(*) INTO v_running FROM side_question_requests
         WHERE session_id = s.id AND status = 'running' AND deleted_at IS NULL;
        IF v_queued + v_running > 0 THEN
            outcome := 'session_busy';
            detail := jsonb_build_object('queued', v_queued, 'running', v_running);
            RETURN;
        END IF;
    ELSIF v_on_busy = 'enqueue' AND v_queued >= p_max_queued THEN
        -- 'interrupt' cancels every queued request first, so the limit cannot apply to it.
        outcome := 'queue_full';
        detail := jsonb_build_object('max_queued', p_max_queued);
        RETURN;
    END IF;
    IF p_snapshot_id IS NOT NULL AND NOT p_snapshot_stored AND NOT EXISTS (
        SELECT 1 FROM main_snapshots WHERE session_id = s.id AND snapshot_id = p_snapshot_id
    ) THEN
        outcome := 'snapshot_missing';
        RETURN;
    END IF;

    -- Every check passed: from here on, write.
    IF v_on_busy = 'interrupt' THEN
        -- Row locks first, the event advisory lock after: a worker writing an event holds its
        -- request row and then waits for that advisory lock, so the other order could deadlock.
        -- Guarded by the status it leaves, so a worker's own terminal write lands first or not at all.
        WITH cancelled AS (
            UPDATE side_question_requests
               SET status = 'cancelled',
                   cancel_requested = true,
                   finished_at = now(),
                   error = jsonb_build_object(
                       'code', 'superseded',
                       'message', p_superseded_message,
                       'detail', jsonb_build_object('superseded_by', p_request_id::text)),
                   lease_owner = NULL,
                   lease_expires_at = NULL,
                   event_seq = event_seq + 2
             WHERE session_id = s.id AND deleted_at IS NULL AND status IN ('queued', 'running')
            RETURNING id, ordinal, stage, event_seq
        )
        SELECT coalesce(array_agg(id ORDER BY ordinal), '{}'),
               array_agg(ordinal ORDER BY ordinal),
               array_agg(stage ORDER BY ordinal),
               array_agg(event_seq ORDER BY ordinal)
          INTO v_ids, v_ordinals, v_stages, v_seqs
          FROM cancelled;
        superseded := v_ids;
    END IF;

    UPDATE side_question_sessions
       SET next_ordinal = next_ordinal + 1, updated_at = now()
     WHERE id = s.id
    RETURNING next_ordinal - 1 INTO v_ordinal;
    -- event_seq 1: the request's `queued` event is written below, in this transaction.
    INSERT INTO side_question_requests (
        id, session_id, ordinal, question, snapshot_id, status, clear_version, options, model,
        idempotency_key, body_hash, event_seq
    ) VALUES (
        p_request_id, s.id, v_ordinal, p_question, p_snapshot_id, 'queued', s.clear_version,
        p_options, p_model, p_idempotency_key, p_body_hash, 1
    )
    RETURNING * INTO req;

    -- The session's event lock around allocating event ids (events.py): the session's events
    -- commit in id order, so a session stream resumes without gaps.
    PERFORM pg_advisory_xact_lock(hashtextextended(s.id::text, 7));
    v_at := to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"');
    FOR i IN 1 .. coalesce(array_length(v_ids, 1), 0) LOOP
        INSERT INTO side_question_events (request_id, session_id, seq, type, data)
        VALUES (v_ids[i], s.id, v_seqs[i] - 1, 'status', jsonb_build_object(
            'request_id', v_ids[i]::text, 'ordinal', v_ordinals[i], 'seq', v_seqs[i] - 1, 'at', v_at,
            'status', 'cancelled', 'stage', v_stages[i]))
        RETURNING id INTO v_event_id;
        PERFORM pg_notify('sidequest_events', format(
            '{"id": %s, "request_id": "%s", "session_id": "%s"}', v_event_id, v_ids[i], s.id));
        INSERT INTO side_question_events (request_id, session_id, seq, type, data)
        VALUES (v_ids[i], s.id, v_seqs[i], 'error', jsonb_build_object(
            'request_id', v_ids[i]::text, 'ordinal', v_ordinals[i], 'seq', v_seqs[i], 'at', v_at,
            'code', 'superseded', 'message', p_superseded_message,
            'detail', jsonb_build_object('superseded_by', p_request_id::text)))
        RETURNING id INTO v_event_id;
        PERFORM pg_notify('sidequest_events', format(
            '{"id": %s, "request_id": "%s", "session_id": "%s"}', v_event_id, v_ids[i], s.id));
        -- A running one's worker stops on this (a queued one's is harmless).
        PERFORM pg_notify('sidequest_cancel', v_ids[i]::text);
    END LOOP;
    INSERT INTO side_question_events (request_id, session_id, seq, type, data)
    VALUES (req.id, s.id, 1, 'status', jsonb_build_object(
        'request_id', req.id::text, 'ordinal', v_ordinal, 'seq', 1, 'at', v_at,
        'status', 'queued', 'stage', NULL))
    RETURNING id INTO v_event_id;
    PERFORM pg_notify('sidequest_events', format(
        '{"id": %s, "request_id": "%s", "session_id": "%s"}', v_event_id, req.id, s.id));
    PERFORM pg_notify('sidequest_queue', s.id::text);
    outcome := 'created';
END
$fn$;
"""


def upgrade() -> None:
    op.execute(ADMIT)


def downgrade() -> None:
    op.execute(
        "DROP FUNCTION IF EXISTS sidequest_admit(text, text, uuid, text, text, boolean, jsonb, text, "
        "text, text, integer, text, text)"
    )
