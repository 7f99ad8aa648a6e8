"""Admission benchmark: `POST …/questions` against the service as deployed, beside a bare floor.

Run: ``.venv/bin/python benchmarks/bench_admission.py [--rounds 3] [--posts 2000] [--concurrency 50]
[--sessions 200]`` (PostgreSQL found like the tests: SIDEQUEST_TEST_DATABASE_URL → local server →
embedded). It creates and drops two databases of its own.

What runs, each in its own process:

- ``sidequest api`` and ``sidequest worker`` with ``SIDEQUEST_MAX_CONCURRENCY=1`` and the openai
  provider pointed at the scripted server, whose answer hangs: one question is claimed and never
  finishes, so the worker is busy (every later question stays queued, and every admission's NOTIFY
  reaches a worker with no free slot) — the state the service is in under load;
- ``benchmarks/bare_app.py``: FastAPI + asyncpg, one INSERT per POST into a table of its own in a
  scratch database, on the same uvicorn settings.

Each round sends ``--posts`` POSTs from ``--concurrency`` persistent keep-alive connections spread
over ``--sessions`` fresh sessions (so every POST is an admission, none a 429), first to the service
and then to the bare app, and prints for both: throughput, p50/p99 latency, server CPU per admission
(utime + stime of the server process from /proc), database CPU per admission (the PostgreSQL
backends of that database, from /proc; "api" counts only the backends connected from the server
process, "all" adds the worker's and the LISTEN connections) and the ratios.

The client is a minimal HTTP/1.1 client on asyncio streams (one connection per concurrent caller):
httpx spends about as much CPU per request as the bare app does, and on a 2-core machine a client
that heavy would measure itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import pg
from tests.net import free_port
from tests.scripted_provider import ScriptedServer, Step

ROOT = Path(__file__).resolve().parents[1]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- a lean HTTP/1.1 client


class Connection:
    """One keep-alive HTTP/1.1 connection (enough for JSON POSTs to uvicorn)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + (body or b""))
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ---------------------------------------------------------------- /proc accounting


def cpu_ms(pid: int) -> float:
    """utime + stime of ``pid`` in milliseconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / CLOCK_TICKS


def local_ports(pid: int) -> set[int]:
    """Local ports of the TCP sockets ``pid`` holds (to tell its PostgreSQL backends apart)."""
    inodes = set()
    with contextlib.suppress(FileNotFoundError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


async def backends(admin: asyncpg.Connection, database: str, server_pid: int) -> dict[int, bool]:
    """PostgreSQL backend pids of ``database`` → whether the server process is their client."""
    ports = local_ports(server_pid)
    rows = await admin.fetch("SELECT pid, client_port FROM pg_stat_activity WHERE datname = $1", database)
    return {r["pid"]: r["client_port"] in ports for r in rows}


def backend_cpu(pids: dict[int, bool]) -> dict[int, float]:
    found = {}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            found[pid] = cpu_ms(pid)
    return found


# ---------------------------------------------------------------- processes


@asynccontextmanager
async def process(
    args: list[str], env: dict[str, str], ready_url: tuple[int, str] | None
) -> AsyncIterator[int]:
    """Run ``args`` as its own process; wait until ``ready_url`` answers 200; yield its pid."""
    proc = await asyncio.create_subprocess_exec(
        *args, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT
    )
    try:
        if ready_url is not None:
            port, path = ready_url
            for _ in range(600):
                with contextlib.suppress(OSError, IndexError, ValueError):
                    conn = Connection("127.0.0.1", port)
                    try:
                        status, _ = await conn.request("GET", path)
                    finally:
                        conn.close()
                    if status == 200:
                        break
                if proc.returncode is not None:
                    raise RuntimeError(f"{args} exited with {proc.returncode}")
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"{args} did not become ready")
        yield proc.pid
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


# ---------------------------------------------------------------- load


@dataclass
class Target:
    name: str
    port: int
    pid: int
    database: str
    helper_pid: int | None = None  # the worker process, whose CPU is shown beside the server's


@dataclass
class Result:
    rps: float
    p50_ms: float
    p99_ms: float
    server_cpu_ms: float
    helper_cpu_ms: float
    db_cpu_api_ms: float
    db_cpu_all_ms: float
    statuses: dict[int, int]
    wal_bytes: float = 0.0  # WAL written during the round (the whole cluster's), per POST
    checkpoints: int = 0  # checkpoints that began during the round (full-page writes follow each)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def drive(port: int, paths: list[str], concurrency: int) -> tuple[float, list[float], dict[int, int]]:
    """POST one question to each of ``paths`` from ``concurrency`` connections; wall, latencies, statuses."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for path in paths:
        queue.put_nowait(path)
    latencies: list[float] = []
    statuses: dict[int, int] = {}

    async def caller(c: int) -> None:
        conn = Connection("127.0.0.1", port)
        try:
            while not queue.empty():
                path = queue.get_nowait()
                body = json.dumps({"question": f"what does {path} do? ({c})"}).encode()
                start = time.perf_counter()
                status, _ = await conn.request("POST", path, body)
                latencies.append((time.perf_counter() - start) * 1000)
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in range(concurrency)))
    return time.perf_counter() - start, latencies, statuses


