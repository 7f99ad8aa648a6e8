"""The schema's migrations (Alembic, shipped with the code) and the readiness check that the database is
at their head and takes writes (``/readyz``)."""

from __future__ import annotations

import asyncio
import sysconfig
from pathlib import Path
from typing import Any, Final

from service.store import queries
from service.store.db import Database


def _alembic_home() -> Path:
    """Where ``alembic.ini`` and ``migrations/`` are: the source tree (a checkout, an editable install),
    else the wheel's data files under ``<prefix>/share/sidequest`` (``pip install .``, the Docker image)."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "alembic.ini").is_file():
        return checkout
    return Path(sysconfig.get_path("data")) / "share" / "sidequest"


ROOT = _alembic_home()
ALEMBIC_INI = ROOT / "alembic.ini"
MIGRATIONS_DIR = ROOT / "migrations"


def _alembic_config() -> Any:
    """The service's Alembic configuration, the service's own logging left as it is (alembic.ini's
    would set the root logger to WARNING and silence every INFO line of the process after start-up)."""
    from alembic.config import Config

    config = Config(str(ALEMBIC_INI))
    config.attributes["configure_logger"] = False
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str:
    """The newest migration revision shipped with this code."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError("no migrations found")
    return head


# A readiness probe answers within this (a database that accepts connections but never answers — a
# frozen or overloaded server — is not ready, and a probe must say so before its own timeout).
READINESS_TIMEOUT_S: Final = 3.0


async def readiness(db: Database) -> tuple[str | None, bool]:
    """``(revision, accepts writes)`` on one connection: the schema's revision (None: never migrated) and
    whether a new transaction could write (not on a standby, nor under ``default_transaction_read_only``)."""
    async with asyncio.timeout(READINESS_TIMEOUT_S), db.engine.connect() as conn:
        row = (await conn.execute(queries.schema_readiness)).one()
        writable = bool(row.writable)
        if not row.migrated:
            return None, writable
        revision = await conn.scalar(queries.schema_revision)
        return (str(revision) if revision is not None else None), writable


# The advisory lock every migration run holds (migrations/env.py): one at a time per database.
MIGRATION_LOCK_KEY: Final = 0x51DE0E57


def upgrade_to_head(sync_url: str) -> None:
    """Run ``alembic upgrade head`` against ``sync_url`` (any SQLAlchemy URL; asyncpg is fine)."""
    from alembic import command

    config = _alembic_config()
    config.set_main_option("sqlalchemy.url", sync_url.replace("%", "%%"))
    command.upgrade(config, "head")
