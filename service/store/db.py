"""The one engine / session factory, every connection to the primary, and what counts as "the
database is unreachable" (SPEC §9, one ``503 service_unavailable`` for all of it). Nothing may hang
while PostgreSQL is away: connecting, a statement and a pool checkout each have a timeout. The
failover design is in docs/architecture.md, "Past one database machine"."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
from sqlalchemy import event, pool
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from service.config import shown_url, url_hosts
from service.store import queries
from service.store.admission_batch import AdmissionBatcher
from service.store.execute import json_text, positional

# Outage bounds (SPEC §9: "within a few seconds, never a hang") for when nothing answers at all (a
# dead host, a half-open socket). 5 s, not less: a loaded machine can take a second or two to accept
# a connection, and a spurious 503 under load would be worse than a slower one in a real outage.
CONNECT_TIMEOUT_S: Final = 5.0
POOL_TIMEOUT_S: Final = 5.0
# Our statements are short (no transaction spans a model call); a 32 MiB snapshot insert takes well
# under a second locally. A statement still running after this is treated as an outage.
COMMAND_TIMEOUT_S: Final = 10.0


class DatabaseUnavailable(Exception):
    """PostgreSQL cannot be reached (refused, dropped, timed out); the API answers 503."""


# PostgreSQL's own "cannot serve you now" states, in two kinds. The node is gone (SPEC 9.1): admin or crash
# shutdown (57P01, 57P02), starting up or shutting down (57P03), a read-only transaction (25006: a standby or
# a demoted primary); the connection would reach it again, so it is dropped for one to the primary.
NODE_GONE_STATES: Final = frozenset({"57P01", "57P02", "57P03", "25006"})
# The node is there but busy: too many connections (53300) or a database not accepting connections (55000:
# ``ALLOW_CONNECTIONS false``; no statement of ours raises it otherwise): reconnecting all adds to the crowd.
_BUSY_STATES: Final = frozenset({"53300", "55000"})
_SHUTDOWN_STATES: Final = NODE_GONE_STATES | _BUSY_STATES


def driver_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every error the driver's wrappers hold inside it, each once (``DBAPIError.orig``,
    the ``__cause__`` of SQLAlchemy's errors). Only those: another library's error that merely
    happened while handling an OSError (an HTTP timeout, say) is not the database's."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, sa_exc.DBAPIError):
            pending.append(current.orig)
        if isinstance(current, sa_exc.SQLAlchemyError) or type(current).__module__.startswith("sqlalchemy"):
            pending.append(current.__cause__)


def is_unavailable(exc: BaseException, *, include_timeouts: bool = True) -> bool:
    """Whether ``exc`` (or what it wraps, :func:`driver_chain`) means the database is unreachable
    rather than a bug. asyncpg's timeouts are bare ``TimeoutError``s; ``include_timeouts=False``
    leaves those out, for a caller whose own deadline has passed (``pipeline.failures.database_gone``)."""
    for current in driver_chain(exc):
        if isinstance(current, TimeoutError):  # before OSError: TimeoutError is one
            if include_timeouts:
                return True
            continue
        if isinstance(
            current,
            DatabaseUnavailable | OSError | sa_exc.TimeoutError | asyncpg.PostgresConnectionError,
        ):
            return True
        if isinstance(current, asyncpg.PostgresError) and current.sqlstate in _SHUTDOWN_STATES:
            return True
        if isinstance(current, asyncpg.InterfaceError) and any(
            # A connection its server ended: "released" once asyncpg has read the goodbye (the pool
            # then detaches it from its proxy).
            words in str(current)
            for words in ("connection is closed", "released back to the pool")
        ):
            return True
        if isinstance(current, asyncpg.InternalClientError) and "another operation" in str(current):
            # "cannot switch to state N; another operation is in progress": a connection left
            # mid-protocol by its server going away, not a wrong statement.
            return True
        if isinstance(current, sa_exc.DBAPIError) and current.connection_invalidated:
            return True
    return False


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc``'s connection must run no other statement: unavailable, and not just busy."""
    return is_unavailable(exc) and not any(
        isinstance(current, asyncpg.PostgresError) and current.sqlstate in _BUSY_STATES
        for current in driver_chain(exc)
    )


