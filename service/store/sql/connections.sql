-- What a connection asks of the node it reached (service/store/db.py, listener.py, schema.py).

-- name: node_takes_writes
-- Asked of the node, never read from the startup parameters (in_hot_standby): a PgBouncer hands
-- every client the parameters its pool saw first, so a node back as a standby looked writable.
SELECT NOT pg_catalog.pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off';

-- name: node_in_recovery
-- The LISTEN connection's probe: a node demoted under it is a standby now.
SELECT pg_catalog.pg_is_in_recovery();

-- name: schema_readiness
-- /readyz: whether the schema was ever migrated, and whether a transaction opened now could write.
SELECT to_regclass('public.alembic_version') IS NOT NULL AS migrated,
       current_setting('transaction_read_only') = 'off' AS writable;

-- name: schema_revision
SELECT version_num FROM alembic_version;
