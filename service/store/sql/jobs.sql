-- Background summary jobs (service/store/jobs.py; SPEC 6.6). The rules are in docs/pipeline.md,
-- "Background summary jobs".

-- function: sidequest_memory_event
-- THE memory event of a job's transition ({job_id, kind, status, calls, covered}), for every
-- transition and for the claim, with the transition's NOTIFY sidequest_jobs when it has one (work
-- queued, a slot freed). 0009_claim_job.
CREATE OR REPLACE FUNCTION sidequest_memory_event(
    p_session_id uuid,
    p_job_id uuid,
    p_kind text,
    p_status text,
    p_calls integer,
    p_covered jsonb,
    p_at text,
    p_jobs_notify text   -- NULL, or what to NOTIFY sidequest_jobs with ('queued': work to do; 'freed')
) RETURNS bigint
LANGUAGE plpgsql AS $fn$
DECLARE
    v_id bigint;
BEGIN
    SELECT event_id INTO v_id FROM sidequest_append_session_event(
        p_session_id,
        'memory',
        jsonb_build_object(
            'job_id', p_job_id::text, 'kind', p_kind, 'status', p_status,
            'calls', p_calls, 'covered', p_covered
        ),
        p_at
    );
    IF p_jobs_notify IS NOT NULL THEN
        PERFORM pg_notify('sidequest_jobs', p_jobs_notify);
    END IF;
    RETURN v_id;
END
$fn$;

-- function: sidequest_claim_job
-- THE claim of a background job (0009_claim_job): the job claims' advisory lock, the global
-- background cap, the pick (oldest queued background job of a (session, kind) with nothing
-- running; SKIP LOCKED), the start under a lease, the running memory event; returns the job and
-- what it reads of its session (clear_version, memory, settings, and the content hash of the
-- snapshot a context_summary job names). No row: the cap is reached or nothing is eligible.
CREATE OR REPLACE FUNCTION sidequest_claim_job(
    p_owner text,
    p_lease_s double precision,
    p_max_running integer,
    p_lock_key bigint,
    p_at text
) RETURNS TABLE (
    id uuid, session_id uuid, kind text, key text, params jsonb, clear_version integer,
    attempt integer, calls integer,
    session_clear_version integer, memory jsonb, settings jsonb, snapshot_hash text
)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_picked uuid;
    v_job side_question_jobs;
BEGIN
    PERFORM pg_advisory_xact_lock(p_lock_key);
    -- Background jobs only: a request's single-flight registration (made_by 'request') is never
    -- claimed and takes no background slot.
    IF (SELECT count(*) FROM side_question_jobs j
         WHERE j.status = 'running' AND coalesce(j.params->>'made_by', 'background') = 'background')
       >= p_max_running THEN
        RETURN;
    END IF;
    SELECT j.id INTO v_picked FROM side_question_jobs j
     WHERE j.status = 'queued' AND coalesce(j.params->>'made_by', 'background') = 'background'
       AND NOT EXISTS (
           SELECT 1 FROM side_question_jobs x
            WHERE x.session_id = j.session_id AND x.kind = j.kind AND x.status = 'running'
       )
     ORDER BY j.created_at, j.id
     LIMIT 1
     FOR UPDATE SKIP LOCKED;
    IF v_picked IS NULL THEN
        RETURN;
    END IF;
    UPDATE side_question_jobs j
       SET status = 'running', attempt = j.attempt + 1, lease_owner = p_owner,
           lease_expires_at = now() + make_interval(secs => p_lease_s),
           heartbeat_at = now(), started_at = coalesce(j.started_at, now())
     WHERE j.id = v_picked
    RETURNING j.* INTO v_job;
    PERFORM sidequest_memory_event(
        v_job.session_id, v_job.id, v_job.kind, 'running', v_job.calls, NULL, p_at, NULL
    );
    -- The session's part is null when the session is gone (the job then ends cancelled).
    RETURN QUERY
        SELECT v_job.id, v_job.session_id, v_job.kind::text, v_job.key::text, v_job.params,
               v_job.clear_version, v_job.attempt, v_job.calls, s.clear_version, s.memory, s.settings,
               m.content_hash::text
          FROM (SELECT v_job.session_id AS sid, v_job.params->>'snapshot_id' AS snapshot_id) AS job
          LEFT JOIN side_question_sessions s ON s.id = job.sid
          LEFT JOIN main_snapshots m ON m.session_id = job.sid AND m.snapshot_id = job.snapshot_id;
END
$fn$;

-- name: memory_event
-- THE memory event of a job's transition, with its NOTIFY sidequest_jobs when it has one.
SELECT sidequest_memory_event(:sid, :job_id, :kind, :status, :calls, CAST(:covered AS jsonb), :at,
                              CAST(:notify AS text));

-- name: enqueue_job
-- The job and its queued memory event (with the NOTIFY) in one round trip: the event is written
-- only for a row the INSERT returned (none when the key is taken or the session was cleared).
WITH queued AS (
    INSERT INTO side_question_jobs (id, session_id, kind, key, params, clear_version)
    SELECT :id, s.id, :kind, :key, CAST(:params AS jsonb), s.clear_version
    FROM side_question_sessions s WHERE s.id = :sid AND s.clear_version = :cv
    ON CONFLICT (session_id, kind, key) WHERE status IN ('queued', 'running') DO NOTHING
    RETURNING id, session_id, kind
)
SELECT q.id, sidequest_memory_event(q.session_id, q.id, q.kind, 'queued', 0, NULL, :at, 'queued')
FROM queued q;

