"""the session event lock has one home, ``sidequest_lock_session_events``

Revision ID: 0013_session_event_lock
Revises: 0012_superseded_error
Create Date: 2026-12-06 09:00:00

The session's event lock (``pg_advisory_xact_lock(hashtextextended(<sid>::text, 7))``) was written out
in ``sidequest_admit``, ``sidequest_append_event``, ``sidequest_append_session_event`` and an archive
restore's named query; it is now one SQL function in service/store/sql/events.sql that all four call,
with the same key, so a process still running the old definitions holds the same lock. The
signatures are unchanged, so the files are applied again (docs/architecture.md, "The store's front
door"). The downgrade restores the definitions of 0012 and drops the new function.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from service.store import queries

revision: str = "0013_session_event_lock"
down_revision: str | None = "0012_superseded_error"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# queries.definitions_digest() of the files this migration was written for.
FUNCTIONS_SHA256 = "9cafacc344a787cdd4619f4d0f2f847b2daf80d1bdbc58209fed102f37bc3a16"

# The definitions this migration replaces (0012's, from service/store/sql/admission.sql and events.sql).
_REPLACED = (
    """\
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
    p_superseded jsonb,          -- the error object of the requests an interrupt cancels
    p_notify boolean,            -- true: NOTIFY here; false: return them (notices) to send after commit
    OUT outcome text,            -- created | replay | idempotency_conflict | session_busy
                                 -- | queue_full | snapshot_missing
    OUT detail jsonb,
    OUT superseded uuid[],       -- requests an interrupt cancelled, in ordinal order
    OUT req side_question_requests,
    OUT notices text[]           -- channel, payload, channel, payload, … in the order they happen
) LANGUAGE plpgsql AS $fn$
DECLARE
    v_sid uuid;
    v_clear_version integer;
    v_setting text;
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
    notices := '{}';
    -- NO KEY UPDATE, not UPDATE: a worker appending an event holds the session's event advisory
    -- lock and inserts a row whose foreign key takes KEY SHARE on this row (see sessions.py).
    -- Only the columns needed: memory (summaries) can be large and would be detoasted for nothing.
    SELECT id, clear_version, settings->>'on_busy' INTO v_sid, v_clear_version, v_setting
      FROM side_question_sessions
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
        SELECT id, clear_version, settings->>'on_busy' INTO v_sid, v_clear_version, v_setting
          FROM side_question_sessions
         WHERE tenant = p_tenant AND parent_id = p_parent_id
           FOR NO KEY UPDATE;
    END IF;

    -- An idempotent replay answers before any limit or on_busy applies.
    IF p_idempotency_key IS NOT NULL THEN
        SELECT * INTO req FROM side_question_requests
         WHERE session_id = v_sid AND idempotency_key = p_idempotency_key AND deleted_at IS NULL;
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

    v_on_busy := coalesce(p_on_busy, v_setting, 'enqueue');
    IF v_on_busy NOT IN ('enqueue', 'reject', 'interrupt') THEN
        v_on_busy := 'enqueue';
    END IF;
    SELECT count(*) INTO v_queued FROM side_question_requests
     WHERE session_id = v_sid AND status = 'queued' AND deleted_at IS NULL;
    IF v_on_busy = 'reject' THEN
        SELECT count(*) INTO v_running FROM side_question_requests
         WHERE session_id = v_sid AND status = 'running' AND deleted_at IS NULL;
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
        SELECT 1 FROM main_snapshots WHERE session_id = v_sid AND snapshot_id = p_snapshot_id
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
                   error = p_superseded,
                   lease_owner = NULL,
                   lease_expires_at = NULL,
                   event_seq = event_seq + 2
             WHERE session_id = v_sid AND deleted_at IS NULL AND status IN ('queued', 'running')
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
     WHERE id = v_sid
    RETURNING next_ordinal - 1 INTO v_ordinal;
    -- event_seq 1: the request's `queued` event is written below, in this transaction.
    INSERT INTO side_question_requests (
        id, session_id, ordinal, question, snapshot_id, status, clear_version, options, model,
        idempotency_key, body_hash, event_seq
    ) VALUES (
        p_request_id, v_sid, v_ordinal, p_question, p_snapshot_id, 'queued', v_clear_version,
        p_options, p_model, p_idempotency_key, p_body_hash, 1
    )
    RETURNING * INTO req;

    -- The session's event lock around allocating event ids (events.py): the session's events
    -- commit in id order, so a session stream resumes without gaps.
    PERFORM pg_advisory_xact_lock(hashtextextended(v_sid::text, 7));
    v_at := to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"');
    FOR i IN 1 .. coalesce(array_length(v_ids, 1), 0) LOOP
        INSERT INTO side_question_events (request_id, session_id, seq, type, data)
        VALUES (v_ids[i], v_sid, v_seqs[i] - 1, 'status', jsonb_build_object(
            'request_id', v_ids[i]::text, 'ordinal', v_ordinals[i], 'seq', v_seqs[i] - 1, 'at', v_at,
            'status', 'cancelled', 'stage', v_stages[i]))
        RETURNING id INTO v_event_id;
        notices := notices || ARRAY['sidequest_events', format(
            '{"id": %s, "request_id": "%s", "session_id": "%s"}', v_event_id, v_ids[i], v_sid)];
        INSERT INTO side_question_events (request_id, session_id, seq, type, data)
        VALUES (v_ids[i], v_sid, v_seqs[i], 'error', jsonb_build_object(
            'request_id', v_ids[i]::text, 'ordinal', v_ordinals[i], 'seq', v_seqs[i], 'at', v_at)
            || p_superseded)
        RETURNING id INTO v_event_id;
        notices := notices || ARRAY['sidequest_events', format(
            '{"id": %s, "request_id": "%s", "session_id": "%s"}', v_event_id, v_ids[i], v_sid)];
        -- A running one's worker stops on this (a queued one's is harmless).
        notices := notices || ARRAY['sidequest_cancel', v_ids[i]::text];
    END LOOP;
    INSERT INTO side_question_events (request_id, session_id, seq, type, data)
    VALUES (req.id, v_sid, 1, 'status', jsonb_build_object(
        'request_id', req.id::text, 'ordinal', v_ordinal, 'seq', 1, 'at', v_at,
        'status', 'queued', 'stage', NULL))
    RETURNING id INTO v_event_id;
    notices := notices || ARRAY['sidequest_events', format(
        '{"id": %s, "request_id": "%s", "session_id": "%s"}', v_event_id, req.id, v_sid)];
    notices := notices || ARRAY['sidequest_queue', v_sid::text];
    IF p_notify THEN
        FOR i IN 1 .. coalesce(array_length(notices, 1), 0) BY 2 LOOP
            PERFORM pg_notify(notices[i], notices[i + 1]);
        END LOOP;
    END IF;
    outcome := 'created';
