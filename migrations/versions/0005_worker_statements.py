"""the worker's writes in one round trip each: lease guard, event batches, the terminal transition

Revision ID: 0005_worker_statements
Revises: 0004_append_event
Create Date: 2026-12-01 14:40:00

Issue 12 (slot hand-off): a worker's write was a transaction of several statements — lock the
request if still held, move its stage, append each event — and the end of a request took eleven
round trips. These functions do the same statements in the same order, in one call each:

- ``sidequest_claim``: THE claim (SPEC §9; the invariants are in service/store/queue.py): the
  claims' advisory lock, the global cap, the fair pick, the request marked running under a lease, the
  session's ``last_started_at``, the ``status`` event; returns what the pipeline needs to start
  (with the content hash of the snapshot the request names, which keys the worker's preparations).
- ``sidequest_lock_if_held``: THE lease guard (lock the request row while it is ``running`` under
  this owner and not deleted); every worker write goes through it.
- ``sidequest_emit_if_held``: the guard, then (optionally) the stage change with its context_info,
  then the events in order (``sidequest_append_event``); false, writing nothing, when not held.
- ``sidequest_finish_request``: the guard (when an owner is given), then THE terminal UPDATE, guarded
  by the statuses it leaves; returns the updated row and its session's parent id (no row: not ended).
- ``sidequest_end_request``: after it, the terminal ``status`` event, the ``done`` / ``error`` event
  (whose record the caller built from the returned row) and the slot NOTIFY.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005_worker_statements"
down_revision: str | None = "0004_append_event"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LOCK_IF_HELD = r"""
CREATE OR REPLACE FUNCTION sidequest_lock_if_held(p_request_id uuid, p_owner text) RETURNS boolean
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM 1 FROM side_question_requests r
     WHERE r.id = p_request_id AND r.status = 'running' AND r.lease_owner = p_owner
       AND r.deleted_at IS NULL
     FOR UPDATE;
    RETURN FOUND;
END
$fn$;
"""

EMIT_IF_HELD = r"""
CREATE OR REPLACE FUNCTION sidequest_emit_if_held(
    p_request_id uuid,
    p_owner text,
    p_events jsonb,   -- [[type, fields], ...], appended in this order
    p_at text,        -- every event's envelope ``at``
    p_stage text,     -- NULL: the stage stays
    p_info jsonb      -- merged into context_info with the stage change
) RETURNS boolean
LANGUAGE plpgsql AS $fn$
DECLARE
    v_event jsonb;
BEGIN
    IF NOT sidequest_lock_if_held(p_request_id, p_owner) THEN
        RETURN false;
    END IF;
    IF p_stage IS NOT NULL THEN
        UPDATE side_question_requests r
           SET stage = p_stage, context_info = r.context_info || coalesce(p_info, '{}'::jsonb)
         WHERE r.id = p_request_id;
    END IF;
    FOR v_event IN
        SELECT e.value FROM jsonb_array_elements(p_events) WITH ORDINALITY AS e(value, n) ORDER BY e.n
    LOOP
        PERFORM sidequest_append_event(p_request_id, v_event->>0, v_event->1, p_at);
    END LOOP;
    RETURN true;
END
$fn$;
"""

FINISH_REQUEST = r"""
CREATE OR REPLACE FUNCTION sidequest_finish_request(
    p_id uuid,
    p_status text,
    p_owner text,        -- NULL: not a worker's write (no lease guard)
    p_from text[],       -- the statuses the request may leave
    p_answer text,
    p_truncated boolean,
    p_stop_reason text,
    p_model text,
    p_qa_tokens integer,
    p_error jsonb,
    p_info jsonb
) RETURNS TABLE (parent_id text, req side_question_requests)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_row side_question_requests;
BEGIN
    IF p_owner IS NOT NULL AND NOT sidequest_lock_if_held(p_id, p_owner) THEN
        RETURN;
    END IF;
    UPDATE side_question_requests r
    SET status = p_status,
        answer = CASE WHEN p_status = 'succeeded' THEN p_answer ELSE r.answer END,
        truncated = CASE WHEN p_status = 'succeeded' THEN p_truncated ELSE r.truncated END,
        stop_reason = CASE WHEN p_status = 'succeeded' THEN p_stop_reason ELSE r.stop_reason END,
        model = coalesce(p_model, r.model),
        qa_tokens = coalesce(p_qa_tokens, r.qa_tokens),
        error = p_error,
        context_info = r.context_info || coalesce(p_info, '{}'::jsonb),
        cancel_requested = r.cancel_requested OR p_status = 'cancelled',
        finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
    WHERE r.id = p_id AND r.status = ANY(p_from)
      AND (p_owner IS NULL OR r.lease_owner = p_owner)
    RETURNING r.* INTO v_row;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT s.parent_id::text, v_row FROM side_question_sessions s WHERE s.id = v_row.session_id;
END
$fn$;
"""

END_REQUEST = r"""
CREATE OR REPLACE FUNCTION sidequest_end_request(
    p_id uuid,
    p_session_id uuid,
    p_status text,
    p_stage text,
    p_type text,          -- 'done' or 'error'
    p_fields jsonb,       -- its fields ({"record": …} or the error object)
    p_at text,
    p_queue_channel text  -- where a freed slot is announced ('freed:<session id>')
) RETURNS void
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM sidequest_append_event(
        p_id, 'status', jsonb_build_object('status', p_status, 'stage', p_stage), p_at
    );
    PERFORM sidequest_append_event(p_id, p_type, p_fields, p_at);
    PERFORM pg_notify(p_queue_channel, 'freed:' || p_session_id::text);
END
$fn$;
"""


CLAIM = r"""
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
"""


def upgrade() -> None:
    op.execute(CLAIM)
    op.execute(LOCK_IF_HELD)
    op.execute(EMIT_IF_HELD)
    op.execute(FINISH_REQUEST)
    op.execute(END_REQUEST)


def downgrade() -> None:
    op.execute("DROP FUNCTION IF EXISTS sidequest_end_request")
    op.execute("DROP FUNCTION IF EXISTS sidequest_finish_request")
    op.execute("DROP FUNCTION IF EXISTS sidequest_emit_if_held")
    op.execute("DROP FUNCTION IF EXISTS sidequest_lock_if_held")
    op.execute("DROP FUNCTION IF EXISTS sidequest_claim")
