"""Alembic environment: async engine on asyncpg, URL from ``sqlalchemy.url`` or the service settings."""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from service.config import SettingsError, asyncpg_url, load_settings
from service.store.db import migration_engine
from service.store.models import Base
from service.store.schema import MIGRATION_LOCK_KEY

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    """``sqlalchemy.url`` (set by ``upgrade_to_head``), else the settings' ``SIDEQUEST_DATABASE_URL``.

    Both go through ``service.config``: one place reads the environment, one rewrites the URL.
    """
    url = asyncpg_url(config.get_main_option("sqlalchemy.url"))
    if url is None:
        try:
            url = load_settings().database_url
        except SettingsError as exc:
            raise RuntimeError(str(exc)) from None
    if not url:
        raise RuntimeError("set SIDEQUEST_DATABASE_URL (postgresql+asyncpg://…) to run migrations")
    return url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        # One migration at a time: processes started together on a fresh database (an api and a
        # worker, a fleet) each migrate first, and without this race to create the same tables (all
        # but one would exit). The next one waits here, then finds the schema at head.
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        context.run_migrations()


async def _run_async() -> None:
    engine = migration_engine(_url())
    async with engine.connect() as connection:
        await connection.run_sync(_run)
    await engine.dispose()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    asyncio.run(_run_async())


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
