-- The lease guard (service/store/lease.py): every write a worker makes to a request it runs.

-- function: sidequest_lock_if_held
-- THE lease guard (0005_worker_statements): lock the request row while it is running under this
-- owner and not deleted.
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

-- function: sidequest_emit_if_held
-- The guard, then (optionally) the stage change with its context_info, then the events in order;
-- false, writing nothing, when not held (0005_worker_statements).
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

-- name: lock_if_held
SELECT sidequest_lock_if_held(:id, :owner);

-- name: emit_if_held
SELECT sidequest_emit_if_held(:id, :owner, CAST(:events AS jsonb), :at,
                              CAST(:stage AS text), CAST(:info AS jsonb));
