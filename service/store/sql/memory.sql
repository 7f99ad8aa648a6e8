-- The session's memory (service/store/memory.py): the rolling Q&A summary and the context-summary
-- cache, and THE guarded write (SPEC 6.5): an UPDATE of the session row joined to its writer, a
-- running request or background job whose clear_version is still the session's.
--
-- The two writes set memory with the same expression (a test keeps them equal): the Q&A summary
-- replaced when :set_qa, the context summary with the same key replaced or appended, the newest
-- :max_ctx kept. No updated_at = now(): the session row's updated_at is its *activity* — what a
-- client did, which orders the session list — and a summary written in the background is none
-- (docs/api.md).

-- name: save_memory_of_request
-- The writer is a running request (its lease, when :owner is given).
UPDATE side_question_sessions s
    SET memory = (
            WITH base AS (
                SELECT CASE WHEN CAST(:set_qa AS boolean)
                            THEN jsonb_set(s.memory, '{qa_summary}', CAST(:qa AS jsonb), true)
                            ELSE s.memory END AS m
            ),
            kept AS (
                SELECT e.c, e.n FROM base,
                    jsonb_array_elements(coalesce(base.m->'context_summaries', '[]'::jsonb))
                        WITH ORDINALITY AS e(c, n)
                WHERE CAST(:ctx AS jsonb) IS NULL OR e.c->>'key' IS DISTINCT FROM CAST(:ctx AS jsonb)->>'key'
                UNION ALL
                SELECT CAST(:ctx AS jsonb), 1000000 WHERE CAST(:ctx AS jsonb) IS NOT NULL
            ),
            newest AS (
                SELECT c, n FROM kept ORDER BY n DESC LIMIT :max_ctx
            )
            SELECT jsonb_set(
                base.m, '{context_summaries}',
                coalesce((SELECT jsonb_agg(c ORDER BY n) FROM newest), '[]'::jsonb), true)
            FROM base
        )
    FROM side_question_requests r
    WHERE r.id = :writer_id
      AND s.id = r.session_id
      AND r.status = 'running'
      AND r.deleted_at IS NULL
      AND s.clear_version = r.clear_version
      AND (CAST(:owner AS text) IS NULL OR r.lease_owner = CAST(:owner AS text))
    RETURNING s.id;

-- name: save_memory_of_job
-- The writer is a running background job (SPEC 6.6: jobs obey 6.5 with their own clear_version).
UPDATE side_question_sessions s
    SET memory = (
            WITH base AS (
                SELECT CASE WHEN CAST(:set_qa AS boolean)
                            THEN jsonb_set(s.memory, '{qa_summary}', CAST(:qa AS jsonb), true)
                            ELSE s.memory END AS m
            ),
            kept AS (
                SELECT e.c, e.n FROM base,
                    jsonb_array_elements(coalesce(base.m->'context_summaries', '[]'::jsonb))
                        WITH ORDINALITY AS e(c, n)
                WHERE CAST(:ctx AS jsonb) IS NULL OR e.c->>'key' IS DISTINCT FROM CAST(:ctx AS jsonb)->>'key'
                UNION ALL
                SELECT CAST(:ctx AS jsonb), 1000000 WHERE CAST(:ctx AS jsonb) IS NOT NULL
            ),
            newest AS (
                SELECT c, n FROM kept ORDER BY n DESC LIMIT :max_ctx
            )
            SELECT jsonb_set(
                base.m, '{context_summaries}',
                coalesce((SELECT jsonb_agg(c ORDER BY n) FROM newest), '[]'::jsonb), true)
            FROM base
        )
    FROM side_question_jobs j
    WHERE j.id = :writer_id
      AND s.id = j.session_id
      AND j.status = 'running'
      AND s.clear_version = j.clear_version
      AND (CAST(:owner AS text) IS NULL OR j.lease_owner = CAST(:owner AS text))
    RETURNING s.id;

-- name: lock_session_of_request
-- The writer's session row, locked (one round trip); the guarded write then reads the writer again.
SELECT s.id FROM side_question_sessions s
WHERE s.id = (SELECT w.session_id FROM side_question_requests w WHERE w.id = :id) FOR NO KEY UPDATE;

-- name: lock_session_of_job
SELECT s.id FROM side_question_sessions s
WHERE s.id = (SELECT w.session_id FROM side_question_jobs w WHERE w.id = :id) FOR NO KEY UPDATE;

-- name: load_memory
SELECT memory FROM side_question_sessions WHERE id = :id;
