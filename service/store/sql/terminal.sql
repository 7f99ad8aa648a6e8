-- THE terminal transition of a request (service/store/terminal.py).

-- function: sidequest_finish_request
-- The guard (when an owner is given), then THE terminal UPDATE, guarded by the statuses it leaves;
-- returns the updated row and its session's parent id (no row: not ended). 0005_worker_statements.
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

-- function: sidequest_end_request
-- After it: the terminal status event, the done / error event (whose record the caller built from
-- the returned row) and the slot NOTIFY. 0005_worker_statements.
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

-- name: finish_request
-- The lease guard and the guarded UPDATE, returning the row (``(f.req).*``: its columns, whatever
-- they are) and its session's parent id.
SELECT f.parent_id AS parent_of_row, (f.req).* FROM sidequest_finish_request(
    :id, :status, CAST(:owner AS text), CAST(:from_statuses AS text[]), CAST(:answer AS text),
    :truncated, CAST(:stop_reason AS text), CAST(:model AS text), CAST(:qa_tokens AS integer),
    CAST(:error AS jsonb), CAST(:info AS jsonb)) f;

-- name: end_request
-- Once the record is built from that row: the terminal events and the slot NOTIFY.
SELECT sidequest_end_request(:id, :sid, :status, CAST(:stage AS text), :type,
                             CAST(:fields AS jsonb), :at, :channel);
