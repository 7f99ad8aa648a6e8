"""The migration chain round-trips on a real PostgreSQL and matches the ORM models (no drift)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, inspect

from service.store.db import ALEMBIC_INI, MIGRATIONS_DIR
from tests import pg


@pytest.fixture
def scratch_url(pg_server: pg.Server) -> Iterator[str]:
    url = asyncio.run(pg.create_database(pg_server.admin_url))
    try:
        yield url
    finally:
        asyncio.run(pg.drop_database(pg_server.admin_url, url))


def _config(url: str) -> Config:
    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url)
    config.attributes["configure_logger"] = False
    return config


def _tables(url: str) -> set[str]:
    engine = create_engine(url.replace("+asyncpg", "+psycopg2"))
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_check_downgrade_round_trip(scratch_url: str) -> None:
    config = _config(scratch_url)
    command.upgrade(config, "head")
    assert {
        "side_question_sessions",
        "side_question_requests",
        "side_question_events",
        "main_snapshots",
    } <= _tables(scratch_url)
    # `alembic check` raises when autogenerate finds differences between models and schema.
    command.check(config)
    command.downgrade(config, "base")
    assert _tables(scratch_url) <= {"alembic_version"}
    command.upgrade(config, "head")
    command.check(config)
