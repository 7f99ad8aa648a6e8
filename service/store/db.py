"""The one engine / session factory, and the schema-at-head check used by ``/readyz``."""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine


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


@dataclass
class Database:
    """An engine plus its session factory; built once per process by the entry point."""

    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]

    async def dispose(self) -> None:
        await self.engine.dispose()


def connect(url: str, *, pool_size: int = 10) -> Database:
    """Create the engine for ``url`` (``postgresql+asyncpg://…``)."""
    engine = create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        # JSONB columns hold our documents; keep key order as written.
        json_serializer=_dumps,
    )
    return Database(engine=engine, sessions=async_sessionmaker(engine, expire_on_commit=False))


def _dumps(value: object) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def head_revision() -> str:
    """The newest migration revision shipped with this code."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    head = ScriptDirectory.from_config(config).get_current_head()
    if head is None:
        raise RuntimeError("no migrations found")
    return head


async def current_revision(db: Database) -> str | None:
    """The revision the database is at, or None when it was never migrated."""
    async with db.engine.connect() as conn:
        exists = await conn.scalar(text("SELECT to_regclass('public.alembic_version') IS NOT NULL"))
        if not exists:
            return None
        revision = await conn.scalar(text("SELECT version_num FROM alembic_version"))
        return str(revision) if revision is not None else None


def upgrade_to_head(sync_url: str) -> None:
    """Run ``alembic upgrade head`` against ``sync_url`` (any SQLAlchemy URL; asyncpg is fine)."""
    from alembic import command
    from alembic.config import Config

    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", sync_url.replace("%", "%%"))
    command.upgrade(config, "head")
