"""Cost of one event in PostgreSQL: a ``delta`` as a worker writes it, plus stored bytes.

Run: ``.venv/bin/python benchmarks/bench_events.py [--writers 8] [--events 250]`` (needs a PostgreSQL
found the same way as the tests; it creates and drops its own database).

``--writers`` tasks, each on its own pooled connection and its own claimed request in its own session
(as concurrent worker slots would be), write ``--events`` ``delta`` events each the way the pipeline
does (``RequestRuntime.emit_delta``): one statement per event on a plain asyncpg connection,
``sidequest_emit_if_held`` (the lease guard, the seq bump, the session's advisory lock, INSERT,
NOTIFY), committed on its own. It
reports events/s, the CPU time of the PostgreSQL backends serving those connections (read from
/proc: the server must run on this machine) and of this client process, per event; then the
stored size of a typical finished request (its row and its events, ``pg_column_size``) and the
WAL written per event (``pg_current_wal_lsn`` before/after).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from pathlib import Path

from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.store import lease, queue
from service.store.db import connect
from service.store.schema import upgrade_to_head
from tests import pg
from tests.factories import admit, make_session

DELTA = {"text": "a coalesced chunk of answer text, about fifty chars "}
OWNER = "bench-events"


def _cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) of the given processes that still exist."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def measure(url: str, writers: int, per_writer: int) -> None:
    await asyncio.to_thread(upgrade_to_head, url)
    db = connect(url, pool_size=writers)
    try:
        # One session per writer: a session runs one request at a time (SPEC 9), and its events are
        # serialised by the session's advisory lock anyway.
        sessions = [await make_session(db, f"bench-events-{uuid.uuid4()}") for _ in range(writers)]
        requests = [await admit(db, sid, "q") for sid in sessions]

        async with db.connection() as conn:
            for _ in requests:
                # No cap here: the benchmark measures writes, and earlier runs leave their requests running.
                claimed, _full = await queue.try_claim(conn, owner=OWNER, lease_s=600, max_running=1 << 30)
                assert claimed is not None

        async def write(rid: uuid.UUID, n: int) -> None:
            for _ in range(n):
                async with db.connection() as conn:
                    assert await lease.emit_if_held(conn, rid, OWNER, [("delta", DELTA)])

        await asyncio.gather(*(write(rid, 5) for rid in requests))  # warm: every connection open
        async with db.sessions() as session:
            pids = list(
                await session.scalars(
                    text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
                )
            )
            wal_before = await session.scalar(text("SELECT pg_current_wal_lsn()"))
        pg_before = _cpu(pids)
        own_before = time.process_time()
        start = time.perf_counter()
        await asyncio.gather(*(write(rid, per_writer) for rid in requests))
        wall = time.perf_counter() - start
        own = time.process_time() - own_before
        pg_cpu = _cpu(pids) - pg_before
        total = writers * per_writer
        async with db.sessions() as session:
            wal = await session.scalar(
                text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), :before)"), {"before": wal_before}
            )
            row_bytes = await session.scalar(
                text("SELECT avg(pg_column_size(e.*)) FROM side_question_events e WHERE type = 'delta'")
            )
        print(
            f"delta events: {total} from {writers} writers in {wall:.2f} s "
            f"= {total / wall:.0f} events/s; "
            f"PostgreSQL backends {pg_cpu / total * 1e6:.0f} µs CPU per event, "
            f"client (asyncpg) {own / total * 1e6:.0f} µs per event; "
            f"WAL {float(wal or 0) / total:.0f} bytes per event; delta row {float(row_bytes or 0):.0f} bytes"
        )
        print(f"load average during the run: {os.getloadavg()}")
    finally:
        await db.dispose()


async def main(args: argparse.Namespace) -> None:
    server = await asyncio.to_thread(pg.find_server)
    url = await pg.create_database(server.admin_url)
    try:
        for _ in range(args.runs):
            await measure(url, args.writers, args.events)
    finally:
        await pg.drop_database(server.admin_url, url)
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--events", type=int, default=250, help="events per writer")
    parser.add_argument("--runs", type=int, default=1)
    asyncio.run(main(parser.parse_args()))
