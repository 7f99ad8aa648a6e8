"""snapshots TOAST-compressed with lz4 where the server has it

Revision ID: 0006_snapshot_lz4
Revises: 0005_worker_statements
Create Date: 2026-12-01 15:00:00

An inline 600 KB snapshot is stored twice over (its content as posted and its preparation) inside
the question's admission. With PostgreSQL's default pglz, compressing one such value took ~26 ms of
the admission on this machine; lz4 takes ~9 ms (stored ~2× larger than pglz, ~3× smaller than
uncompressed; reads about as fast). Only new values are compressed the new way: no table rewrite.

A server built without lz4 (the embedded PostgreSQL's binaries are one) refuses the method with
``feature_not_supported``; the columns then keep pglz and the migration still succeeds.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0006_snapshot_lz4"
down_revision: str | None = "0005_worker_statements"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        DO $$
        BEGIN
            ALTER TABLE main_snapshots
                ALTER COLUMN content SET COMPRESSION lz4,
                ALTER COLUMN prepared SET COMPRESSION lz4;
        EXCEPTION WHEN feature_not_supported THEN
            RAISE NOTICE 'this PostgreSQL has no lz4: main_snapshots stays pglz-compressed';
        END
        $$;
        """
    )


def downgrade() -> None:
    op.execute(
        "ALTER TABLE main_snapshots ALTER COLUMN content SET COMPRESSION DEFAULT, "
        "ALTER COLUMN prepared SET COMPRESSION DEFAULT"
    )