END
$fn$;
""",
    """\
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
""",
    """\
CREATE OR REPLACE FUNCTION sidequest_append_session_event(
    p_session_id uuid,
    p_type text,
    p_fields jsonb,   -- the event's own fields; the envelope (request_id, ordinal, seq: null; at) is added
    p_at text
) RETURNS TABLE (event_id bigint, data jsonb)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_id bigint;
    v_data jsonb;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_session_id::text, 7));
    INSERT INTO side_question_events (request_id, session_id, seq, type, data)
    VALUES (
        NULL, p_session_id, NULL, p_type,
        jsonb_build_object('request_id', NULL, 'ordinal', NULL, 'seq', NULL, 'at', p_at) || p_fields
    )
    RETURNING id, side_question_events.data INTO v_id, v_data;
    PERFORM pg_notify(
        'sidequest_events',
        json_build_object('id', v_id, 'request_id', NULL, 'session_id', p_session_id::text)::text
    );
    RETURN QUERY SELECT v_id, v_data;
END
$fn$;
""",
)


def upgrade() -> None:
    # exec_driver_sql: the statements go as written, never parsed for ``:name`` bind parameters.
    connection = op.get_bind()
    for definition in queries.definitions():
        connection.exec_driver_sql(definition.sql)


def downgrade() -> None:
    connection = op.get_bind()
    for statement in (*_REPLACED, "DROP FUNCTION sidequest_lock_session_events(uuid)"):
        connection.exec_driver_sql(statement)
