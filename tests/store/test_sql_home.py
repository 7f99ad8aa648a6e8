"""The store's SQL has one home, ``service/store/sql/*.sql`` (service/store/queries.py): the migrated
database runs exactly the functions the files define, no others; a changed definition comes with a
migration; every named query the store uses is defined there, and every defined one is used."""

from __future__ import annotations

import ast
import tomllib
import uuid
from collections import Counter
from pathlib import Path

import asyncpg
import pytest
from alembic.script import ScriptDirectory

from service.store import queries
from service.store.db import plain_dsn
from service.store.schema import MIGRATIONS_DIR

SERVICE = Path(queries.__file__).resolve().parents[1]
PYPROJECT = SERVICE.parent / "pyproject.toml"


async def _definition(conn: asyncpg.Connection, schema: str, name: str) -> str:
    rows = await conn.fetch(
        "SELECT pg_get_functiondef(p.oid) AS def FROM pg_proc p "
        "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1 AND p.proname = $2",
        schema,
        name,
    )
    assert len(rows) == 1, f"{schema}.{name}: {len(rows)} definitions"
    definition: str = rows[0]["def"]
    return definition.replace(f"FUNCTION {schema}.{name}(", f"FUNCTION public.{name}(", 1).replace(
        f"PROCEDURE {schema}.{name}(", f"PROCEDURE public.{name}(", 1
    )


async def test_every_function_of_the_files_is_the_migrated_databases_definition(database_url: str) -> None:
    """Each file's definition, created in a scratch schema, reads back (``pg_get_functiondef``:
    signature, result, language, volatility, settings, body) exactly as the migrated database's."""
    scratch = f"sql_home_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(plain_dsn(database_url))
    try:
        differing = []
        for definition in queries.definitions():
            transaction = conn.transaction()
            await transaction.start()
            try:
                await conn.execute(f"CREATE SCHEMA {scratch}")
                # Types resolve in public as in the database; the new function lands in the scratch schema.
                await conn.execute(f"SET LOCAL search_path = {scratch}, public")
                await conn.execute(definition.sql)
                from_file = await _definition(conn, scratch, definition.name)
                in_database = await _definition(conn, "public", definition.name)
            finally:
                await transaction.rollback()
            if from_file != in_database:
                differing.append(f"{definition.file}: {definition.name}")
        assert differing == [], "the migrated database's definitions differ from the files"
    finally:
        await conn.close()


async def test_the_database_has_no_sidequest_function_the_files_do_not_define(database_url: str) -> None:
    conn = await asyncpg.connect(plain_dsn(database_url))
    try:
        names = await conn.fetch(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'public' AND p.proname LIKE 'sidequest\\_%'"
        )
    finally:
        await conn.close()
    # A Counter: an overload left behind by a changed signature counts twice.
    assert Counter(row["proname"] for row in names) == Counter(d.name for d in queries.definitions())


def test_the_newest_migration_that_applies_the_files_was_written_for_them() -> None:
    """A definition changed in its file without a migration would reach a fresh database (0011 applies
    the files as they are) but never an existing one: the migration that last applied the files
    records their digest, and it must be theirs."""
    script = ScriptDirectory(str(MIGRATIONS_DIR))
    for revision in script.walk_revisions():
        recorded = getattr(revision.module, "FUNCTIONS_SHA256", None)
        if recorded is not None:
            assert recorded == queries.definitions_digest(), (
                f"service/store/sql/*.sql changed since {revision.revision}: add a migration that applies "
                f"the files again (as 0011_sql_home does) with FUNCTIONS_SHA256 = "
                f"{queries.definitions_digest()!r}"
            )
            return
    pytest.fail("no migration applies service/store/sql/*.sql")


_API = {"Section", "definitions", "definitions_digest", "named", "parse", "sections"}


def test_every_query_the_service_names_is_defined_and_every_defined_one_is_used() -> None:
    used: set[str] = set()
    for path in SERVICE.rglob("*.py"):
        used |= {
            node.attr
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "queries"
        }
    defined = set(queries.named())
    assert used - _API - defined == set(), "used but not defined in service/store/sql/*.sql"
    assert defined - used == set(), "defined in service/store/sql/*.sql but never used"


def test_the_sql_files_are_package_data() -> None:
    """``sidequest migrate`` / ``serve`` from an installed package read them from the package."""
    package_data = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]
    assert "sql/*.sql" in package_data["service.store"]
    assert not list((SERVICE / "store" / "sql").glob("**/*/*.sql")), "sql/ has no subdirectories"


def test_a_file_is_parsed_into_named_sections_without_their_comments() -> None:
    source = (
        "-- What this file holds.\n\n"
        "-- name: one_job\n-- What it reads.\nSELECT *\nFROM side_question_jobs WHERE id = :id;\n\n"
        "-- function: sidequest_x\n-- Why.\nCREATE OR REPLACE FUNCTION sidequest_x() RETURNS int\n"
        "LANGUAGE sql AS $$ SELECT 1 $$;\n"
    )
    assert queries.parse(source, "f.sql") == [
        queries.Section("name", "one_job", "f.sql", "SELECT *\nFROM side_question_jobs WHERE id = :id"),
        queries.Section(
            "function",
            "sidequest_x",
            "f.sql",
            "CREATE OR REPLACE FUNCTION sidequest_x() RETURNS int\nLANGUAGE sql AS $$ SELECT 1 $$;",
        ),
    ]


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("SELECT 1;\n-- name: a\nSELECT 2;\n", "before the first"),
        ("-- name: a\nSELECT 2\n", "does not end with ';'"),
        (
            "-- function: sidequest_a\nCREATE OR REPLACE FUNCTION sidequest_b() RETURNS int AS $$ $$;\n",
            "must be",
        ),
    ],
)
def test_a_malformed_file_is_refused(source: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        queries.parse(source, "f.sql")


def _between(statement: str, start: str, end: str) -> str:
    return statement[statement.index(start) : statement.index(end)]


def test_the_statements_written_twice_in_the_files_stay_the_same() -> None:
    """A rule two statements share is written out in each (a named query is one whole statement):
    the memory value of both guarded writes, the ledger's append for both tables, the snapshot time
    that the hand-off and the fold read."""
    request, job = queries.save_memory_of_request.text, queries.save_memory_of_job.text
    assert _between(request, "SET memory", "FROM side_question_requests r\n") == _between(
        job, "SET memory", "FROM side_question_jobs j\n"
    )
    request, job = queries.append_request_calls.text, queries.append_job_calls.text
    model = _between(request, ",\n    model = ", "\n    WHERE r.id")
    assert request.replace(model, "").replace("side_question_requests", "side_question_jobs") == job
    taken_at = _between(queries.latest_context_time.text, "CROSS JOIN LATERAL", " t\n")
    assert taken_at in queries.handoff_candidates.text


def test_the_admission_calls_take_their_parameters_in_the_order_the_batcher_passes_them() -> None:
    """The batcher runs the CALLs on a plain asyncpg pool by position (admission._arguments)."""
    from service.store.admission import _PARAMS
    from service.store.execute import positional

    assert positional(queries.admit_now)[1] == _PARAMS
    assert positional(queries.admit_many)[1] == _PARAMS
