"""The migration chain round-trips on a real PostgreSQL and matches the ORM models (no drift)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, inspect

from service.store import queries
from service.store.schema import ALEMBIC_INI, MIGRATIONS_DIR
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


def test_snapshots_are_lz4_compressed_where_the_server_has_lz4(scratch_url: str) -> None:
    """Migration 0006: lz4 on a server built with it, pglz (and a successful migration) without."""
    command.upgrade(_config(scratch_url), "head")
    engine = create_engine(scratch_url.replace("+asyncpg", "+psycopg2"))
    try:
        with engine.connect() as conn:
            try:
                with conn.begin_nested():
                    conn.exec_driver_sql("CREATE TEMP TABLE lz4_probe (v text COMPRESSION lz4)")
                has_lz4 = True
            except Exception as exc:  # psycopg2's FeatureNotSupported, wrapped by SQLAlchemy
                assert "lz4" in str(exc)
                has_lz4 = False
            methods: dict[str, str] = dict(
                conn.exec_driver_sql(
                    "SELECT attname, attcompression FROM pg_attribute "
                    "WHERE attrelid = 'main_snapshots'::regclass AND attname IN ('content', 'prepared')"
                ).all()
            )
    finally:
        engine.dispose()
    assert methods == ({"content": "l", "prepared": "l"} if has_lz4 else {"content": "", "prepared": ""})


def _admit_now_source(url: str) -> str:
    engine = create_engine(url.replace("+asyncpg", "+psycopg2"))
    try:
        with engine.connect() as conn:
            return str(
                conn.exec_driver_sql("SELECT pg_get_functiondef('sidequest_admit_now'::regproc)").scalar()
            )
    finally:
        engine.dispose()


def test_the_admission_notifies_in_a_transaction_that_does_not_wait_for_a_flush(scratch_url: str) -> None:
    """Migration 0007: after the rows' COMMIT (which still waits for its flush), the notifying
    transaction sets synchronous_commit off for itself only; its downgrade restores 0003's body."""
    config = _config(scratch_url)
    command.upgrade(config, "head")
    body = _admit_now_source(scratch_url)
    commit, async_commit, notify = (
        body.index("COMMIT;"),
        body.index("set_config('synchronous_commit', 'off', true)"),
        body.index("pg_notify"),
    )
    assert commit < async_commit < notify
    command.downgrade(config, "0006_snapshot_lz4")
    assert "synchronous_commit" not in _admit_now_source(scratch_url)


def test_migrating_from_the_service_leaves_its_logging_as_it_was(scratch_url: str) -> None:
    """alembic.ini's logging setup must not run inside `sidequest serve`: it sets the root logger to
    WARNING, and no INFO line of the service (worker started, request ended…) would show."""
    import logging

    from service.store.schema import upgrade_to_head

    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    root.setLevel(logging.INFO)
    try:
        upgrade_to_head(scratch_url)
        assert root.level == logging.INFO and root.handlers == handlers
    finally:
        root.setLevel(level)


def test_processes_started_together_on_a_fresh_database_all_migrate(scratch_url: str) -> None:
    """An api and workers each migrate first: started at once on an empty database they would race
    to create the same tables and exit on a duplicate key, so they migrate one at a time."""
    env = {**os.environ, "SIDEQUEST_DATABASE_URL": scratch_url}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "service.cli", "migrate"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 4, outputs
    assert "alembic_version" in _tables(scratch_url)


def _function_definitions(url: str) -> dict[str, str]:
    engine = create_engine(url.replace("+asyncpg", "+psycopg2"))
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql(
                "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p "
                "JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = 'public' AND p.proname LIKE 'sidequest%%'"
            ).all()
    finally:
        engine.dispose()
    return {str(signature): str(definition) for signature, definition in rows}


def test_the_sql_home_and_its_successors_go_back_to_exactly_the_functions_the_database_had(
    scratch_url: str,
) -> None:
    """0011_sql_home moved the definitions into service/store/sql/*.sql without changing one; every
    later migration that applies the files again keeps the definitions it replaces for its downgrade.
    So upgrading to the head and back down to 0011 leaves exactly the functions 0003–0010 had left
    (tests/store/test_sql_home.py checks the files against the head; this, against the history)."""
    config = _config(scratch_url)
    command.upgrade(config, "0010_session_cleared")
    before = _function_definitions(scratch_url)
    command.upgrade(config, "head")
    assert len(_function_definitions(scratch_url)) == len(queries.definitions())
    command.downgrade(config, "0011_sql_home")
    assert _function_definitions(scratch_url) == before
