-- Archive export and restore (service/store/archive.py; the format is service/archive's).

-- name: archive_requests
-- The session's visible requests of the exported statuses, in ordinal order.
SELECT * FROM side_question_requests
WHERE session_id = :session_id AND deleted_at IS NULL AND status = ANY(CAST(:statuses AS text[]))
ORDER BY ordinal;

-- name: request_ordinals
SELECT id, ordinal FROM side_question_requests
WHERE session_id = :session_id AND id = ANY(CAST(:ids AS uuid[]));

-- name: archive_handoffs
SELECT created_at, body, through_ordinal FROM side_question_handoffs
WHERE session_id = :session_id
ORDER BY created_at, id;

-- name: purge_cleared_ordinals
-- Cleared requests occupy their ordinals until the sweep purges them; a restored archive's win.
DELETE FROM side_question_requests
WHERE session_id = :session_id AND deleted_at IS NOT NULL AND ordinal = ANY(CAST(:ordinals AS integer[]));

-- name: restore_session
-- The session takes the archive's memory, mark and settings (null: the session's own kept); its
-- earlier hand-offs go with the history the restore replaces.
WITH handoffs AS (DELETE FROM side_question_handoffs WHERE session_id = :session_id)
UPDATE side_question_sessions
SET memory = CAST(CAST(:memory AS text) AS jsonb),
    clear_version = :clear_version,
    next_ordinal = :next_ordinal,
    handed_off_through = :handed_off_through,
    settings = coalesce(CAST(CAST(:settings AS text) AS jsonb), settings),
    updated_at = now()
WHERE id = :session_id;

-- name: lock_session_events
-- The session's event lock (events.sql): its events' ids commit in order.
SELECT sidequest_lock_session_events(CAST(:session_id AS uuid));
