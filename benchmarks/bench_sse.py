"""SSE fan-out benchmark: many subscribers on one streaming answer, the service as deployed.

Run: ``.venv/bin/python benchmarks/bench_sse.py [--subscribers 1000] [--clients 4] [--runs 1]``
(needs a PostgreSQL found the same way as the tests; it creates and drops its own database).

Set-up: ``sidequest api`` and ``sidequest worker`` in their own processes against one database, the
``openai`` provider pointed at the scripted OpenAI-compatible server (tests/scripted_provider.py),
which streams each answer as ``--chunks`` chunks at ``--rate`` per second. One phase:

1. POST a question while no worker runs (it stays ``queued``);
2. open the subscribers on its request stream from ``--clients`` client processes (raw asyncio
   sockets: a minimal HTTP/1.1 + chunked + SSE reader, so the clients cost as little CPU as possible
   on the machine they share with the service); each process reports ready once every one of its
   connections received the replayed ``queued`` event;
3. start a worker process; it claims the request and streams the answer; stop it afterwards.

Per event and subscriber the delay is arrival time (client clock) minus the event's ``at`` (written
by the worker just before its transaction commits; same machine, same clock). Reported: ``delta``
delay p50/p99/max over all subscribers, the ``done`` event's own delay, the gap between the last
``delta`` and ``done`` at the subscriber (and the same gap in the server's ``at`` stamps: the part
that is the pipeline's, not the fan-out's), and duplicates / gaps per connection (must be 0). The
floor is the same phase with one subscriber, in the same run; the ratio is printed. The API
process's CPU time during the phase is read from /proc (CPU per delivered event).

The pipeline coalesces answer text into at most ~20 ``delta`` events per second, so ``--rate``
above 20 does not raise the event rate.

The bare floor: ``--bare`` runs ``benchmarks/bare_sse.py`` (uvicorn + Starlette fanning out the same
events from memory: no database, no NOTIFY, no sse-starlette) in place of the API and the worker,
with the same client processes; the service's delay over that one is what the service adds to
fanning out on this machine. Per event the report also splits the delay: the first subscriber's
(before the fan-out: commit, NOTIFY, the shared read) and first to last subscriber (the fan-out).

Profiling: ``BENCH_SSE_API_SCRIPT=/path/script.py`` runs that script (same arguments, e.g. a wrapper
that runs the app under cProfile) instead of ``python -m service.cli`` for the API process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AT = re.compile(rb'"at":"([^"]+)"')


# --------------------------------------------------------------------------------------------------
# Client process: N raw connections on one stream.


def _at_seconds(raw: bytes, cache: dict[bytes, float]) -> float:
    value = cache.get(raw)
    if value is None:
        value = datetime.fromisoformat(raw.decode().rstrip("Z")).replace(tzinfo=UTC).timestamp()
        cache[raw] = value
    return value


async def _connection(
    host: str, port: int, path: str, ready: asyncio.Event, counter: list[int], total: int
) -> dict[str, Any]:
    """One subscriber. While streaming it only stamps and keeps what it reads (so that the harness
    costs as little CPU as possible beside the service); everything is parsed once every connection
    of the process has ended (parsing one as it ends would delay the others' arrival stamps)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: text/event-stream\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status != 200:
        raise RuntimeError(f"status {status}")
    chunked = b"transfer-encoding: chunked" in head.lower()
    reads: list[tuple[bytes, float]] = []
    first = True
    try:
        while True:
            data = await reader.read(262144)
            if not data:
                break
            reads.append((data, time.time()))
            if first and b"event: " in data:
                first = False
                counter[0] += 1
                if counter[0] == total:
                    ready.set()
            if b"event: done" in data or b"event: error" in data or data.endswith(b"0\r\n\r\n"):
                break
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return {"reads": reads, "chunked": chunked}


def _parse(reads: list[tuple[bytes, float]], chunked: bool) -> dict[str, Any]:
    """The events of one connection with their arrival times: (id, type, at, arrival)."""
    raw = b""
    body = b""
    cache: dict[bytes, float] = {}
    events: list[tuple[int, str, float, float]] = []
    last_id = 0
    duplicates = gaps = 0
    for data, arrival in reads:
        if chunked:
            raw += data
            while True:
                end = raw.find(b"\r\n")
                if end < 0:
                    break
                size = int(raw[:end].split(b";")[0], 16)
                if len(raw) < end + 2 + size + 2:
                    break
                body += raw[end + 2 : end + 2 + size]
                raw = raw[end + 2 + size + 2 :]
        else:
            body += data
        while True:
            cut = body.find(b"\r\n\r\n")
            if cut < 0:
                break
            message, body = body[:cut], body[cut + 4 :]
            event_id = event_type = None
            at = None
            for line in message.split(b"\r\n"):
                if line.startswith(b"id: "):
                    event_id = int(line[4:])
                elif line.startswith(b"event: "):
                    event_type = line[7:].decode()
                elif line.startswith(b"data: ") and event_type is not None:
                    match = AT.search(line)
                    if match:
                        at = _at_seconds(match.group(1), cache)
            if event_type is None or event_id is None or at is None:
                continue  # the retry hint, pings
            if event_id <= last_id:
                duplicates += 1
            elif last_id and event_id != last_id + 1:
                gaps += 1
            last_id = max(last_id, event_id)
            events.append((event_id, event_type, at, arrival))
    return {"events": events, "duplicates": duplicates, "gaps": gaps}


def _widen(by_event: dict[str, list[float]], event_id: str, first: float, last: float) -> None:
    """Widen an event's [first, last] subscriber delay to take in another subscriber's (or another
    client process's range)."""
    seen = by_event.setdefault(event_id, [first, last])
    seen[0], seen[1] = min(seen[0], first), max(seen[1], last)


async def _client_main(url: str, path: str, n: int) -> None:
    host, port = url.removeprefix("http://").split(":")
    ready = asyncio.Event()
    counter = [0]
    tasks = [asyncio.create_task(_connection(host, int(port), path, ready, counter, n)) for _ in range(n)]
    await asyncio.wait_for(ready.wait(), 120)
    print("ready", flush=True)
    ready_times = os.times()
    raw = await asyncio.wait_for(asyncio.gather(*tasks), 300)
    end_times = os.times()  # before parsing: the CPU the client spent while streaming
    cpu = (end_times.user - ready_times.user) + (end_times.system - ready_times.system)
    results = [_parse(one["reads"], one["chunked"]) for one in raw]
    delta_delays: list[float] = []
    thirds: list[list[float]] = [[], [], []]
    done_delays: list[float] = []
    done_after_last_delta: list[float] = []
    server_gap: float | None = None
    duplicates = gaps = 0
    deltas_per_connection: list[int] = []
    # Per delta event: its delay at the first and at the last of this process's subscribers. The
    # first is what comes before the fan-out (commit, NOTIFY, the shared read); last − first is the
    # fan-out's own spread.
    by_event: dict[str, list[float]] = {}
    for result in results:
        for event_id, kind, at, arrival in result["events"]:
            if kind == "delta":
                delay = (arrival - at) * 1000
                _widen(by_event, str(event_id), delay, delay)
    for result in results:
        duplicates += result["duplicates"]
        gaps += result["gaps"]
        deltas = [e for e in result["events"] if e[1] == "delta"]
        deltas_per_connection.append(len(deltas))
        delta_delays.extend((arrival - at) * 1000 for _, _, at, arrival in deltas)
        for index, (_, _, at, arrival) in enumerate(deltas):
            thirds[min(2, index * 3 // max(len(deltas), 1))].append((arrival - at) * 1000)
        done = [e for e in result["events"] if e[1] == "done"]
        if done and deltas:
            done_delays.append((done[0][3] - done[0][2]) * 1000)
            done_after_last_delta.append((done[0][3] - deltas[-1][3]) * 1000)
            server_gap = (done[0][2] - deltas[-1][2]) * 1000
    print(
        json.dumps(
            {
                "delta_delays_ms": [round(d, 2) for d in delta_delays],
                "thirds_ms": [[round(d, 2) for d in third] for third in thirds],
                "done_delays_ms": [round(d, 2) for d in done_delays],
                "done_after_last_delta_ms": [round(d, 2) for d in done_after_last_delta],
                "server_gap_ms": server_gap,
                "duplicates": duplicates,
                "gaps": gaps,
                "deltas_per_connection": sorted(set(deltas_per_connection)),
                "connections": len(results),
                "finished": len(done_delays),
                "cpu_s": cpu,
                "by_event": {k: [round(v[0], 2), round(v[1], 2)] for k, v in by_event.items()},
            }
        ),
        flush=True,
    )


# --------------------------------------------------------------------------------------------------
# Orchestration.


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _available(module: str, fallback: str) -> str:
    """What uvicorn's "auto" picks in the API process (same interpreter)."""
    try:
        __import__(module)
    except ImportError:
        return fallback
    return module


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


@asynccontextmanager
async def process(args: list[str], env: dict[str, str], port: int | None = None) -> AsyncIterator[int]:
    """Run ``sidequest …`` in its own process; with ``port``, wait until /readyz answers."""
    command = ["-m", "service.cli"]
    if args[0] == "api" and os.environ.get("BENCH_SSE_API_SCRIPT"):  # profiling hook (module docstring)
        command = [os.environ["BENCH_SSE_API_SCRIPT"]]
    if args[0] == "bare":
        command, args = [str(ROOT / "benchmarks" / "bare_sse.py")], args[1:]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *command,
        *args,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        if port is not None:
            async with httpx.AsyncClient() as client:
                for _ in range(600):
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                            break
                    await asyncio.sleep(0.1)
                else:
                    raise RuntimeError("the API did not become ready")
        yield proc.pid
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@asynccontextmanager
async def answering(base: str, rid: str, env: dict[str, str], bare: bool) -> AsyncIterator[int | None]:
    """Make the question's answer stream: a worker process claims it, or (``--bare``) the bare app
    is told to start it. Yields the worker's pid (None for the bare app)."""
    if bare:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            started = await client.post(f"/v1/questions/{rid}/start")
            assert started.status_code == 204, started.text
        yield None
        return
    async with process(["worker"], env) as worker_pid:
        yield worker_pid


async def phase(
    base: str, api_pid: int, env: dict[str, str], subscribers: int, clients: int, *, bare: bool = False
) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        posted = await client.post("/v1/sessions/bench-sse/questions", json={"question": "stream me"})
        assert posted.status_code == 202, posted.text
        rid = posted.json()["id"]
    clients = max(1, min(clients, subscribers))
    shares = [subscribers // clients + (1 if i < subscribers % clients else 0) for i in range(clients)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--client",
            base,
            f"/v1/questions/{rid}/events",
            str(share),
            stdout=subprocess.PIPE,
            cwd=ROOT,
            limit=64 << 20,
        )
        for share in shares
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 180)
            if line.strip() != b"ready":
                raise RuntimeError(f"client did not get ready: {line!r}")
        cpu_before = _cpu_seconds(api_pid)
        async with answering(base, rid, env, bare) as worker_pid:
            outputs = []
            for proc in procs:
                assert proc.stdout is not None
                outputs.append(json.loads(await asyncio.wait_for(proc.stdout.readline(), 300)))
            worker_cpu = sum(_cpu_seconds(worker_pid)) if worker_pid is not None else 0.0
        clients_cpu = sum(out["cpu_s"] for out in outputs)
        user, system = (
            after - before for after, before in zip(_cpu_seconds(api_pid), cpu_before, strict=True)
        )
    finally:
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()
    delays = [d for out in outputs for d in out["delta_delays_ms"]]
    done = [d for out in outputs for d in out["done_delays_ms"]]
    after = [d for out in outputs for d in out["done_after_last_delta_ms"]]
    deltas = sorted({n for out in outputs for n in out["deltas_per_connection"]})
    thirds = [[d for out in outputs for d in out["thirds_ms"][i]] for i in range(3)]
    by_event: dict[str, list[float]] = {}
    for out in outputs:
        for event_id, (first, last) in out["by_event"].items():
            _widen(by_event, event_id, first, last)
    firsts = [first for first, _ in by_event.values()]
    spreads = [last - first for first, last in by_event.values()]
    delivered = sum(len(out["delta_delays_ms"]) for out in outputs) + sum(
        len(out["done_delays_ms"]) for out in outputs
    )
    return {
        "subscribers": subscribers,
        "finished": sum(out["finished"] for out in outputs),
        "deltas": deltas,
        "delta_p50_ms": statistics.median(delays),
        "delta_p99_ms": percentile(delays, 99),
        "delta_max_ms": max(delays),
        "thirds_p50_ms": [statistics.median(third) if third else 0.0 for third in thirds],
        "first_p50_ms": statistics.median(firsts),
        "first_p99_ms": percentile(firsts, 99),
        "first_max_ms": max(firsts),
        "spread_p50_ms": statistics.median(spreads),
        "spread_p99_ms": percentile(spreads, 99),
        "done_p50_ms": statistics.median(done),
        "done_p99_ms": percentile(done, 99),
        "done_after_last_delta_p50_ms": statistics.median(after),
        "done_after_last_delta_p99_ms": percentile(after, 99),
        "server_gap_ms": outputs[0]["server_gap_ms"],
        "duplicates": sum(out["duplicates"] for out in outputs),
        "gaps": sum(out["gaps"] for out in outputs),
        "api_cpu_s": user + system,
        "api_user_s": user,
        "api_system_s": system,
        "api_cpu_us_per_delivery": (user + system) / max(delivered, 1) * 1e6,
        "clients_cpu_s": clients_cpu,
        "worker_cpu_s": worker_cpu,
    }


def _report(label: str, result: dict[str, Any]) -> None:
    print(
        f"{label}: {result['subscribers']} subscriber(s), {result['finished']} finished, "
        f"deltas per stream {result['deltas']}\n"
        f"  delta delay p50 {result['delta_p50_ms']:.1f} ms, p99 {result['delta_p99_ms']:.1f} ms, "
        f"max {result['delta_max_ms']:.1f} ms; p50 by third of the answer "
        f"{' / '.join(f'{v:.0f}' for v in result['thirds_p50_ms'])} ms\n"
        f"  per event: first subscriber's delay p50 {result['first_p50_ms']:.1f} ms, "
        f"p99 {result['first_p99_ms']:.1f} ms, max {result['first_max_ms']:.1f} ms; "
        f"first to last subscriber p50 {result['spread_p50_ms']:.1f} ms, "
        f"p99 {result['spread_p99_ms']:.1f} ms\n"
        f"  done delay p50 {result['done_p50_ms']:.1f} ms, p99 {result['done_p99_ms']:.1f} ms; "
        f"done after the last delta p50 {result['done_after_last_delta_p50_ms']:.1f} ms, "
        f"p99 {result['done_after_last_delta_p99_ms']:.1f} ms "
        f"(server-side gap {result['server_gap_ms']:.1f} ms)\n"
        f"  duplicates {result['duplicates']}, gaps {result['gaps']}; API CPU {result['api_cpu_s']:.2f} s "
        f"(user {result['api_user_s']:.2f}, system {result['api_system_s']:.2f}; "
        f"{result['api_cpu_us_per_delivery']:.1f} µs per delivered event); "
        f"client processes {result['clients_cpu_s']:.2f} s while streaming, "
        f"worker process {result['worker_cpu_s']:.2f} s (start-up included)",
        flush=True,
    )


async def main(args: argparse.Namespace) -> None:
    from tests import pg
    from tests.net import free_port
    from tests.scripted_provider import ScriptedServer, Step

    server = await asyncio.to_thread(pg.find_server)
    url = await pg.create_database(server.admin_url)
    words = " ".join(f"w{i}" for i in range(args.chunks))
    try:
        with ScriptedServer() as model:
            model.set_default(
                "answer", Step.text(words, chunks=args.chunks).with_delay(between_s=1.0 / args.rate)
            )
            port = free_port()
            env = {
                "SIDEQUEST_DATABASE_URL": url,
                "SIDEQUEST_PROVIDER": "openai",
                "SIDEQUEST_BASE_URL": model.base_url,
                "SIDEQUEST_API_KEY": "x",
                "SIDEQUEST_MODEL": "scripted-model",
                "SIDEQUEST_BACKGROUND_SUMMARIES": "off",
            }
            serve_args = (
                ["bare", "--chunks", str(args.chunks), "--rate", str(args.rate)] if args.bare else ["api"]
            )
            async with process([*serve_args, "--port", str(port)], env, port=port) as api_pid:
                base = f"http://127.0.0.1:{port}"
                print(
                    f"{'bare app (benchmarks/bare_sse.py)' if args.bare else 'API'} process: "
                    f"uvicorn loop {_available('uvloop', 'asyncio')}, "
                    f"HTTP {_available('httptools', 'h11')}; load average {os.getloadavg()}",
                    flush=True,
                )
                for run in range(args.runs):
                    floor = await phase(base, api_pid, env, 1, 1, bare=args.bare)
                    _report(f"run {run + 1} floor", floor)
                    fan = await phase(base, api_pid, env, args.subscribers, args.clients, bare=args.bare)
                    _report(f"run {run + 1} fan-out", fan)
                    p50_ratio = fan["delta_p50_ms"] / floor["delta_p50_ms"]
                    p99_ratio = fan["delta_p99_ms"] / floor["delta_p99_ms"]
                    verdict = "met" if fan["delta_p99_ms"] <= 100 else "NOT met"
                    print(
                        f"  ratio to the floor: delta p50 {p50_ratio:.1f}×, p99 {p99_ratio:.1f}×; "
                        f"target p99 ≤ 100 ms: {verdict}",
                        flush=True,
                    )
        if not args.bare:
            print(await stored_bytes(url), flush=True)
    finally:
        await pg.drop_database(server.admin_url, url)
        server.stop()


async def stored_bytes(url: str) -> str:
    """What one finished request of this benchmark occupies in PostgreSQL (row + events)."""
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        row = await conn.fetchrow(
            """
            SELECT count(*) AS requests,
                   avg(pg_column_size(r.*)) AS request_bytes,
                   avg((SELECT count(*) FROM side_question_events e WHERE e.request_id = r.id)) AS events,
                   avg((SELECT sum(pg_column_size(e.*)) FROM side_question_events e
                        WHERE e.request_id = r.id)) AS event_bytes
            FROM side_question_requests r WHERE r.status = 'succeeded'
            """
        )
    finally:
        await conn.close()
    return (
        f"stored per succeeded request ({row['requests']}): row {float(row['request_bytes']):.0f} B, "
        f"{float(row['events']):.0f} events {float(row['event_bytes']):.0f} B (heap tuples, before indexes)"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        with contextlib.suppress(ImportError):  # the harness's own loop: as cheap as available
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.run(_client_main(sys.argv[2], sys.argv[3], int(sys.argv[4])))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--rate", type=float, default=20.0, help="answer chunks per second")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--bare",
        action="store_true",
        help="the floor: benchmarks/bare_sse.py fans out the same events (no database, no worker)",
    )
    asyncio.run(main(parser.parse_args()))
