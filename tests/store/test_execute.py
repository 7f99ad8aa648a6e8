"""One statement, two executors (service.store.execute): a session and a plain asyncpg connection
must give the same rows for the same ``text()`` clause, jsonb included, inside and outside a
transaction."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import text

from service.store import terminal
from service.store.admission import Admission, admit
from service.store.db import Database
from service.store.execute import Executor, fetch_all, fetch_one, fetch_value, positional, transaction
from service.vocabulary import Status

ECHO = text(
    "SELECT CAST(:n AS integer) AS n, CAST(:doc AS jsonb) AS doc, "
    "CAST(:doc AS jsonb) -> 'k' AS k, CAST(:id AS uuid) AS id, CAST(:n AS integer) + 1 AS m"
)


def test_positional_numbers_each_name_once_in_first_use_order() -> None:
    sql, names = positional(ECHO)
    assert names == ("n", "doc", "id")
    assert "$1" in sql and "$3" in sql and "$4" not in sql and ":n" not in sql
    assert positional(ECHO) == (sql, names)  # compiled once, then reused


async def test_session_and_connection_read_the_same_row(db: Database) -> None:
    doc = {"k": ["a", 1, None], "z": {"nested": True}, "text": "é \u2028"}
    params = {"n": 41, "doc": json.dumps(doc), "id": uuid.uuid4()}
    async with db.sessions() as session:
        via_session = dict(await fetch_one(session, ECHO, params) or {})
    async with db.connection() as conn:
        via_conn = dict(await fetch_one(conn, ECHO, params) or {})
    assert via_session == via_conn
    assert via_conn["doc"] == doc and via_conn["k"] == ["a", 1, None]
    assert via_conn["n"] == 41 and via_conn["m"] == 42 and via_conn["id"] == params["id"]


async def test_a_connection_transaction_rolls_back_on_error(db: Database) -> None:
    table = text("CREATE TEMP TABLE IF NOT EXISTS t_exec (v integer)")
    insert = text("INSERT INTO t_exec VALUES (:v)")
    count = text("SELECT count(*) FROM t_exec")
    async with db.connection() as conn:
        await fetch_value(conn, table, {})
        with pytest.raises(RuntimeError):
            async with transaction(conn):
                await fetch_value(conn, insert, {"v": 1})
                raise RuntimeError("boom")
        assert await fetch_value(conn, count, {}) == 0
        async with transaction(conn):
            await fetch_value(conn, insert, {"v": 2})
        assert [dict(r) for r in await fetch_all(conn, text("SELECT v FROM t_exec"), {})] == [{"v": 2}]
        await fetch_value(conn, text("DROP TABLE t_exec"), {})


async def _succeed(x: Executor, request_id: uuid.UUID) -> terminal.Ended | None:
    async with transaction(x):
        return await terminal.finish_request(
            x, request_id, status=Status.SUCCEEDED, owner=None, from_statuses=(Status.QUEUED,), answer="a"
        )


async def test_the_terminal_transition_gives_the_same_record_on_either_executor(db: Database) -> None:
    """finish_request returns the record from the updated row itself: identical whichever way it ran."""
    records = []
    for name in ("via-session", "via-connection"):
        admitted = await admit(db, "t", name, Admission(question="q"), max_queued=20)
        request_id = uuid.UUID(admitted.record["id"])
        if name == "via-session":
            async with db.sessions() as session:
                ended = await _succeed(session, request_id)
        else:
            async with db.connection() as conn:
                ended = await _succeed(conn, request_id)
        assert ended is not None and ended.record is not None
        record = dict(ended.record)
        assert record["status"] == "succeeded" and record["finished_at"] is not None
        assert record["parent_id"] == name and record["answer"] == "a" and record["error"] is None
        records.append(
            {k: v for k, v in record.items() if k not in ("id", "parent_id", "created_at", "finished_at")}
        )
    assert records[0] == records[1]
