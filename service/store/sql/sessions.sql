-- Sessions, requests and snapshots as the API reads them (service/store/sessions.py). Every lookup
-- takes the tenant: another tenant's session or request is "not found" (SPEC 3).

-- name: find_session
SELECT * FROM side_question_sessions WHERE tenant = :tenant AND parent_id = :parent_id;

-- name: lock_session
-- NO KEY UPDATE, not UPDATE: see sessions.lock_or_create_session.
SELECT * FROM side_question_sessions WHERE tenant = :tenant AND parent_id = :parent_id
FOR NO KEY UPDATE;

-- name: create_session
INSERT INTO side_question_sessions (id, tenant, parent_id)
VALUES (gen_random_uuid(), :tenant, :parent_id)
ON CONFLICT ON CONSTRAINT uq_sessions_tenant_parent DO NOTHING;

-- name: find_request
-- A visible (not cleared) request of the tenant.
SELECT r.* FROM side_question_requests r
JOIN side_question_sessions s ON s.id = r.session_id
WHERE r.id = :request_id AND r.deleted_at IS NULL AND s.tenant = :tenant;

-- name: status_counts
SELECT session_id, status, count(*) AS n FROM side_question_requests
WHERE session_id = ANY(CAST(:session_ids AS uuid[])) AND deleted_at IS NULL
GROUP BY session_id, status;

-- name: request_page
-- The newest :limit visible requests with ordinal < :before (any when null), newest first.
SELECT * FROM side_question_requests
WHERE session_id = :session_id AND deleted_at IS NULL
  AND (CAST(:before AS integer) IS NULL OR ordinal < CAST(:before AS integer))
ORDER BY ordinal DESC
LIMIT :limit;

-- name: latest_question_options
SELECT options FROM side_question_requests WHERE session_id = :session_id
ORDER BY ordinal DESC
LIMIT 1;

-- name: insert_snapshot
-- content as posted, key order kept (json, not jsonb); both documents are JSON text already
-- encoded, cast by PostgreSQL (the driver would serialise them again).
INSERT INTO main_snapshots (
    session_id, snapshot_id, content, content_hash, token_estimate, size_bytes, prepared,
    prepared_version
) VALUES (
    :session_id, :snapshot_id, CAST(CAST(:content AS text) AS json), :content_hash, :token_estimate,
    :size_bytes, CAST(CAST(:prepared AS text) AS json), :prepared_version
)
ON CONFLICT (session_id, snapshot_id) DO NOTHING
RETURNING created_at;

-- name: stored_snapshot
SELECT content_hash, token_estimate, size_bytes, created_at FROM main_snapshots
WHERE session_id = :session_id AND snapshot_id = :snapshot_id;

-- name: sessions_page
-- GET /v1/sessions: the tenant's sessions after the cursor (:updated_at, :id; none: from the
-- newest), most recently active first, walking ix_sessions_tenant_activity backwards.
SELECT * FROM side_question_sessions
WHERE tenant = :tenant
  AND (CAST(:updated_at AS timestamptz) IS NULL
       OR (updated_at, id) < (CAST(:updated_at AS timestamptz), CAST(:id AS uuid)))
ORDER BY updated_at DESC, id DESC
LIMIT :limit;
