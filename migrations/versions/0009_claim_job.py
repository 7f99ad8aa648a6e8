"""a background job's claim in one round trip: sidequest_claim_job, and the memory event in SQL

Revision ID: 0009_claim_job
Revises: 0008_admit_many
Create Date: 2026-12-01 21:10:00

Issue 11 (case 2: a long snapshot inline, whose question waits for its job): the job's claim was a
transaction of eight round trips — BEGIN, the claims' advisory lock, the running count, the pick,
the start, the ``memory`` event's insert, its NOTIFY, COMMIT — then one more to read the session's
memory and settings; ~10 ms on this machine, on the question's critical path. A request's claim
has been one call since 0005 (``sidequest_claim``). These functions do the job's statements in the
same order, in one call:

- ``sidequest_append_session_event``: a session-level event (no request: ``memory``, ``handoff``):
  the session's event lock (taken before the row's global id is drawn, as for request events, 0004),
  the row with its envelope, the NOTIFY; returns the id and the stored data. THE insert of a
  session event: ``service.store.events.append_session_event`` calls it.
- ``sidequest_memory_event``: THE ``memory`` event of a job's transition (SPEC §6.6: ``{job_id, kind,
  status, calls, covered}``), for every transition (``service.store.jobs``) and for the claim here,
  with the transition's ``NOTIFY sidequest_jobs`` when it has one (work queued, a slot freed).
- ``sidequest_claim_job``: THE claim of a background job (the rules are in service/store/jobs.py):
  the job claims' advisory lock, the global background cap, the pick (oldest queued background job
  of a (session, kind) with nothing running; ``SKIP LOCKED``), the start under a lease, the
  ``running`` memory event; returns the job and what it reads of its session (clear_version, memory,
  settings, and the content hash of the snapshot a ``context_summary`` job names, which keys the
  worker's preparations). No row: the cap is reached or nothing is eligible.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0009_claim_job"
down_revision: str | None = "0008_admit_many"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

APPEND_SESSION_EVENT = r"""
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
"""

MEMORY_EVENT = r"""
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
"""

CLAIM_JOB = r"""
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
"""


def upgrade() -> None:
    op.execute(APPEND_SESSION_EVENT)
    op.execute(MEMORY_EVENT)
    op.execute(CLAIM_JOB)


def downgrade() -> None:
    op.execute("DROP FUNCTION IF EXISTS sidequest_claim_job(text, double precision, integer, bigint, text)")
    op.execute("DROP FUNCTION IF EXISTS sidequest_memory_event(uuid, uuid, text, text, integer, jsonb, text, text)")
    op.execute("DROP FUNCTION IF EXISTS sidequest_append_session_event(uuid, text, jsonb, text)")
