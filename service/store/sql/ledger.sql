-- The usage ledger (service/store/ledger.py): each provider call appended the moment it ends, the
-- totals recomputed from the calls in the same UPDATE, a call already recorded (same call_id)
-- never counted twice.
--
-- The totals are computed from r.usage inside the SET expression (not a FROM subquery): when a
-- concurrent append holds the row, PostgreSQL re-evaluates SET against the row version it
-- committed, so no call is lost (a FROM subquery would keep its stale snapshot). Requests and
-- background jobs keep the same usage object (SPEC 3), each in its own table: the two appends are
-- the same statement (a test keeps them so) but for the table and the request's answer model.

-- name: append_request_calls
-- A request's record names its answer model (SPEC 3 model) from its first answer call on, so a
-- request cancelled while answering names it too (the cancel writes its terminal state without it).
UPDATE side_question_requests r
    SET usage = (
        SELECT jsonb_build_object(
            'input_tokens', coalesce(sum((c->>'input_tokens')::bigint), 0),
            'output_tokens', coalesce(sum((c->>'output_tokens')::bigint), 0),
            'reasoning_tokens', coalesce(sum((c->>'reasoning_tokens')::bigint), 0),
            'cached_tokens', coalesce(sum((c->>'cached_tokens')::bigint), 0),
            'calls', coalesce(jsonb_agg(c ORDER BY n), '[]'::jsonb)
        )
        FROM jsonb_array_elements(coalesce(r.usage->'calls', '[]'::jsonb) || CAST(:call AS jsonb))
            WITH ORDINALITY AS e(c, n)
    ),
    model = coalesce(r.model, (
        SELECT c->>'model' FROM jsonb_array_elements(CAST(:call AS jsonb)) AS a(c)
        WHERE c->>'purpose' = 'answer' LIMIT 1))
    WHERE r.id = :id AND NOT EXISTS (
        SELECT 1 FROM jsonb_array_elements(coalesce(r.usage->'calls', '[]'::jsonb)) AS o(c)
        WHERE o.c->>'call_id' IN (
            SELECT a.c->>'call_id' FROM jsonb_array_elements(CAST(:call AS jsonb)) AS a(c)))
    RETURNING r.usage;

-- name: append_job_calls
UPDATE side_question_jobs r
    SET usage = (
        SELECT jsonb_build_object(
            'input_tokens', coalesce(sum((c->>'input_tokens')::bigint), 0),
            'output_tokens', coalesce(sum((c->>'output_tokens')::bigint), 0),
            'reasoning_tokens', coalesce(sum((c->>'reasoning_tokens')::bigint), 0),
            'cached_tokens', coalesce(sum((c->>'cached_tokens')::bigint), 0),
            'calls', coalesce(jsonb_agg(c ORDER BY n), '[]'::jsonb)
        )
        FROM jsonb_array_elements(coalesce(r.usage->'calls', '[]'::jsonb) || CAST(:call AS jsonb))
            WITH ORDINALITY AS e(c, n)
    )
    WHERE r.id = :id AND NOT EXISTS (
        SELECT 1 FROM jsonb_array_elements(coalesce(r.usage->'calls', '[]'::jsonb)) AS o(c)
        WHERE o.c->>'call_id' IN (
            SELECT a.c->>'call_id' FROM jsonb_array_elements(CAST(:call AS jsonb)) AS a(c)))
    RETURNING r.usage;

-- name: request_usage
-- The usage as it stands, when the append changed nothing (its calls were recorded already).
SELECT usage FROM side_question_requests WHERE id = :id;

-- name: job_usage
SELECT usage FROM side_question_jobs WHERE id = :id;

-- name: merge_context_info
-- Top-level keys replaced; not lease-guarded (metadata about what was done).
UPDATE side_question_requests SET context_info = context_info || CAST(:info AS jsonb) WHERE id = :id;