async def run_round(
    admin: asyncpg.Connection, target: Target, label: str, posts: int, concurrency: int, sessions: int
) -> Result:
    paths = [f"/v1/sessions/{label}-{target.name}-{i % sessions}/questions" for i in range(posts)]
    before_pids = await backends(admin, target.database, target.pid)
    before_db = backend_cpu(before_pids)
    before_cpu = cpu_ms(target.pid)
    before_helper = cpu_ms(target.helper_pid) if target.helper_pid else 0.0
    before_wal, before_checkpoints = await wal_position(admin)
    wall, latencies, statuses = await drive(target.port, paths, concurrency)
    after_wal, after_checkpoints = await wal_position(admin)
    server = cpu_ms(target.pid) - before_cpu
    helper = (cpu_ms(target.helper_pid) - before_helper) if target.helper_pid else 0.0
    after_pids = await backends(admin, target.database, target.pid)
    after_db = backend_cpu(after_pids)
    db_api = db_all = 0.0
    for pid, used in after_db.items():
        delta = used - before_db.get(pid, 0.0)
        db_all += delta
        if after_pids.get(pid):
            db_api += delta
    return Result(
        rps=posts / wall,
        p50_ms=statistics.median(latencies),
        p99_ms=percentile(latencies, 99),
        server_cpu_ms=server / posts,
        helper_cpu_ms=helper / posts,
        db_cpu_api_ms=db_api / posts,
        db_cpu_all_ms=db_all / posts,
        statuses=statuses,
        wal_bytes=(after_wal - before_wal) / posts,
        checkpoints=after_checkpoints - before_checkpoints,
    )


async def analyze(urls: tuple[str, ...]) -> None:
    for url in urls:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
        try:
            await conn.execute("ANALYZE")
        finally:
            await conn.close()


async def wal_position(admin: asyncpg.Connection) -> tuple[int, int]:
    """The cluster's WAL insert position (bytes) and the checkpoints begun so far."""
    row = await admin.fetchrow(
        "SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn AS wal, "
        "checkpoints_timed + checkpoints_req AS checkpoints FROM pg_stat_bgwriter"
    )
    assert row is not None
    return int(row["wal"]), int(row["checkpoints"])


def show(name: str, r: Result) -> str:
    return (
        f"{name:>9}: {r.rps:7.0f} req/s  p50 {r.p50_ms:6.1f} ms  p99 {r.p99_ms:6.1f} ms  "
        f"server CPU {r.server_cpu_ms:5.2f} ms/adm (worker {r.helper_cpu_ms:4.2f})  "
        f"db CPU api {r.db_cpu_api_ms:5.2f} all {r.db_cpu_all_ms:5.2f} ms/adm  "
        f"WAL {r.wal_bytes:5.0f} B/adm{' (checkpoint)' if r.checkpoints else ''}  statuses {r.statuses}"
    )


def ratios(s: Result, b: Result) -> str:
    return (
        f"   ratios: throughput {s.rps / b.rps:.2f}x  p50 {s.p50_ms / b.p50_ms:.1f}x  "
        f"p99 {s.p99_ms / b.p99_ms:.1f}x  server CPU {s.server_cpu_ms / b.server_cpu_ms:.1f}x  "
        f"db CPU (api) {s.db_cpu_api_ms / max(b.db_cpu_api_ms, 1e-9):.1f}x"
    )