-- name: register_inline
-- A request registers the summary it makes itself: a running row (single flight) whose lease is
-- the request's deadline; no row when a job or another registration holds the key.
INSERT INTO side_question_jobs (id, session_id, kind, key, params, clear_version, status,
                                attempt, lease_owner, lease_expires_at, heartbeat_at,
                                started_at)
VALUES (:id, :sid, :kind, :key, CAST(:params AS jsonb), :cv, 'running', 1, :owner,
        now() + make_interval(secs => :lease_s), now(), now())
ON CONFLICT (session_id, kind, key) WHERE status IN ('queued', 'running') DO NOTHING
RETURNING id;

-- name: end_inline
UPDATE side_question_jobs
SET status = :status, finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
WHERE id = :id AND status = 'running';

-- name: claim_job
-- THE claim of a background job: one round trip.
SELECT * FROM sidequest_claim_job(:owner, :lease_s, :max_running, :lock_key, :at);

-- name: finish_job
-- The one terminal transition of a job (its worker's end, the sweep, a take-over, a clear): guarded
-- by the statuses it leaves and, with an owner, the lease. ``calls`` NULL keeps the count. Returns
-- the status it left (a running job frees a background slot).
WITH old AS (
    SELECT id, status FROM side_question_jobs
    WHERE id = :id AND status = ANY(CAST(:from_statuses AS text[]))
      AND (CAST(:owner AS text) IS NULL OR lease_owner = CAST(:owner AS text))
    FOR UPDATE
)
UPDATE side_question_jobs j
SET status = :status, calls = coalesce(CAST(:calls AS integer), j.calls),
    covered = CAST(:covered AS jsonb), error = CAST(:error AS jsonb), finished_at = now(),
    lease_owner = NULL, lease_expires_at = NULL
FROM old
WHERE j.id = old.id
RETURNING j.session_id, j.kind, j.calls, coalesce(j.params->>'made_by', 'background') AS made_by,
          old.status AS left_status;

-- name: requeue_job
-- THE way back to the queue of a running job (a worker's graceful stop, guarded by its lease; the
-- sweep): the attempt counts only when the worker was lost.
UPDATE side_question_jobs
SET status = 'queued',
    attempt = CASE WHEN :attempt_counts THEN attempt ELSE greatest(attempt - 1, 0) END,
    lease_owner = NULL, lease_expires_at = NULL
WHERE id = :id AND status = 'running'
  AND (CAST(:owner AS text) IS NULL OR lease_owner = CAST(:owner AS text))
RETURNING session_id, kind, calls;

-- name: count_job_calls
UPDATE side_question_jobs SET calls = calls + :n WHERE id = :id AND status = 'running';

-- name: take_job_key
-- Re-key a running job to the summary's real cache key, unless an active job or a request's
-- registration holds that key.
UPDATE side_question_jobs j SET key = :key
WHERE j.id = :id AND j.status = 'running'
  AND NOT EXISTS (
      SELECT 1 FROM side_question_jobs o
      WHERE o.session_id = j.session_id AND o.kind = j.kind AND o.key = :key
        AND o.status IN ('queued', 'running') AND o.id <> j.id
  )
RETURNING j.id;

-- name: active_session_jobs
-- A clear's jobs to cancel: the session's queued and running jobs (and registrations), locked.
SELECT id FROM side_question_jobs
WHERE session_id = :sid AND status IN ('queued', 'running')
ORDER BY created_at, id
FOR UPDATE;

-- name: active_jobs
-- The session's queued or running jobs (and registrations) of a kind, oldest first.
SELECT id, kind, key, status, coalesce(params->>'made_by', 'background') AS made_by, error
FROM side_question_jobs
WHERE session_id = :sid AND kind = :kind AND status IN ('queued', 'running')
ORDER BY created_at, id;

-- name: job_state
SELECT id, kind, key, status, coalesce(params->>'made_by', 'background') AS made_by, error
FROM side_question_jobs WHERE id = :id;

-- name: background_overviews
-- SPEC 3 session.background of several sessions: background jobs (never a request's registration)
-- by status, and the usage of every background call; every id asked for has a row.
WITH jobs AS (
    SELECT session_id, status, usage, created_at, id FROM side_question_jobs
    WHERE session_id = ANY(CAST(:sids AS uuid[]))
      AND coalesce(params->>'made_by', 'background') = 'background'
),
counts AS (
    SELECT session_id, jsonb_object_agg(status, n) AS counts
    FROM (SELECT session_id, status, count(*) AS n FROM jobs GROUP BY 1, 2) c
    GROUP BY 1
),
calls AS (
    SELECT jobs.session_id, jsonb_agg(e.c ORDER BY jobs.created_at, jobs.id, e.n) AS calls
    FROM jobs, jsonb_array_elements(coalesce(jobs.usage->'calls', '[]'::jsonb)) WITH ORDINALITY AS e(c, n)
    GROUP BY 1
)
SELECT s.sid AS session_id,
       coalesce(counts.counts, '{}'::jsonb) AS counts,
       coalesce(calls.calls, '[]'::jsonb) AS calls
FROM unnest(CAST(:sids AS uuid[])) AS s(sid)
LEFT JOIN counts ON counts.session_id = s.sid
LEFT JOIN calls ON calls.session_id = s.sid;
