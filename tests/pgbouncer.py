"""A PgBouncer of a test's own, in transaction mode, on a free loopback port (SPEC 9.1).

Debian's ``pgbouncer`` (``scripts/test`` installs it when it is missing). It refuses to run as root,
so as root it runs as the ``postgres`` OS user, like the PostgreSQL servers the tests start. Its
server pool is small on purpose: with a few server connections shared by many clients, a statement
that depends on its session (a named prepared statement, ``SET``, a session advisory lock) soon
lands on another client's server connection and fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from tests.net import free_port, wait_listening
from tests.pg import with_hosts


class PgBouncer:
    """``PgBouncer(upstream_url).start()`` … ``stop()``; :meth:`url` rewrites a URL to go through it."""

    def __init__(self, upstream_host: str, upstream_port: int, *, pool_size: int = 3) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not Path(binary).exists():
            raise RuntimeError(
                "pgbouncer is missing: install Debian's pgbouncer package (scripts/test does, as root)"
            )
        self.binary = binary
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="sidequest-pgbouncer-"))
        (self.root / "users.txt").write_text('"postgres" ""\n')
        self.config = self.root / "pgbouncer.ini"
        self.config.write_text(
            "[databases]\n"
            f"* = host={upstream_host} port={upstream_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            f"unix_socket_dir = {self.root}\n"
            "auth_type = trust\n"
            f"auth_file = {self.root / 'users.txt'}\n"
            "pool_mode = transaction\n"
            "max_client_conn = 500\n"
            f"default_pool_size = {pool_size}\n"
            "query_wait_timeout = 30\n"
        )
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "postgres:postgres", str(self.root)], check=True)
        self.process: subprocess.Popen[bytes] | None = None

    @classmethod
    def in_front_of(cls, url: str, **kwargs: int) -> PgBouncer:
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 5432, **kwargs)

    def url(self, url: str) -> str:
        """``url`` (a database on the upstream server) through this PgBouncer."""
        return with_hosts(url, f"127.0.0.1:{self.port}")

    def start(self) -> PgBouncer:
        command = [self.binary, str(self.config)]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=(self.root / "log").open("wb"), start_new_session=True
        )
        process = self.process

        def alive() -> None:
            if process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {(self.root / 'log').read_text(errors='replace')}")

        if not wait_listening(self.port, 15, alive):
            raise RuntimeError("pgbouncer did not listen within 15 s")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        shutil.rmtree(self.root, ignore_errors=True)
