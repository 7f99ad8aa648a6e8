-- Admission (service/store/admission.py, admission_batch.py): one round trip per admission, or per
-- batch of admissions.

-- function: sidequest_admit
-- Everything an admission does (migration 0003_h12a): lock (or create) the session, answer an
-- idempotent replay, apply on_busy (SPEC 11.2) and the queue limit, check a named snapshot, cancel
-- the requests an interrupt supersedes, take the ordinal, insert the request and its events, NOTIFY
-- (or return the notifications). Refusals are returned (outcome), not raised, and every check runs
-- before the first write, so a refusal leaves nothing behind.
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

    -- The session's event lock around allocating event ids (events.sql).
    PERFORM sidequest_lock_session_events(v_sid);
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

-- function: sidequest_admit_now
-- The hot path (0003_h12a, 0007_admit_notify_async). A transaction that NOTIFYs takes a database-wide
-- lock at commit and holds it until its commit record is flushed, so every such transaction commits
-- alone, one fsync after another (PostgreSQL's async.c: notifications are queued in commit order):
-- on this machine that capped admission near 150/s whatever the CPU. So the procedure commits the
-- rows first (concurrent admissions share a WAL flush, as plain INSERTs do) and then sends the
-- notifications in a second transaction that writes no WAL and commits with synchronous_commit off
-- for itself: a notification is never durable, so that flush would buy nothing. Still one round
-- trip: CALL outside a transaction block may COMMIT. A lost notification (a crash in between) costs
-- a wake-up, never data: every reader reads the rows (listener.py), and the worker also polls.
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
    p_superseded jsonb,
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
        p_idempotency_key, p_body_hash, p_max_queued, p_on_busy, p_superseded, false);
    outcome := r.outcome;
    detail := r.detail;
    superseded := r.superseded;
    req := r.req;
    v_notices := r.notices;
    COMMIT;
    PERFORM set_config('synchronous_commit', 'off', true);  -- this transaction only

    FOR i IN 1 .. coalesce(array_length(v_notices, 1), 0) BY 2 LOOP
        PERFORM pg_notify(v_notices[i], v_notices[i + 1]);
    END LOOP;
END
$fn$;

-- function: sidequest_admit_many
-- Group commit (0008_admit_many): several admissions in one CALL, each exactly sidequest_admit()
-- in turn; refusals are returned per admission. The caller orders them by (tenant, parent_id) so
-- two batches lock sessions in the same order. One commit; the notifications then go out in one
-- transaction that does not wait for a flush. Results are arrays aligned with the inputs;
-- superseded is a JSON array of request ids per admission (a 2-D uuid array cannot be ragged).
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
    p_superseded jsonb[],
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
            p_on_busy[i], p_superseded[i], false);
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

-- name: admit_now
-- The hot path, one admission: CALL outside a transaction block (the procedure commits). The
-- parameters are in admission._PARAMS' order (the batcher passes them by position; a test checks).
CALL sidequest_admit_now(:tenant, :parent_id, :request_id, :question, CAST(:snapshot_id AS text),
                         CAST(CAST(:options AS text) AS jsonb), CAST(:model AS text), :idempotency_key,
                         :body_hash, :max_queued, CAST(:on_busy AS text),
                         CAST(CAST(:superseded AS text) AS jsonb));

-- name: admit_many
-- Several admissions waiting at once, one CALL: each parameter an array aligned with the others.
CALL sidequest_admit_many(CAST(:tenant AS text[]), CAST(:parent_id AS text[]), CAST(:request_id AS uuid[]),
                          CAST(:question AS text[]), CAST(:snapshot_id AS text[]),
                          CAST(CAST(:options AS text[]) AS jsonb[]), CAST(:model AS text[]),
                          CAST(:idempotency_key AS text[]), CAST(:body_hash AS text[]),
                          CAST(:max_queued AS integer[]), CAST(:on_busy AS text[]),
                          CAST(CAST(:superseded AS text[]) AS jsonb[]));

-- name: admit_in_transaction
-- The function itself, inside a caller's transaction that stored the (inline) snapshot first,
-- NOTIFYing there. ``(a.req).*`` expands the request row into its columns, whatever they are.
SELECT a.outcome, a.detail, a.superseded, (a.req).* FROM sidequest_admit(
    :tenant, :parent_id, :request_id, :question, CAST(:snapshot_id AS text), true,
    CAST(CAST(:options AS text) AS jsonb), CAST(:model AS text), :idempotency_key, :body_hash,
    :max_queued, CAST(:on_busy AS text), CAST(CAST(:superseded AS text) AS jsonb), true) a;

-- name: active_requests_of_session
-- A clear cancels these first (each through terminal.finish_request), in ordinal order.
SELECT id FROM side_question_requests
WHERE session_id = :session_id AND deleted_at IS NULL AND status IN ('queued', 'running')
ORDER BY ordinal;

-- name: hide_session_requests
-- A clear hides every request of the session at once (the sweep purges them later); how many.
WITH hidden AS (
    UPDATE side_question_requests SET deleted_at = now()
    WHERE session_id = :session_id AND deleted_at IS NULL
    RETURNING 1
)
SELECT count(*) FROM hidden;

-- name: reset_cleared_session
-- The end of a clear (SPEC 11.1, 11.2): the hand-offs go, the mark and memory reset, clear_version
-- bumped so that no late summary write restores anything; ordinals and settings are kept.
WITH handoffs AS (DELETE FROM side_question_handoffs WHERE session_id = :session_id)
UPDATE side_question_sessions
SET handed_off_through = 0,
    memory = CAST(CAST(:empty_memory AS text) AS jsonb),
    clear_version = clear_version + 1,
    updated_at = now()
WHERE id = :session_id
RETURNING parent_id, clear_version, next_ordinal;

-- name: purge_cleared_requests
-- The sweep: requests (and, by cascade, their events) cleared long enough ago; how many.
WITH purged AS (
    DELETE FROM side_question_requests
    WHERE deleted_at IS NOT NULL AND deleted_at < now() - make_interval(secs => :older_than_s)
    RETURNING 1
)
SELECT count(*) FROM purged;
