"""One named query, two ways to run it, alike (a jsonb parameter is JSON text, rows are read by
column name): on an ``AsyncSession`` or on a plain asyncpg connection, the worker's hot path
(docs/architecture.md, "Two ways to run a statement", says why)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import cache
from typing import Any, TypeAlias, TypeVar

import asyncpg
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import asyncpg as pg_asyncpg
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import TextClause

from service.store import queries

Executor: TypeAlias = AsyncSession | asyncpg.Connection
Row: TypeAlias = Mapping[Any, Any]
Model = TypeVar("Model")

_DIALECT = pg_asyncpg.dialect()  # type: ignore[no-untyped-call]


def json_text(value: Any) -> str:
    """A jsonb parameter as both kinds of connection take it: compact JSON text, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


async def notify(x: Executor, channel: str, payload: str) -> None:
    """``NOTIFY channel, payload`` inside ``x``'s transaction (delivered when it commits)."""
    await execute(x, queries.notify, {"channel": channel, "payload": payload})


@cache
def positional(clause: TextClause) -> tuple[str, tuple[str, ...]]:
    """``clause`` as asyncpg runs it, compiled once: the ``$n`` SQL and the parameter names in order."""
    compiled = clause.compile(dialect=_DIALECT)
    return compiled.string, tuple(compiled.positiontup or ())


def _args(clause: TextClause, params: Mapping[str, Any]) -> list[Any]:
    sql, names = positional(clause)
    return [sql, *(params[name] for name in names)]


async def fetch_one(x: Executor, clause: TextClause, params: Mapping[str, Any]) -> Row | None:
    """The first row of ``clause`` (or None), inside whatever transaction ``x`` is in."""
    if isinstance(x, AsyncSession):
        return (await x.execute(clause, dict(params))).mappings().first()
    row: Row | None = await x.fetchrow(*_args(clause, params))
    return row


async def fetch_all(x: Executor, clause: TextClause, params: Mapping[str, Any]) -> list[Row]:
    if isinstance(x, AsyncSession):
        return list((await x.execute(clause, dict(params))).mappings().all())
    return list(await x.fetch(*_args(clause, params)))


async def fetch_value(x: Executor, clause: TextClause, params: Mapping[str, Any]) -> Any:
    """The first column of the first row (None when there is no row)."""
    if isinstance(x, AsyncSession):
        return await x.scalar(clause, dict(params))
    return await x.fetchval(*_args(clause, params))


async def execute(x: Executor, clause: TextClause, params: Mapping[str, Any]) -> None:
    if isinstance(x, AsyncSession):
        await x.execute(clause, dict(params))
        return
    await x.execute(*_args(clause, params))


async def fetch_models(
    tx: AsyncSession, model: type[Model], clause: TextClause, params: Mapping[str, Any]
) -> list[Model]:
    """The rows of ``clause`` (a table's own columns) as ``model`` objects of ``tx``, refreshed."""
    statement = select(model).from_statement(clause).execution_options(populate_existing=True)
    return list(await tx.scalars(statement, dict(params)))


@asynccontextmanager
async def transaction(x: Executor) -> AsyncIterator[None]:
    """Open and commit one transaction on ``x`` (a fresh session, or a connection in none)."""
    async with x.begin() if isinstance(x, AsyncSession) else x.transaction():
        yield


@asynccontextmanager
async def committed(conn: asyncpg.Connection) -> AsyncIterator[None]:
    """Around ONE statement that must commit on a plain connection (not in a transaction): nothing at
    all, since a statement outside a transaction block commits by itself."""
    assert not conn.is_in_transaction(), "committed() on a connection inside a transaction"
    yield
