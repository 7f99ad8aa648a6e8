"""the SQL functions get one visible home: service/store/sql/*.sql, applied from there

Revision ID: 0011_sql_home
Revises: 0010_session_cleared
Create Date: 2026-12-06 03:40:00

Migrations 0003–0009 each wrote their PL/pgSQL inline, and later ones replaced
functions of earlier ones (0007 rewrote 0003's ``sidequest_admit_now``), so what the database runs
today could only be found by replaying the chain in one's head. The current definitions now live in
``service/store/sql/*.sql`` (one file per concern, each function once, beside the named queries of
the same concern: ``service/store/queries.py`` reads them) and this migration (re)creates every one
from there. It changes nothing: the definitions are exactly those the database had at 0010, so the
downgrade has nothing to undo.

The earlier migrations keep their inline SQL: they are the history, and a fresh database still
replays them before this one.

**A function's next change** is made in its ``.sql`` file *and* a new migration that applies the
files again, the way this one does, recording :func:`service.store.queries.definitions_digest` as
``FUNCTIONS_SHA256`` and, for its downgrade, the definitions it replaces (inline: they are history
then). tests/store/test_sql_home.py fails while the newest such migration's digest is not the files'
and while the migrated database's functions differ from the files. A function dropped or renamed
also needs its ``DROP`` in that migration (a fresh database replaying this one meanwhile creates
whatever the files define then: PL/pgSQL bodies are only parsed, not resolved, when created).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from service.store import queries

revision: str = "0011_sql_home"
down_revision: str | None = "0010_session_cleared"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# queries.definitions_digest() of the files this migration was written for.
FUNCTIONS_SHA256 = "4a94053769b23c93c388f6e7d3dbac84cb0e802f2e3a17f0bce0b7f9d3bf013c"


def upgrade() -> None:
    # exec_driver_sql, not op.execute: the statement goes as it is in the file, never parsed for
    # ``:name`` bind parameters.
    connection = op.get_bind()
    for definition in queries.definitions():
        connection.exec_driver_sql(definition.sql)


def downgrade() -> None:
    # Nothing to undo: 0011 re-created the definitions 0010 already had (see above).
    pass