@asynccontextmanager
async def profile(pid: int, output: str | None) -> AsyncIterator[None]:
    """py-spy (from PyPI) sampling ``pid`` while the body runs: ``output``.txt (collapsed stacks, for
    summaries) and ``output``.svg (flame graph). Nothing when ``output`` is None."""
    if output is None:
        yield
        return
    spies = []
    for fmt in ("raw", "flamegraph"):
        suffix = "txt" if fmt == "raw" else "svg"
        spies.append(
            await asyncio.create_subprocess_exec(
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--pid",
                str(pid),
                "--rate",
                "200",
                "--nonblocking",
                "--format",
                fmt,
                "-o",
                f"{output}.{suffix}",
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    await asyncio.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            await spy.wait()


async def wait_running(port: int, request_id: str) -> None:
    conn = Connection("127.0.0.1", port)
    try:
        for _ in range(300):
            _, body = await conn.request("GET", f"/v1/questions/{request_id}")
            if json.loads(body)["status"] == "running":
                return
            await asyncio.sleep(0.1)
    finally:
        conn.close()
    raise RuntimeError("the worker never claimed the hanging question")


async def main(args: argparse.Namespace) -> None:
    server = await asyncio.to_thread(pg.find_server)
    service_url = await pg.create_database(server.admin_url)
    bare_url = await pg.create_database(server.admin_url)
    plain = server.admin_url.replace("postgresql+asyncpg://", "postgresql://", 1)
    admin = await asyncpg.connect(plain)
    try:
        with ScriptedServer() as model:
            model.set_default("answer", Step.hang())
            env = {
                "SIDEQUEST_DATABASE_URL": service_url,
                "SIDEQUEST_PROVIDER": "openai",
                "SIDEQUEST_BASE_URL": model.base_url,
                "SIDEQUEST_API_KEY": "x",
                "SIDEQUEST_MODEL": "scripted-model",
                "SIDEQUEST_MAX_CONCURRENCY": "1",
                "SIDEQUEST_BACKGROUND_SUMMARIES": "off",
            }
            api_port, bare_port = free_port(), free_port()
            py = sys.executable
            api_cmd = [py, "-m", "service.cli", "api", "--port", str(api_port)]
            bare_cmd = [py, str(ROOT / "benchmarks" / "bare_app.py"), "--port", str(bare_port)]
            bare_cmd += ["--dsn", bare_url.replace("postgresql+asyncpg://", "postgresql://", 1)]
            async with (
                process(api_cmd, env, (api_port, "/readyz")) as api_pid,
                process([py, "-m", "service.cli", "worker"], env, None) as worker_pid,
                process(bare_cmd, {}, (bare_port, "/readyz")) as bare_pid,
            ):
                conn = Connection("127.0.0.1", api_port)
                status, body = await conn.request(
                    "POST", "/v1/sessions/busy/questions", json.dumps({"question": "hang"}).encode()
                )
                conn.close()
                assert status == 202, body
                await wait_running(api_port, json.loads(body)["id"])
                targets = [
                    Target("sidequest", api_port, api_pid, service_url.rsplit("/", 1)[1], worker_pid),
                    Target("bare", bare_port, bare_pid, bare_url.rsplit("/", 1)[1]),
                ]
                for target in targets:  # warm up: connections, pools, statement caches
                    await run_round(admin, target, "warm", 300, args.concurrency, 100)
                # Statistics, as a running database has them: autovacuum analyzes a table once a tenth
                # of it changed (every minute), and each round adds far more than that. Without it a
                # fresh database's cached plans are the ones made for its first few hundred rows: the
                # session lookup's then walks the tenant's activity index or the whole table, and
                # admission grows slower with every round (docs/benchmarks.md). Both databases alike,
                # before every round.
                urls = (service_url, bare_url)
                print(
                    f"{args.rounds} rounds of {args.posts} POSTs, {args.concurrency} concurrent, "
                    f"{args.sessions} fresh sessions per round; worker busy (1 slot, hanging answer)"
                )
                for r in range(1, args.rounds + 1):
                    await analyze(urls)
                    results = []
                    for t in targets:
                        output = f"{args.profile}-{t.name}" if r == 1 and args.profile else None
                        async with profile(t.pid, output):
                            results.append(
                                await run_round(
                                    admin, t, f"r{r}", args.posts, args.concurrency, args.sessions
                                )
                            )
                    print(f"round {r}")
                    print(show("sidequest", results[0]))
                    print(show("bare", results[1]))
                    print(ratios(results[0], results[1]))
    finally:
        await admin.close()
        await pg.drop_database(server.admin_url, service_url)
        await pg.drop_database(server.admin_url, bare_url)
        server.stop()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="admission: the service beside a bare FastAPI + asyncpg app")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--posts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help="py-spy both servers during round 1 (PATH-sidequest.txt/.svg, PATH-bare.txt/.svg)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
