-- Background summary jobs (service/store/jobs.py; SPEC 6.6). The rules are in jobs.py's docstring.

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
