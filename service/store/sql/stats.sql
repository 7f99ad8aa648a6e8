-- The /metrics scrape queries over stored requests and background jobs (service/store/stats.py): no
-- tenant data.

-- name: requests_by_status
SELECT status, COALESCE(error->>'code', '') AS code, count(*) AS n
FROM side_question_requests WHERE deleted_at IS NULL GROUP BY 1, 2;

-- name: request_calls
SELECT COALESCE(c->>'purpose', '') AS purpose, COALESCE(c->>'status', '') AS status, count(*) AS n
FROM side_question_requests r, jsonb_array_elements(COALESCE(r.usage->'calls', '[]'::jsonb)) c
WHERE r.deleted_at IS NULL AND jsonb_typeof(c) = 'object'
GROUP BY 1, 2;

-- name: request_call_latencies
SELECT COALESCE(c->>'purpose', '') AS purpose, (c->>'latency_ms')::float8 / 1000.0 AS seconds
FROM side_question_requests r, jsonb_array_elements(COALESCE(r.usage->'calls', '[]'::jsonb)) c
WHERE r.deleted_at IS NULL AND jsonb_typeof(c) = 'object'
  AND jsonb_typeof(c->'latency_ms') = 'number';

-- name: answer_drift
-- Drift of the answer call per stored request: provider prompt tokens / our estimate of what was
-- sent (context_info.provider_prompt_tokens and estimate.total, written together by the pipeline).
SELECT COALESCE(r.model, '') AS model,
       (r.context_info->>'provider_prompt_tokens')::float8
         / (r.context_info->'estimate'->>'total')::float8 AS ratio
FROM side_question_requests r
WHERE r.deleted_at IS NULL
  AND jsonb_typeof(r.context_info->'provider_prompt_tokens') = 'number'
  AND jsonb_typeof(r.context_info->'estimate'->'total') = 'number'
  AND (r.context_info->'estimate'->>'total')::float8 > 0;

-- name: job_outcomes
-- /metrics: background jobs by kind and status.
SELECT kind, status, count(*) AS n FROM side_question_jobs
WHERE coalesce(params->>'made_by', 'background') = 'background' GROUP BY 1, 2;

-- name: job_calls
-- /metrics: background calls by kind and call status.
SELECT j.kind, coalesce(c->>'status', '') AS status, count(*) AS n
FROM side_question_jobs j, jsonb_array_elements(coalesce(j.usage->'calls', '[]'::jsonb)) c
WHERE coalesce(j.params->>'made_by', 'background') = 'background' AND jsonb_typeof(c) = 'object'
GROUP BY 1, 2;

-- name: job_tokens
-- /metrics: background tokens by kind and direction.
SELECT kind, 'input' AS direction, coalesce(sum((usage->>'input_tokens')::bigint), 0) AS n
FROM side_question_jobs WHERE coalesce(params->>'made_by', 'background') = 'background' GROUP BY 1
UNION ALL
SELECT kind, 'output', coalesce(sum((usage->>'output_tokens')::bigint), 0)
FROM side_question_jobs WHERE coalesce(params->>'made_by', 'background') = 'background' GROUP BY 1;

-- name: all_calibrations
-- /metrics: every (provider, model)'s calibration counters.
SELECT provider, model, samples, sum_estimate, sum_provider FROM sidequest_calibration
ORDER BY provider, model;
