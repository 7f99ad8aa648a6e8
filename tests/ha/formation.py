"""A pg_auto_failover formation on loopback ports, with a PgBouncer in front of each data node.

The real thing SPEC 9.1 asks to be tested on, built from Debian's packages
(``postgresql-15-auto-failover``, ``pgbouncer``; ``scripts/test-ha`` installs them): a monitor, a
primary and a synchronous standby (``synchronous_commit`` on, the standby in the write quorum), each
data node behind its own PgBouncer in transaction mode. Everything runs as the ``postgres`` OS user
(``pg_autoctl`` and PgBouncer refuse root) under one temporary directory, and :meth:`Formation.destroy`
stops every process this module started (by its own process group) and removes the directory.

The monitor's health checks are tightened (checks every second, a node unhealthy after 2 s, a
demotion assumed after 2 s) so that a failover takes seconds rather than the defaults' half minute;
the decisions are pg_auto_failover's own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg2

from tests.net import free_port, wait_listening

PG_BIN = Path("/usr/lib/postgresql/15/bin")
DATABASE = "sidequest"
# Monitor settings (milliseconds): pg_auto_failover's defaults wait 20 s before calling a node
# unhealthy and 30 s for a demotion; the checker kills a primary again and again.
MONITOR_SETTINGS = {
    "pgautofailover.health_check_period": "1000",
    "pgautofailover.health_check_timeout": "1000",
    "pgautofailover.health_check_max_retries": "1",
    "pgautofailover.health_check_retry_delay": "500",
    "pgautofailover.node_considered_unhealthy_timeout": "2000",
    "pgautofailover.primary_demote_timeout": "2000",
    "pgautofailover.startup_grace_period": "2000",
}


def missing_tools() -> list[str]:
    """The executables a formation needs that are not installed."""
    needed = {"pg_autoctl": shutil.which("pg_autoctl"), "pgbouncer": shutil.which("pgbouncer")}
    missing = [name for name, path in needed.items() if path is None]
    if not (PG_BIN / "pg_ctl").exists():
        missing.append(str(PG_BIN / "pg_ctl"))
    return missing


@dataclass
class Node:
    name: str
    pgdata: Path
    port: int
    bouncer_port: int
    keeper: subprocess.Popen[bytes] | None = None
    bouncer: subprocess.Popen[bytes] | None = None


@dataclass
class Formation:
    root: Path
    monitor_port: int
    nodes: list[Node]
    monitor: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ URLs

    @property
    def monitor_url(self) -> str:
        return f"postgresql://autoctl_node@127.0.0.1:{self.monitor_port}/pg_auto_failover?sslmode=disable"

    def database_url(self) -> str:
        """Every PgBouncer, the writable primary found by ``target_session_attrs`` (the pools)."""
        hosts = ",".join(f"127.0.0.1:{n.bouncer_port}" for n in self.nodes)
        return f"postgresql://postgres@{hosts}/{DATABASE}?target_session_attrs=read-write"

    def listen_url(self) -> str:
        """Every data node directly (the LISTEN connection: never through a transaction pooler)."""
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"postgresql://postgres@{hosts}/{DATABASE}?target_session_attrs=read-write"

    # ------------------------------------------------------------------ processes

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{PG_BIN}:{env.get('PATH', '')}"
        env["PG_CONFIG"] = str(PG_BIN / "pg_config")
        # pg_autoctl keeps its configuration and state under the XDG directories: ours, not the
        # postgres user's home.
        for name in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_RUNTIME_DIR"):
            env[name] = str(self.root / name.lower())
        env.pop("PGDATA", None)
        return env

    def _command(self, *args: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else list(args)

    def run(self, *args: str, timeout: float = 120) -> str:
        """Run a command as ``postgres`` and wait for it; its output on failure in the error."""
        done = subprocess.run(
            self._command(*args), env=self._env(), cwd=self.root, capture_output=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args)} failed ({done.returncode}):\n"
                f"{done.stdout.decode(errors='replace')}\n{done.stderr.decode(errors='replace')}"
            )
        return done.stdout.decode(errors="replace")

    def spawn(self, log_name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start a long-running process as ``postgres`` in a process group of its own."""
        log = self.root / "logs" / f"{log_name}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                self._command(*args),
                env=self._env(),
                cwd=self.root,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        record_group(process.pid)
        return process

    def start_keeper(self, node: Node) -> None:
        node.keeper = self.spawn(f"keeper-{node.name}", "pg_autoctl", "run", "--pgdata", str(node.pgdata))

    def kill_primary(self, node: Node) -> None:
        """SIGKILL of the node's keeper (``pg_autoctl`` and its services, not PostgreSQL), then an
        immediate stop of its PostgreSQL: the machine is gone, as far as anyone can tell."""
        if node.keeper is not None:
            for pid in _group_members(node.keeper.pid):
                if _command_name(pid) != "postgres":
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self.stop_postgres(node.pgdata)
            _kill_group(node.keeper, signal.SIGKILL)  # anything left of the group
            node.keeper = None
        else:
            self.stop_postgres(node.pgdata)

    def stop_postgres(self, pgdata: Path) -> None:
        """``pg_ctl stop -m immediate`` (nothing when it is not running)."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.run(str(PG_BIN / "pg_ctl"), "-D", str(pgdata), "-m", "immediate", "-w", "stop", timeout=30)

    # ------------------------------------------------------------------ state

    def states(self) -> dict[str, tuple[str, str]]:
        """``{node name: (reported state, goal state)}`` as the monitor sees them."""
        conn = psycopg2.connect(self.monitor_url, connect_timeout=5)
        try:
            with conn.cursor() as cursor:
                cursor.execute(
                    "SELECT nodename, reportedstate::text, goalstate::text FROM pgautofailover.node"
                )
                rows = cursor.fetchall()
        finally:
            conn.close()
        return {name: (reported, goal) for name, reported, goal in rows}

    def primary(self) -> Node | None:
        """The node that is primary now (reported and assigned), or None."""
        for name, (reported, goal) in self.states().items():
            if reported in ("single", "primary", "wait_primary") and goal == reported:
                return next(n for n in self.nodes if n.name == name)
        return None

    def wait_healthy(self, timeout_s: float = 180) -> Node:
        """Wait until one node is ``primary`` and the other ``secondary`` (synchronous again)."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, tuple[str, str]] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(psycopg2.Error):
                last = self.states()
                reported = sorted(state for state, goal in last.values() if state == goal)
                if reported == ["primary", "secondary"]:
                    primary = self.primary()
                    if primary is not None:
                        return primary
            time.sleep(0.5)
        raise TimeoutError(f"the formation did not become healthy in {timeout_s:.0f} s: {last}")

    def wait_new_primary(self, old: Node, timeout_s: float = 120) -> Node:
        """Wait until a node other than ``old`` is the primary (it accepts writes)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(psycopg2.Error):
                node = self.primary()
                if node is not None and node is not old:
                    return node
            time.sleep(0.2)
        raise TimeoutError(f"no new primary within {timeout_s:.0f} s: {self.states()}")

    # ------------------------------------------------------------------ teardown

    def destroy(self) -> None:
        """Stop everything this formation started and remove its directory."""
        for node in self.nodes:
            for process in (node.keeper, node.bouncer):
                if process is not None:
                    _kill_group(process, signal.SIGKILL)
            node.keeper = node.bouncer = None
        if self.monitor is not None:
            _kill_group(self.monitor, signal.SIGKILL)
            self.monitor = None
        for pgdata in [self.root / "monitor", *(n.pgdata for n in self.nodes)]:
            if (pgdata / "postmaster.pid").exists():
                self.stop_postgres(pgdata)
        shutil.rmtree(self.root, ignore_errors=True)


# Every process group a formation starts, one id a line: scripts/test-ha kills what is left of them
# when the test run itself was killed before it could clean up.
GROUPS_FILE_ENV = "SIDEQUEST_HA_GROUPS_FILE"


def record_group(pgid: int) -> None:
    """Name a process group for scripts/test-ha to kill, should the run not clean up itself."""
    _record_for_cleanup(str(pgid))


def _record_for_cleanup(line: str) -> None:
    path = os.environ.get(GROUPS_FILE_ENV)
    if path:
        with open(path, "a") as out:
            out.write(f"{line}\n")


def _group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (Linux: read from /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[2]) == pgid:  # state, ppid, pgrp
                members.append(int(stat.parent.name))
    return members


def _command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _kill_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def _bouncer_config(root: Path, node: Node) -> Path:
    conf = root / f"pgbouncer-{node.name}.ini"
    conf.write_text(
        "[databases]\n"
        f"* = host=127.0.0.1 port={node.port}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {node.bouncer_port}\n"
        f"unix_socket_dir = {root}\n"
        "auth_type = trust\n"
        f"auth_file = {root / 'pgbouncer-users.txt'}\n"
        "pool_mode = transaction\n"
        "max_client_conn = 1000\n"
        "default_pool_size = 40\n"
        # A dead node is reported within seconds, not after the defaults' 15 s / 120 s.
        "server_connect_timeout = 2\n"
        "server_login_retry = 1\n"
        "query_wait_timeout = 5\n"
    )
    return conf


def start_bouncer(formation: Formation, node: Node) -> None:
    conf = _bouncer_config(formation.root, node)
    node.bouncer = formation.spawn(f"pgbouncer-{node.name}", "pgbouncer", str(conf))
    if not wait_listening(node.bouncer_port, 15):
        raise TimeoutError(f"nothing listens on 127.0.0.1:{node.bouncer_port} after 15 s")


def build_formation() -> Formation:
    """Monitor, primary, synchronous standby and a PgBouncer per data node, healthy on return."""
    root = Path(tempfile.mkdtemp(prefix="sidequest-ha-"))
    (root / "logs").mkdir()
    (root / "pgbouncer-users.txt").write_text('"postgres" ""\n')
    nodes = [
        Node(name=f"node{i}", pgdata=root / f"node{i}", port=free_port(), bouncer_port=free_port())
        for i in (1, 2)
    ]
    formation = Formation(root=root, monitor_port=free_port(), nodes=nodes)
    _record_for_cleanup(f"root {root}")
    if os.geteuid() == 0:
        subprocess.run(["chown", "-R", "postgres:postgres", str(root)], check=True)
    try:
        formation.run(
            "pg_autoctl", "create", "monitor", "--pgdata", str(root / "monitor"),
            "--pgport", str(formation.monitor_port), "--listen", "127.0.0.1",
            "--hostname", "127.0.0.1", "--auth", "trust", "--no-ssl",
        )  # fmt: skip
        formation.monitor = formation.spawn("monitor", "pg_autoctl", "run", "--pgdata", str(root / "monitor"))
        _tune_monitor(formation)
        for node in nodes:
            formation.run(
                "pg_autoctl", "create", "postgres", "--pgdata", str(node.pgdata),
                "--pgport", str(node.port), "--listen", "127.0.0.1", "--hostname", "127.0.0.1",
                "--name", node.name,
                "--dbname", DATABASE, "--monitor", formation.monitor_url,
                "--auth", "trust", "--no-ssl", "--replication-quorum", "true",
                timeout=300,
            )  # fmt: skip
            formation.start_keeper(node)
            if node is nodes[0]:
                while formation.primary() is None:
                    time.sleep(0.5)
        formation.wait_healthy()
        for node in nodes:
            start_bouncer(formation, node)
        return formation
    except BaseException:
        formation.destroy()
        raise


def _tune_monitor(formation: Formation) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            admin = f"postgresql://postgres@127.0.0.1:{formation.monitor_port}/pg_auto_failover"
            conn = psycopg2.connect(admin, connect_timeout=3)
            break
        except psycopg2.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    try:
        conn.autocommit = True
        with conn.cursor() as cursor:
            for name, value in MONITOR_SETTINGS.items():
                cursor.execute(f"ALTER SYSTEM SET {name} = '{value}'")
            cursor.execute("SELECT pg_reload_conf()")
    finally:
        conn.close()