def unusable_reason(exc: BaseException) -> str | None:
    """Why the database cannot be used at all, in the driver's words: unreachable, our credentials
    refused (SQLSTATE class 28) or no such database (3D000); None for anything else (a bug)."""
    for current in driver_chain(exc):
        state = current.sqlstate if isinstance(current, asyncpg.PostgresError) else None
        if state is not None and (state.startswith("28") or state == "3D000"):
            return str(current)
    if not is_unavailable(exc):
        return None
    for current in driver_chain(exc):  # the driver's own words, not SQLAlchemy's wrapping of them
        if isinstance(current, OSError | asyncpg.PostgresError | asyncpg.InterfaceError):
            return str(current) or type(current).__name__
    return str(exc) or "the database did not answer in time"


# While the database is away, loops and driver retries say so in one line this often, not a traceback per try.
OUTAGE_LOG_EVERY_S: Final = 30.0


@dataclass
class OutageLog:
    """When each kind of failure for want of the database was last said: its owner (a worker, the
    listener, the driver's log filter) says it once per :data:`OUTAGE_LOG_EVERY_S`."""

    said_at: dict[str, float] = field(default_factory=dict)

    def due(self, what: str) -> bool:
        """Whether the line about ``what`` is due now (then it counts as said)."""
        now = time.monotonic()
        if now - self.said_at.get(what, -OUTAGE_LOG_EVERY_S) < OUTAGE_LOG_EVERY_S:
            return False
        self.said_at[what] = now
        return True


class QuietOutages(logging.Filter):
    """asyncpg's pool logs "Failed to restore the pool connection floor; retrying" with a traceback each try
    while PostgreSQL is away: here one line per :data:`OUTAGE_LOG_EVERY_S`, no traceback; all else passes."""

    def __init__(self) -> None:
        super().__init__()
        self.outages = OutageLog()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or not is_unavailable(exc):
            return True
        if not self.outages.due(f"{record.name}: {record.msg}"):
            return False
        record.msg = f"{record.getMessage()} (the database is unavailable: {unusable_reason(exc) or exc})"
        record.args = ()
        record.exc_info = None
        record.exc_text = None
        return True


def quiet_driver_outages() -> None:
    pool_log = logging.getLogger("asyncpg.pool")
    if not any(isinstance(f, QuietOutages) for f in pool_log.filters):
        pool_log.addFilter(QuietOutages())


# What a best-effort database step (a calibration sample, a metrics scrape) catches: the errors
# :func:`is_unavailable` can recognise (callers still ask it when a bug must not be swallowed).
DB_ERRORS: Final = (
    DatabaseUnavailable,
    OSError,
    TimeoutError,
    sa_exc.SQLAlchemyError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)


Pooler = Literal["none", "transaction"]


class ServerConnection(asyncpg.Connection):  # type: ignore[misc]
    """Every connection of the service: a statement given up on (its timeout, a cancelled task) is abandoned
    with its connection, never cancelled on the server (asyncpg's CancelRequest): a cancelled COMMIT waiting
    for its synchronous standby shows on the primary first, and a failover then loses a row readers saw."""

    def _cancel_current_command(self, waiter: asyncio.Future[Any], cancel_waiter: Any = None) -> None:
        if not waiter.done():
            waiter.set_result(None)
        # Not inside the protocol's own step (it is still switching state): on the next one.
        self._loop.call_soon(self.terminate)


def _single_host_dsns(dsn: str) -> Iterator[str]:
    """One DSN per host of a multi-host ``dsn`` (libpq's ``h1:5432,h2:5432``), each keeping the query
    but ``target_session_attrs``: :func:`open_connection` asks each node itself."""
    parts = urlsplit(dsn)
    userinfo, at, _ = parts.netloc.rpartition("@")
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "target_session_attrs"]
    for host, port in url_hosts(dsn):
        shown = f"[{host}]" if ":" in host else host
        netloc = f"{userinfo}{at}{shown}" + (f":{port}" if port is not None else "")
        yield urlunsplit(parts._replace(netloc=netloc, query=urlencode(query)))


class NotWritable(Exception):
    """The host answered, but it is a standby (or read-only) now."""


async def _writable_connection(dsn: str, options: dict[str, Any]) -> asyncpg.Connection:
    conn: asyncpg.Connection = await asyncpg.connect(dsn, **options)
    try:
        # Asked of the node itself (sql/connections.sql says why).
        writable = await conn.fetchval(positional(queries.node_takes_writes)[0], timeout=CONNECT_TIMEOUT_S)
    except BaseException:
        conn.terminate()
        raise
    if not writable:
        conn.terminate()
        raise NotWritable(f"{shown_url(dsn)} is a standby or read-only now")
    return conn


