"""The one engine / session factory, and the schema-at-head check used by ``/readyz``."""

from __future__ import annotations

import asyncio
import json
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
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
    """An engine plus its session factory; built once per process by the entry point.

    Beside SQLAlchemy's pool it keeps a small plain asyncpg pool for the one-statement hot paths
    (admission): SQLAlchemy's ``pool_pre_ping`` costs three round trips per checkout (BEGIN, ping,
    ROLLBACK) and its transaction two more, around a statement that needs none of them. asyncpg's
    pool replaces a connection the server closed (restart, failover) when it is next acquired.
    """

    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    url: str = ""
    pool_size: int = 10
    _raw: Any = field(default=None, repr=False)
    _raw_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    async def raw_pool(self) -> asyncpg.Pool:
        """The plain asyncpg pool (created on first use); jsonb decodes to Python objects."""
        if self._raw is None:
            async with self._raw_lock:
                if self._raw is None:
                    self._raw = await asyncpg.create_pool(
                        self.url.replace("postgresql+asyncpg://", "postgresql://", 1),
                        min_size=1,
                        max_size=self.pool_size,
                        init=_init_raw,
                        reset=_keep_session,
                    )
        pool: asyncpg.Pool = self._raw
        return pool

    async def dispose(self) -> None:
        if self._raw is not None:
            raw, self._raw = self._raw, None
            await raw.close()
        await self.engine.dispose()


async def _init_raw(conn: asyncpg.Connection) -> None:
    # Binary (version byte 1, then the JSON text): composite values (a whole row) that hold jsonb
    # can only be decoded when every field has a binary codec.
    await conn.set_type_codec(
        "jsonb",
        encoder=lambda value: b"\x01" + _dumps(value).encode("utf-8"),
        decoder=lambda data: json.loads(data[1:]),
        schema="pg_catalog",
        format="binary",
    )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """No reset query on release (asyncpg's default is a round trip per release): the raw pool only
    runs single statements that leave no session state (no SET, LISTEN or session-level lock), and
    asyncpg still rolls back a transaction left open before calling this."""


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
    return Database(
        engine=engine,
        sessions=async_sessionmaker(engine, expire_on_commit=False),
        url=url,
        pool_size=pool_size,
    )


def _dumps(value: object) -> str:
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
