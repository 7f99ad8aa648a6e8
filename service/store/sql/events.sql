-- The event log (service/store/events.py): request events and session-level events, each appended
-- under the session's event lock (taken before the row's global id is drawn, so a session stream
-- never sees a later id commit before an earlier one), with its NOTIFY.

-- function: sidequest_lock_session_events
-- THE session's event lock, held until commit: every writer of a session's events (these two, the
-- admission, an archive restore) takes it before an event's global id is drawn, so the session's
-- events commit in id order and a session stream resumes without gaps. The key must never change
-- while an older process may still hold the lock under it.
CREATE OR REPLACE FUNCTION sidequest_lock_session_events(p_session_id uuid) RETURNS void
LANGUAGE sql AS $fn$
    SELECT pg_advisory_xact_lock(hashtextextended(p_session_id::text, 7))
$fn$;

-- function: sidequest_append_event
-- One request event in one round trip (0004_append_event), inside the caller's transaction: bump the
-- request's seq, take the session's event lock, insert the row with its envelope, NOTIFY.
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
    PERFORM sidequest_lock_session_events(v_sid);
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

-- function: sidequest_append_session_event
-- THE insert of a session-level event (no request: memory, handoff; 0009_claim_job): the session's
-- event lock, the row with its envelope, the NOTIFY; returns the id and the stored data.
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
    PERFORM sidequest_lock_session_events(p_session_id);
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

-- name: append_event
-- One request event, inside the caller's transaction (the function above).
SELECT event_id, session_id, seq, ordinal
FROM sidequest_append_event(:request_id, :type, CAST(:fields AS jsonb), :at);

-- name: append_session_event
-- THE insert of a session-level event (the function above).
SELECT event_id, data FROM sidequest_append_session_event(:sid, :type, CAST(:fields AS jsonb), :at);

-- name: request_events_after
-- A request's events after a seq, in order: a stream's shared reader (one read per notification, on a
-- plain connection) and its catch-up.
SELECT id, request_id, session_id, seq, type, data
FROM side_question_events
WHERE request_id = :request_id AND seq > :after_seq
ORDER BY seq
LIMIT :limit;

-- name: session_events_with_deletion
-- A session's events after an id, each with when it was hidden — its request's deleted_at, or for a
-- session-level event of a history a clear replaced, that clear's cleared_at — and whether it was
-- written before that.
SELECT e.id, e.request_id, e.session_id, e.seq, e.type, e.data, h.hidden,
       coalesce(e.created_at < h.hidden, false) AS written_before
FROM side_question_events e
JOIN side_question_sessions s ON s.id = e.session_id
LEFT JOIN side_question_requests r ON r.id = e.request_id
CROSS JOIN LATERAL (
    SELECT CASE WHEN e.request_id IS NULL AND e.id <= s.cleared_through_event THEN s.cleared_at
                ELSE r.deleted_at END AS hidden
) h
WHERE e.session_id = :session_id AND e.id > :after_id
ORDER BY e.id
LIMIT :limit;

-- name: terminal_seq
SELECT min(seq) FROM side_question_events WHERE request_id = :request_id AND type IN ('done', 'error');

-- name: request_exists
-- Cleared rows stay until the sweep purges them.
SELECT EXISTS (SELECT 1 FROM side_question_requests WHERE id = :request_id);

-- name: session_high_water
SELECT coalesce(max(id), 0) FROM side_question_events WHERE session_id = :session_id;

-- name: database_now
-- PostgreSQL's clock (the one deleted_at is written with).
SELECT clock_timestamp();

-- name: mark_session_events_cleared
-- A clear or an archive restore: the session-level events written so far belong to the history
-- it replaces (a fresh session stream does not replay them; a resuming one still gets them).
UPDATE side_question_sessions
SET cleared_at = now(),
    cleared_through_event = coalesce(
        (SELECT max(id) FROM side_question_events WHERE session_id = :sid AND request_id IS NULL), 0)
WHERE id = :sid;

-- name: purge_cleared_session_events
-- The sweep: the session-level events a clear or a restore replaced long enough ago.
DELETE FROM side_question_events e
USING side_question_sessions s
WHERE e.session_id = s.id AND e.request_id IS NULL AND e.id <= s.cleared_through_event
  AND s.cleared_at < now() - make_interval(secs => :older_than_s);

-- name: notify
-- NOTIFY inside the caller's transaction (delivered when it commits): execute.notify.
SELECT pg_notify(:channel, :payload);