async def open_connection(
    dsn: str,
    *,
    unnamed_statements: bool = False,
    command_timeout: float | None = COMMAND_TIMEOUT_S,
    **kwargs: Any,
) -> asyncpg.Connection:
    """A :class:`ServerConnection` to ``dsn``; with several hosts, all tried at once, to the first that takes
    writes (asyncpg's multi-host connect stops at the first server error, all a PgBouncer before a dead node
    answers). ``unnamed_statements``: for a transaction-mode pooler; ``kwargs``: from asyncpg's pool."""
    kwargs.pop("loop", None)
    kwargs["connection_class"] = ServerConnection
    options: dict[str, Any] = {"timeout": CONNECT_TIMEOUT_S, "command_timeout": command_timeout, **kwargs}
    if unnamed_statements:
        options["statement_cache_size"] = 0
    if len(url_hosts(dsn)) < 2:
        return await asyncpg.connect(dsn, **options)
    attempts = [asyncio.ensure_future(_writable_connection(d, options)) for d in _single_host_dsns(dsn)]
    chosen: asyncpg.Connection | None = None
    errors: list[BaseException] = []
    try:
        for attempt in asyncio.as_completed(attempts):
            try:
                chosen = await attempt
                break
            except Exception as exc:
                errors.append(exc)
    finally:
        for attempt in attempts:
            attempt.cancel()
        for outcome in await asyncio.gather(*attempts, return_exceptions=True):
            if isinstance(outcome, asyncpg.Connection) and outcome is not chosen:
                outcome.terminate()
    if chosen is not None:
        return chosen
    for error in errors:
        if not is_unavailable(error) and not isinstance(error, NotWritable):
            raise error  # credentials refused, no such database: said as it is
    causes = "; ".join(f"{type(e).__name__}: {e}" for e in errors)
    raise DatabaseUnavailable(f"no host is a writable primary now ({causes})") from errors[-1]


@dataclass
class Database:
    """An engine, its session factory and a small plain asyncpg pool for hot paths (:mod:`.execute`;
    admissions: :attr:`admissions`, :mod:`.admission_batch`); one per process, built by the entry point."""

    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    url: str
    pool_size: int
    pooler: Pooler
    _raw: Any = field(default=None, repr=False)
    _raw_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    admissions: AdmissionBatcher = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.admissions = AdmissionBatcher(self.raw_pool, is_unavailable)
        quiet_driver_outages()

    async def raw_pool(self) -> asyncpg.Pool:
        """The plain asyncpg pool, created on first use."""
        if self._raw is None:
            async with self._raw_lock:
                if self._raw is None:
                    self._raw = await asyncpg.create_pool(
                        plain_dsn(self.url),
                        min_size=1,
                        max_size=self.pool_size,
                        connect=self._open_raw,
                        connection_class=ServerConnection,
                        init=self._init_raw,
                        reset=_keep_session,
                    )
        return self._raw

    async def _open_raw(self, dsn: str, **kwargs: Any) -> asyncpg.Connection:
        return await open_connection(dsn, unnamed_statements=self.pooler == "transaction", **kwargs)

    async def _init_raw(self, conn: asyncpg.Connection) -> None:
        # Binary (version byte 1, then the JSON text): a composite value (a whole row) holding jsonb is
        # only decoded when every field has a binary codec. A parameter is JSON text, as SQLAlchemy's.
        await conn.set_type_codec(
            "jsonb",
            encoder=lambda value: b"\x01" + value.encode("utf-8"),
            decoder=lambda data: json.loads(data[1:]),
            schema="pg_catalog",
            format="binary",
        )

        def drop_if_lost(record: Any) -> None:
            # Not terminated here, inside asyncpg's own step (that frees its pool slot twice): the
            # pool's connections all expire, so this one is closed when it is released.
            if record.exception is not None and connection_lost(record.exception):
                self.node_gone()

        conn.add_query_logger(drop_if_lost)

    def node_gone(self) -> None:
        """The node behind some connection is gone: every pooled connection of both pools is replaced
        before its next use, to find the primary again; those in use finish (or fail) as they are."""
        if self._raw is not None:
            # What Pool.expire_connections() does, in this step rather than in a task: a connection
            # that failed now is released right after, and must be closed then, not reused.
            self._raw._generation += 1
        # SQLAlchemy's own pool-wide invalidation on a disconnect (every connection older than now
        # is recycled at its next checkout), without a connection of its own at hand.
        self.engine.sync_engine.pool._invalidate(None, _checkin=False)  # type: ignore[arg-type]

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A plain asyncpg connection from the raw pool. One whose work ended in an unavailable-kind
        error, a driver interface error or a cancellation is terminated, never put back: it may be
        mid-protocol, and the next statement on it (a ROLLBACK on release, too) would fail."""
        pool = await self.raw_pool()
        async with pool.acquire(timeout=POOL_TIMEOUT_S) as conn:
            try:
                yield conn
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError | asyncpg.InterfaceError) or is_unavailable(exc):
                    # A connection the server closed is back in the pool already (asyncpg releases
                    # it as it closes), and terminating it again would replace the error.
                    with contextlib.suppress(asyncpg.InterfaceError):
                        conn.terminate()
                raise

    async def dispose(self) -> None:
        await self.admissions.drain()
        if self._raw is not None:
            raw, self._raw = self._raw, None
            await raw.close()
        await self.engine.dispose()


async def _keep_session(conn: asyncpg.Connection) -> None:
    """No reset query (a round trip) on release: the raw pool's statements leave no session state,
    and asyncpg still rolls back a transaction left open before calling this."""


def plain_dsn(url: str) -> str:
    """``postgresql+asyncpg://…`` → the DSN asyncpg reads (every connection of the service uses it)."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


