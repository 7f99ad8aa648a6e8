-- What a request reads of its session's history (service/store/history.py): stored snapshots'
-- content hashes, the Q&A pages a fold or a replay reads, when a folded history's main context was
-- taken.

-- name: snapshot_content_hash
-- What names a stored snapshot's preparation (a pure function of the content).
SELECT content_hash FROM main_snapshots WHERE session_id = :sid AND snapshot_id = :snapshot_id;

-- name: history_page
-- Succeeded, answered, not cleared Q&A of the current history between two ordinals, in order.
SELECT ordinal, question, answer, created_at, qa_tokens FROM side_question_requests
WHERE session_id = :sid AND status = 'succeeded' AND deleted_at IS NULL
  AND clear_version = :cv AND answer IS NOT NULL
  AND ordinal > :after AND ordinal < :before
ORDER BY ordinal
LIMIT :limit;

-- name: latest_context_time
-- The main context time of the newest folded Q&A that was asked on a snapshot: its snapshot's
-- taken_at (the expression is handoffs.sql's handoff_candidates'; a test keeps them equal).
SELECT t.taken_at FROM side_question_requests r
JOIN main_snapshots s ON s.session_id = r.session_id AND s.snapshot_id = r.snapshot_id
CROSS JOIN LATERAL (SELECT NULLIF(COALESCE(s.prepared ->> 'taken_at', s.content ->> 'taken_at'), '') AS taken_at) t
WHERE r.session_id = :sid AND r.status = 'succeeded' AND r.deleted_at IS NULL
  AND r.clear_version = :cv AND r.ordinal > :after AND r.ordinal <= :through
  AND t.taken_at IS NOT NULL
ORDER BY r.ordinal DESC
LIMIT 1;

-- name: prepared_snapshot
-- A stored snapshot's preparation; the posted transcript only when the preparation left it out
-- (messages_as_posted); the whole content only when there is no preparation of :prepared_version.
SELECT content_hash, prepared,
       CASE WHEN json_typeof(prepared -> 'messages') = 'array' THEN NULL
            ELSE content -> 'messages' END AS posted_messages,
       CASE WHEN prepared IS NOT NULL AND prepared_version = :prepared_version THEN NULL
            ELSE content END AS content
FROM main_snapshots WHERE session_id = :sid AND snapshot_id = :snapshot_id;

-- name: store_preparation
-- Written once (snapshots are immutable): a snapshot stored before preparation existed, or by
-- another format version.
UPDATE main_snapshots
SET prepared = CAST(CAST(:prepared AS text) AS json), prepared_version = :prepared_version
WHERE session_id = :sid AND snapshot_id = :snapshot_id;
