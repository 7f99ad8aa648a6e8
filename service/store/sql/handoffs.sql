-- Hand-offs (SPEC 11.1) and pins (service/store/handoffs.py).

-- name: handoff_by_key
SELECT id, body, body_hash FROM side_question_handoffs
WHERE session_id = :session_id AND idempotency_key = :idempotency_key;

-- name: handoff_candidates
-- The succeeded, answered, visible Q&A a hand-off may carry: exactly :ordinals when given, else
-- with :include 'new' those past the mark or pinned, else all; each with its snapshot's main context
-- time (the expression is history.sql's latest_context_time's; a test keeps them equal) and when
-- the service stored that snapshot.
SELECT r.ordinal, r.question, r.answer, r.created_at, r.snapshot_id, r.pinned,
       t.taken_at AS snapshot_time, s.created_at AS snapshot_stored
FROM side_question_requests r
LEFT JOIN main_snapshots s ON s.session_id = r.session_id AND s.snapshot_id = r.snapshot_id
CROSS JOIN LATERAL (SELECT NULLIF(COALESCE(s.prepared ->> 'taken_at', s.content ->> 'taken_at'), '') AS taken_at) t
WHERE r.session_id = :session_id AND r.deleted_at IS NULL AND r.status = 'succeeded'
  AND r.answer IS NOT NULL
  AND CASE WHEN CAST(:ordinals AS integer[]) IS NOT NULL THEN r.ordinal = ANY(CAST(:ordinals AS integer[]))
           WHEN :include = 'new' THEN r.ordinal > :handed_off_through OR r.pinned IS TRUE
           ELSE true END
ORDER BY r.ordinal;

-- name: succeeded_ordinals_between
SELECT ordinal FROM side_question_requests
WHERE session_id = :session_id AND deleted_at IS NULL AND status = 'succeeded'
  AND ordinal BETWEEN :first AND :through;

-- name: transaction_now
SELECT now();

-- name: insert_handoff
INSERT INTO side_question_handoffs (
    id, session_id, body, through_ordinal, idempotency_key, body_hash, created_at
) VALUES (
    :id, :session_id, CAST(CAST(:body AS text) AS jsonb), :through_ordinal, :idempotency_key,
    :body_hash, :created_at
);

-- name: mark_handed_off
-- The mark service.budget.handoff.handoff_marks computed (the caller holds the session row's lock).
UPDATE side_question_sessions SET handed_off_through = :handed_off_through, updated_at = now()
WHERE id = :session_id;

-- name: repin_after_handoff
-- What a hand-off carried is unpinned, what it had to leave out (:pin, handoff_marks') is pinned.
UPDATE side_question_requests SET pinned = (ordinal = ANY(CAST(:pin AS integer[])))
WHERE session_id = :session_id AND ordinal = ANY(CAST(:ordinals AS integer[]))
  AND status = 'succeeded' AND deleted_at IS NULL;

-- name: handoff_page
-- The session's hand-offs before the one :before names (none when it is not the session's), newest
-- first.
SELECT id, body FROM side_question_handoffs
WHERE session_id = :session_id
  AND (CAST(:before AS uuid) IS NULL OR (created_at, id) < (
      SELECT c.created_at, c.id FROM side_question_handoffs c
      WHERE c.session_id = :session_id AND c.id = CAST(:before AS uuid)))
ORDER BY created_at DESC, id DESC
LIMIT :limit;