def _engine(url: str, *, unnamed_statements: bool, **options: Any) -> AsyncEngine:
    dsn = plain_dsn(url)

    async def connect_asyncpg() -> asyncpg.Connection:
        # asyncpg reads the DSN's libpq-style query itself (sslmode, target_session_attrs…):
        # SQLAlchemy would pass each as a keyword asyncpg does not take.
        return await open_connection(dsn, unnamed_statements=unnamed_statements)

    def creator() -> Any:
        # What create_async_engine(async_creator=…) does, plus the adapter's own statement cache:
        # off behind a pooler, since each cached statement is a named one on one server connection.
        return engine.sync_engine.dialect.dbapi.connect(  # type: ignore[union-attr]
            async_creator_fn=connect_asyncpg,
            prepared_statement_cache_size=0 if unnamed_statements else 100,
        )

    # SQLAlchemy takes only its dialect from this URL; connections are open_connection's, from the service's
    # URL (SQLAlchemy cannot parse several hosts). json_text: our JSONB documents keep their key order.
    engine = create_async_engine(
        "postgresql+asyncpg://", creator=creator, json_serializer=json_text, **options
    )

    @event.listens_for(engine.sync_engine, "handle_error")
    def _drop_lost_connection(context: ExceptionContext) -> None:
        # A node gone in a failover answers 25006 or 57P0x, not a disconnect to SQLAlchemy: counted
        # here, the connection is invalidated (never retried) and the pool replaces the others too.
        if not context.is_disconnect and connection_lost(context.original_exception):
            context.is_disconnect = True

    return engine


def connect(url: str, *, pool_size: int = 10, pooler: Pooler = "none") -> Database:
    """The :class:`Database` for ``url`` (``postgresql+asyncpg://…``, one host or several); its pool
    reconnects by itself after an outage. ``pooler="transaction"``: nothing prepared under a name."""
    engine = _engine(
        url,
        unnamed_statements=pooler == "transaction",
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        pool_timeout=POOL_TIMEOUT_S,
    )
    database = Database(
        engine=engine,
        sessions=async_sessionmaker(engine, expire_on_commit=False),
        url=url,
        pool_size=pool_size,
        pooler=pooler,
    )

    @event.listens_for(engine.sync_engine, "handle_error")
    def _replace_the_others(context: ExceptionContext) -> None:
        if context.is_disconnect:
            database.node_gone()

    return database


def migration_engine(url: str) -> AsyncEngine:
    """The engine a migration run uses (migrations/env.py): one connection, made as the pools make
    theirs, its statements unnamed so that it runs through a pooler in transaction mode too."""
    return _engine(url, unnamed_statements=True, poolclass=pool.NullPool)
