"""Finding a PostgreSQL server for the tests and giving each run its own database.

Order (what is named first, then the cheapest to reach): ``SIDEQUEST_TEST_DATABASE_URL`` → the local
server on 127.0.0.1:5432 → testcontainers when a Docker engine answers → an embedded PostgreSQL in a
temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import asyncpg


@dataclass
class Server:
    """An admin URL (``postgresql://…/postgres``) and how to shut the server down, if we started it."""

    admin_url: str
    kind: str
    stop: Callable[[], None] = field(default=lambda: None)


def _plain(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


def with_database(url: str, name: str) -> str:
    """Return ``url`` pointing at database ``name`` (query string, e.g. a socket host, kept)."""
    parts = urlsplit(_plain(url))
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def with_hosts(url: str, *hosts: str) -> str:
    """Return ``url`` pointing at ``hosts`` (``host:port`` each; several make a multi-host URL), its
    user, password, database and query kept."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{','.join(hosts)}"))


async def _answers(url: str) -> bool:
    try:
        conn = await asyncpg.connect(_plain(url), timeout=3)
    except (TimeoutError, OSError, asyncpg.PostgresError):
        return False
    await conn.close()
    return True


def _local_answers() -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        if sock.connect_ex(("127.0.0.1", 5432)) != 0:
            return False
    return asyncio.run(_answers("postgresql://postgres@127.0.0.1:5432/postgres"))


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_server() -> Server:
    """Pick the first server that answers, in the documented order."""
    env = os.environ.get("SIDEQUEST_TEST_DATABASE_URL")
    if env:
        return Server(admin_url=with_database(env, "postgres"), kind="env")
    if _local_answers():
        return Server(admin_url="postgresql://postgres@127.0.0.1:5432/postgres", kind="local")
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        container = PostgresContainer("postgres:16-alpine", driver=None)
        container.start()
        return Server(
            admin_url=with_database(container.get_connection_url(), "postgres"),
            kind="testcontainers",
            stop=container.stop,
        )
    from service.embedded import embedded_database

    # Keep the data dir out of root's home: the package opens up permissions along its path.
    data_dir = tempfile.mkdtemp(prefix="sidequest-test-pg-")
    embedded = contextlib.ExitStack()
    url = embedded.enter_context(embedded_database(__import__("pathlib").Path(data_dir)))

    def stop() -> None:
        embedded.close()
        shutil.rmtree(data_dir, ignore_errors=True)

    return Server(admin_url=with_database(url, "postgres"), kind="embedded", stop=stop)


async def create_database(admin_url: str) -> str:
    """Create a database with a random name and return its asyncpg SQLAlchemy URL."""
    name = f"sidequest_test_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(_plain(admin_url))
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return with_database(admin_url, name).replace("postgresql://", "postgresql+asyncpg://", 1)


async def alter_database(admin_url: str, url: str, change: str) -> None:
    """``ALTER DATABASE <the test's own> <change>``, then end its sessions: a session reads the
    database's settings when it starts, so only new ones see the change (as after a restart)."""
    name = urlsplit(_plain(url)).path.lstrip("/")
    conn = await asyncpg.connect(_plain(admin_url))
    try:
        await conn.execute(f'ALTER DATABASE "{name}" {change}')
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
    finally:
        await conn.close()


async def drop_database(admin_url: str, url: str) -> None:
    """Drop the run's database, closing any connection a stray process left open."""
    name = urlsplit(_plain(url)).path.lstrip("/")
    conn = await asyncpg.connect(_plain(admin_url))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()
