-- The queue (service/store/queue.py): the claim of a request. The invariants it keeps are listed
-- in docs/pipeline.md, "Claiming".

-- function: sidequest_claim
-- THE claim (SPEC 9; 0005_worker_statements): the claims' advisory lock, the global cap, the fair
-- pick, the request marked running under a lease, the session's last_started_at, the status event;
-- returns what the pipeline needs to start (with the content hash of the snapshot the request
-- names, which keys the worker's preparations).
CREATE OR REPLACE FUNCTION sidequest_claim(
    p_owner text,
    p_lease_s double precision,
    p_max_running integer,
    p_lock_key bigint,  -- the advisory lock every claim takes (service.store.queue.CLAIM_LOCK_KEY)
    p_at text           -- the status event's envelope ``at``
) RETURNS TABLE (
    cluster_full boolean, id uuid, session_id uuid, ordinal integer, attempt integer,
    clear_version integer, question text, snapshot_id text, options jsonb, model text,
    created_at timestamptz, parent_id text, memory jsonb, settings jsonb, jobs_active boolean,
    snapshot_hash text
)
LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    v_pick uuid;
    v_req side_question_requests;
    v_ses side_question_sessions;
BEGIN
    PERFORM pg_advisory_xact_lock(p_lock_key);
    -- READ COMMITTED: this statement's snapshot is taken after the lock was granted, so the count
    -- includes every earlier claim.
    IF (SELECT count(*) FROM side_question_requests r WHERE r.status = 'running') >= p_max_running THEN
        cluster_full := true;
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT r.id INTO v_pick
    FROM side_question_requests r
    JOIN side_question_sessions s ON s.id = r.session_id
    WHERE r.status = 'queued'
      AND r.deleted_at IS NULL
      AND r.ordinal = (
          SELECT min(q.ordinal) FROM side_question_requests q
          WHERE q.session_id = r.session_id AND q.status = 'queued' AND q.deleted_at IS NULL
      )
      AND NOT EXISTS (
          SELECT 1 FROM side_question_requests x
          WHERE x.session_id = r.session_id AND x.status = 'running'
      )
    ORDER BY s.last_started_at ASC NULLS FIRST, r.created_at ASC, r.id ASC
    LIMIT 1
    FOR NO KEY UPDATE OF r, s SKIP LOCKED;
    IF v_pick IS NULL THEN
        RETURN;  -- no row: nothing is eligible
    END IF;
    UPDATE side_question_requests r
    SET status = 'running', stage = 'preparing', attempt = r.attempt + 1,
        lease_owner = p_owner,
        lease_expires_at = now() + make_interval(secs => p_lease_s),
        heartbeat_at = now(),
        started_at = coalesce(r.started_at, now()),
        context_info = jsonb_set(r.context_info, '{stage}', '"preparing"')
    WHERE r.id = v_pick
    RETURNING r.* INTO v_req;
    UPDATE side_question_sessions s SET last_started_at = clock_timestamp()
    WHERE s.id = v_req.session_id
    RETURNING s.* INTO v_ses;
    PERFORM sidequest_append_event(
        v_req.id, 'status',
        jsonb_build_object('status', 'running', 'stage', 'preparing', 'attempt', v_req.attempt), p_at
    );
    cluster_full := false;
    id := v_req.id;
    session_id := v_req.session_id;
    ordinal := v_req.ordinal;
    attempt := v_req.attempt;
    clear_version := v_req.clear_version;
    question := v_req.question;
    snapshot_id := v_req.snapshot_id;
    options := v_req.options;
    model := v_req.model;
    created_at := v_req.created_at;
    parent_id := v_ses.parent_id;
    memory := v_ses.memory;
    settings := v_ses.settings;
    jobs_active := EXISTS (
        SELECT 1 FROM side_question_jobs j
        WHERE j.session_id = v_ses.id AND j.status IN ('queued', 'running')
    );
    snapshot_hash := (
        SELECT m.content_hash FROM main_snapshots m
        WHERE m.session_id = v_req.session_id AND m.snapshot_id = v_req.snapshot_id
    );
    RETURN NEXT;
END
$fn$;

-- name: claim_request
-- THE claim: one round trip.
SELECT * FROM sidequest_claim(:owner, :lease_s, :max_running, :lock_key, :at);

-- name: heartbeat_requests
-- Extend the leases of the requests a worker holds, each only for the claim its run holds; a
-- request with cancel_requested set counts as lost.
UPDATE side_question_requests AS r
SET lease_expires_at = now() + make_interval(secs => :lease_s), heartbeat_at = now()
FROM unnest(CAST(:ids AS uuid[]), CAST(:owners AS text[])) AS h(id, owner)
WHERE r.id = h.id AND r.lease_owner = h.owner AND r.status = 'running'
  AND r.deleted_at IS NULL
RETURNING r.id, r.cancel_requested;

-- name: heartbeat_jobs
-- The same for the background jobs a worker holds.
UPDATE side_question_jobs AS j
SET lease_expires_at = now() + make_interval(secs => :lease_s), heartbeat_at = now()
FROM unnest(CAST(:ids AS uuid[]), CAST(:owners AS text[])) AS h(id, owner)
WHERE j.id = h.id AND j.lease_owner = h.owner AND j.status = 'running'
RETURNING j.id;

-- name: requeue_request
-- THE way back to the queue of a running request (a worker's graceful stop, the sweep): the attempt
-- counts only when the worker was lost. Returns the stage it left and the attempt it was on.
UPDATE side_question_requests r
SET status = 'queued', stage = NULL,
    attempt = CASE WHEN :attempt_counts THEN r.attempt ELSE greatest(r.attempt - 1, 0) END,
    lease_owner = NULL, lease_expires_at = NULL
FROM (SELECT id, stage, attempt FROM side_question_requests WHERE id = :id) AS old
WHERE r.id = old.id AND r.status = 'running'
RETURNING r.session_id, old.stage, old.attempt;

-- name: expired_requests
-- The sweep: running requests whose lease expired (their worker died), oldest expiry first.
SELECT id, session_id, attempt, stage FROM side_question_requests
WHERE status = 'running' AND lease_expires_at < now()
ORDER BY lease_expires_at
FOR UPDATE SKIP LOCKED;

-- name: expired_jobs
-- The sweep: running jobs and registrations whose lease expired.
SELECT id, attempt, calls, coalesce(params->>'made_by', 'background') AS made_by
FROM side_question_jobs
WHERE status = 'running' AND lease_expires_at < now()
ORDER BY lease_expires_at
FOR UPDATE SKIP LOCKED;
