"""The kill-the-primary check (SPEC 9.1): Sidequest on a pg_auto_failover formation behind PgBouncer.

Two ``sidequest api`` and two ``sidequest worker`` processes run against the formation of
``tests/ha/formation.py`` (every pool through the PgBouncers, multi-host with
``target_session_attrs=read-write``; the LISTEN connections to the data nodes directly), answering
with the scripted model server over real HTTP, each answer a few seconds long. Clients keep admitting
questions (some with inline snapshots), follow request and session streams and resume them with
their last event id whenever they break, and cancel a few, while the primary is killed — SIGKILL of
its keeper's process group, then ``pg_ctl stop -m immediate`` — at random moments, again and again,
the old primary rejoining as a standby each time. Every call's outcome is recorded as ok, refused
(an HTTP answer that stored nothing: 503, 4xx) or unknown (no answer).

Afterwards, read from the new primary: every 202-acknowledged question exists and ended once; no two
runs of one request landed writes interleaved (each answer call streams its own text, so a run's
deltas are a prefix of one call's text), and no request ended twice; no usage entry twice; every
followed stream has no gap and no duplicate and ends with its terminal event; no 5xx but 503; and
the seconds from each kill to the next 202 of a question sent after it. The report's last line:
``failovers F, acknowledged lost L, duplicate executions D, stream gaps G, server errors E, recovery
p50 X s max Y s``. Run by ``scripts/test-ha`` (marker ``ha``; not in the default suite).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.store.db import open_connection, plain_dsn
from tests.api.sse_client import events
from tests.ha.formation import Formation, build_formation, missing_tools, record_group
from tests.net import free_port
from tests.scripted_provider import ScriptedServer, Step, Usage

pytestmark = pytest.mark.ha

FAILOVERS = int(os.environ.get("SIDEQUEST_HA_FAILOVERS", "6"))
CLIENTS = 4
SESSIONS = 8
ANSWER_WORDS = 10
TERMINAL_EVENTS = ("done", "error")
SNAPSHOT = {
    "system": "You are the main agent.",
    "messages": [
        {"role": "user", "content": "Move the config loader into its own module."},
        {"role": "assistant", "content": "service/config.py now holds the loader; the tests follow."},
    ],
}


@dataclass
class Outcomes:
    """Every call's outcome, and what the checks need of them."""

    counts: Counter[tuple[str, str]] = field(default_factory=Counter)  # (call, ok/refused/unknown)
    server_errors: list[str] = field(default_factory=list)  # 5xx other than 503
    refused_503: list[float] = field(default_factory=list)  # when each 503 came
    acknowledged: dict[str, str] = field(default_factory=dict)  # request id → parent id
    acks_sent_at: list[tuple[float, float]] = field(default_factory=list)  # (sent, answered) of 202s
    request_streams: dict[str, list[int]] = field(default_factory=dict)  # request id → seqs
    request_stream_ends: dict[str, str] = field(default_factory=dict)  # request id → last event type
    session_streams: dict[str, list[int]] = field(default_factory=dict)  # parent id → ids
    stream_resumes: int = 0

    def record(self, call: str, response: httpx.Response | None) -> str:
        if response is None:
            kind = "unknown"
        elif response.status_code < 400:
            kind = "ok"
        else:
            kind = "refused"
            if response.status_code == 503:
                self.refused_503.append(time.monotonic())
            elif response.status_code >= 500:
                self.server_errors.append(f"{call}: {response.status_code} {response.text[:300]}")
        self.counts[(call, kind)] += 1
        return kind


@dataclass
class Deployment:
    formation: Formation
    apis: list[str]
    processes: list[subprocess.Popen[bytes]]
    logs: list[Path]
    model: ScriptedServer


def _spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    record_group(process.pid)
    return process


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _answer_text(n: int) -> str:
    # Fixed-width and repeated: any 7-character prefix of a call's text names the call.
    return " ".join([f"w{n:06d}"] * ANSWER_WORDS)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    missing = missing_tools()
    assert not missing, f"missing {missing}: run scripts/test-ha, which installs them"
    logs_dir = tmp_path_factory.mktemp("ha-logs")
    formation = build_formation()
    processes: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        with ScriptedServer() as model:
            calls = itertools.count(1)
            model.respond_with(
                "answer",
                lambda _body: Step.text(
                    _answer_text(next(calls)), chunks=ANSWER_WORDS, usage=Usage(60, ANSWER_WORDS)
                ).with_delay(before_s=0.3, between_s=0.25),
            )
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("SIDEQUEST_")},
                "SIDEQUEST_DATABASE_URL": formation.database_url(),
                "SIDEQUEST_LISTEN_DATABASE_URL": formation.listen_url(),
                "SIDEQUEST_DATABASE_POOLER": "transaction",
                "SIDEQUEST_PROVIDER": "openai",
                "SIDEQUEST_BASE_URL": model.base_url,
                "SIDEQUEST_API_KEY": "x",
                "SIDEQUEST_MODEL": "scripted-model",
                "SIDEQUEST_MAX_CONCURRENCY": "6",
                "SIDEQUEST_BACKGROUND_SUMMARIES": "off",
                "SIDEQUEST_LEASE_S": "6",
                "SIDEQUEST_HEARTBEAT_S": "1",
                "SIDEQUEST_POLL_S": "0.5",
            }
            migrate = subprocess.run(
                [sys.executable, "-m", "service.cli", "migrate"], env=env, capture_output=True, timeout=120
            )
            assert migrate.returncode == 0, migrate.stderr.decode(errors="replace")
            apis = []
            for i in range(2):
                port = free_port()
                log = logs_dir / f"api-{i}.log"
                logs.append(log)
                processes.append(
                    _spawn([sys.executable, "-m", "service.cli", "api", "--port", str(port)], env, log)
                )
                apis.append(f"http://127.0.0.1:{port}")
            for i in range(2):
                log = logs_dir / f"worker-{i}.log"
                logs.append(log)
                processes.append(_spawn([sys.executable, "-m", "service.cli", "worker"], env, log))
            for base in apis:
                _wait_ready(base, processes, logs)
            yield Deployment(formation, apis, processes, logs, model)
    finally:
        for process in processes:
            _stop(process)
        formation.destroy()


def _wait_ready(base: str, processes: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        for process, log in zip(processes, logs, strict=True):
            assert process.poll() is None, log.read_text(errors="replace")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise AssertionError(f"{base} not ready")


# ---------------------------------------------------------------------------------------- clients


async def _call(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> httpx.Response | None:
    try:
        return await client.request(method, url, **kwargs)
    except httpx.HTTPError:
        return None


@contextlib.asynccontextmanager
async def _open_stream(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], out: Outcomes, call: str
) -> AsyncIterator[httpx.Response | None]:
    """An event stream opened and its outcome recorded: the response, or None when the API refused it
    (its body read first, so a 5xx is recorded with its text)."""
    async with client.stream("GET", url, headers=headers) as response:
        refused = response.status_code != 200
        if refused:
            await response.aread()
        out.record(call, response)
        yield None if refused else response


async def _follow_request(
    client: httpx.AsyncClient, apis: list[str], request_id: str, out: Outcomes, deadline: float
) -> None:
    """A request stream followed to its terminal event, resumed with its last id after any break."""
    seqs: list[int] = out.request_streams.setdefault(request_id, [])
    attempt = 0
    while time.monotonic() < deadline:
        base = apis[attempt % len(apis)]
        attempt += 1
        headers = {"Last-Event-ID": str(seqs[-1])} if seqs else {}
        if seqs:
            out.stream_resumes += 1
        try:
            async with _open_stream(
                client, f"{base}/v1/questions/{request_id}/events", headers, out, "stream"
            ) as r:
                if r is None:
                    await asyncio.sleep(0.5)
                    continue
                # The client leaves after a few events and resumes on the other API process.
                budget = random.randint(1, 6)
                async for message in events(r):
                    if message.id is not None:
                        seqs.append(int(message.id))
                    if message.event in TERMINAL_EVENTS:
                        out.request_stream_ends[request_id] = message.event
                        return
                    budget -= 1
                    if budget == 0:
                        break
        except httpx.HTTPError:
            out.record("stream", None)
        await asyncio.sleep(0.3)


async def _follow_session(
    client: httpx.AsyncClient, apis: list[str], parent: str, out: Outcomes, stop: asyncio.Event
) -> None:
    """A session stream followed until ``stop``, resumed with its last id after any break."""
    ids: list[int] = out.session_streams.setdefault(parent, [])
    attempt = 0
    while not stop.is_set():
        base = apis[attempt % len(apis)]
        attempt += 1
        headers = {"Last-Event-ID": str(ids[-1])} if ids else {}
        try:
            async with _open_stream(
                client, f"{base}/v1/sessions/{parent}/events", headers, out, "session stream"
            ) as r:
                if r is None:
                    await asyncio.sleep(0.5)
                    continue
                if ids:
                    out.stream_resumes += 1
                budget = random.randint(3, 20)
                async for message in events(r):
                    if message.id is not None:
                        ids.append(int(message.id))
                    budget -= 1
                    if stop.is_set() or budget == 0:
                        break
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.3)


async def _admitter(
    client: httpx.AsyncClient,
    apis: list[str],
    index: int,
    out: Outcomes,
    stop: asyncio.Event,
    followers: list[asyncio.Task[None]],
) -> None:
    rng = random.Random(index)
    sent = 0
    while not stop.is_set():
        parent = f"ha-{rng.randrange(SESSIONS)}"
        body: dict[str, Any] = {"question": f"client {index} question {sent}?"}
        if sent % 3 == 0:
            body["snapshot"] = SNAPSHOT
        sent += 1
        base = apis[sent % len(apis)]
        started = time.monotonic()
        response = await _call(
            client,
            "POST",
            f"{base}/v1/sessions/{parent}/questions",
            json=body,
            headers={"Idempotency-Key": uuid.uuid4().hex},
        )
        kind = out.record("admit", response)
        if kind == "ok" and response is not None and response.status_code == 202:
            request_id = response.json()["id"]
            out.acknowledged[request_id] = parent
            out.acks_sent_at.append((started, time.monotonic()))
            deadline = time.monotonic() + 300
            if rng.random() < 0.5:
                followers.append(
                    asyncio.create_task(_follow_request(client, apis, request_id, out, deadline))
                )
            if rng.random() < 0.1:
                followers.append(
                    asyncio.create_task(_cancel_later(client, base, request_id, out, rng.uniform(0.3, 2)))
                )
        # A refused question is asked again soon (the 503's Retry-After is 2 s; sooner measures the
        # recovery more finely), an answered one after a pause.
        await asyncio.sleep(rng.uniform(0.3, 0.7) if kind != "ok" else rng.uniform(1.0, 2.5))


async def _cancel_later(
    client: httpx.AsyncClient, base: str, request_id: str, out: Outcomes, after_s: float
) -> None:
    await asyncio.sleep(after_s)
    out.record("cancel", await _call(client, "POST", f"{base}/v1/questions/{request_id}/cancel"))


# ---------------------------------------------------------------------------------------- the run


@dataclass
class Kill:
    node: str
    at: float
    new_primary_after_s: float
    healthy_after_s: float


def _kill_and_recover(formation: Formation) -> Kill:
    old = formation.primary()
    assert old is not None, formation.states()
    at = time.monotonic()
    formation.kill_primary(old)
    formation.wait_new_primary(old)
    promoted = time.monotonic() - at
    formation.start_keeper(old)
    formation.wait_healthy()
    return Kill(old.name, at, promoted, time.monotonic() - at)


async def _db_rows(formation: Formation, sql: str, *args: Any) -> list[Any]:
    conn = await open_connection(plain_dsn(formation.listen_url()), command_timeout=30)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def _clients(deployment: Deployment, out: Outcomes) -> AsyncIterator[None]:
    """The clients at work for as long as the context lasts; then every acknowledged question's
    followed stream is given time to reach its terminal event."""
    stop = asyncio.Event()
    followers: list[asyncio.Task[None]] = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=30), limits=limits) as client:
        admitters = [
            asyncio.create_task(_admitter(client, deployment.apis, i, out, stop, followers))
            for i in range(CLIENTS)
        ]
        sessions = [
            asyncio.create_task(_follow_session(client, deployment.apis, f"ha-{i}", out, stop))
            for i in range(2)
        ]
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(*admitters, return_exceptions=True)
            # Request streams end with their terminal event; give them time to get there.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(120):
                    await asyncio.gather(*followers, return_exceptions=True)
            for task in [*followers, *sessions]:
                task.cancel()
            await asyncio.gather(*followers, *sessions, return_exceptions=True)


async def test_kill_the_primary_again_and_again(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    formation = deployment.formation
    out = Outcomes()
    kills: list[Kill] = []
    rng = random.Random(int(os.environ.get("SIDEQUEST_HA_SEED", "9")))
    # Synchronous replication on, and no server-side timeout that could cancel a commit waiting for it.
    settings = await _db_rows(
        formation,
        "SELECT current_setting('synchronous_commit') AS sync, current_setting('synchronous_standby_names')"
        " AS standbys, current_setting('statement_timeout') AS timeout",
    )
    replication = dict(settings[0])
    assert replication["sync"] == "on" and replication["standbys"] and replication["timeout"] == "0", (
        replication
    )
    started = time.monotonic()
    async with _clients(deployment, out):
        await asyncio.sleep(8)  # the first questions flow before the first kill
        for _ in range(FAILOVERS):
            await asyncio.sleep(rng.uniform(2, 9))
            kills.append(await asyncio.to_thread(_kill_and_recover, formation))
        await asyncio.sleep(6)  # questions admitted after the last failover
    # Everything acknowledged ends (answers take seconds; a re-run waits for a lease to expire).
    ids = list(out.acknowledged)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        rows = await _db_rows(
            formation,
            "SELECT count(*) AS n FROM side_question_requests WHERE status IN ('queued', 'running')",
        )
        if rows[0]["n"] == 0:
            break
        await asyncio.sleep(1)
    report = await _check(deployment, out, kills, ids, time.monotonic() - started, replication)
    with capsys.disabled():
        print("\n" + report.text, flush=True)
    assert report.failovers >= 5, report.text
    assert (report.lost, report.duplicates, report.gaps, report.server_errors) == (0, 0, 0, 0), report.text
    assert report.usage_twice == 0, report.text


@dataclass
class Report:
    text: str
    failovers: int
    lost: int
    duplicates: int
    gaps: int
    server_errors: int
    usage_twice: int


def _stored_json(value: Any) -> Any:
    """A json / jsonb column as the driver returned it: text without a type codec, else the value."""
    return json.loads(value) if isinstance(value, str) else value


async def _check(
    deployment: Deployment,
    out: Outcomes,
    kills: list[Kill],
    ids: list[str],
    wall_s: float,
    replication: dict[str, str],
) -> Report:
    formation = deployment.formation
    lines: list[str] = []
    uuids = [uuid.UUID(i) for i in ids]
    requests = {
        str(row["id"]): row
        for row in await _db_rows(
            formation,
            "SELECT id, status, attempt, usage, error FROM side_question_requests WHERE id = ANY($1::uuid[])",
            uuids,
        )
    }
    event_rows = await _db_rows(
        formation,
        "SELECT request_id, seq, type, data FROM side_question_events"
        " WHERE request_id = ANY($1::uuid[]) ORDER BY request_id, seq",
        uuids,
    )
    by_request: dict[str, list[Any]] = defaultdict(list)
    for row in event_rows:
        by_request[str(row["request_id"])].append(row)

    # Acknowledged, and ended exactly once.
    lost = [
        i
        for i in ids
        if i not in requests or requests[i]["status"] not in ("succeeded", "failed", "cancelled")
    ]
    statuses = Counter(requests[i]["status"] for i in ids if i in requests)
    failures = Counter(
        (_stored_json(row["error"]) or {}).get("code")
        for row in requests.values()
        if row["status"] == "failed"
    )
    ended_twice = [i for i in ids if sum(1 for e in by_request[i] if e["type"] in TERMINAL_EVENTS) > 1]

    # No two runs interleaved: each run (from its claim's status event) streamed one call's text.
    interleaved = []
    for i in ids:
        segments: list[str] = []
        for event in by_request[i]:
            data = _stored_json(event["data"])
            if event["type"] == "status" and data.get("status") == "running":
                segments.append("")
            elif event["type"] == "delta" and segments:
                segments[-1] += data.get("text", "")
        if any(len(text) >= 7 and not _answer_text(int(text[1:7])).startswith(text) for text in segments):
            interleaved.append(i)
    duplicates = sorted(set(ended_twice) | set(interleaved))

    # No usage entry twice.
    usage_twice = 0
    for i in ids:
        usage = _stored_json(requests[i]["usage"]) if i in requests else {}
        call_ids = [c.get("call_id") for c in (usage or {}).get("calls", [])]
        usage_twice += len(call_ids) - len(set(call_ids))

    # Streams: no gap, no duplicate, ends with its terminal event.
    gaps = []
    for request_id, seqs in out.request_streams.items():
        if not seqs or seqs != list(range(1, len(seqs) + 1)):
            gaps.append(f"request {request_id}: {seqs}")
        elif out.request_stream_ends.get(request_id) not in TERMINAL_EVENTS:
            gaps.append(f"request {request_id}: no terminal event (got {len(seqs)} events)")
    for parent, got in out.session_streams.items():
        if got != sorted(set(got)):
            gaps.append(f"session {parent}: out of order or duplicated")
            continue
        if not got:
            continue
        stored = [
            row["id"]
            for row in await _db_rows(
                formation,
                "SELECT e.id FROM side_question_events e JOIN side_question_sessions s ON s.id = e.session_id"
                " WHERE s.parent_id = $1 AND e.id <= $2 ORDER BY e.id",
                parent,
                got[-1],
            )
        ]
        if stored != got:
            gaps.append(f"session {parent}: {len(set(stored) - set(got))} stored events never streamed")

    # Recovery: from each kill to the first 202 of a question sent after it.
    recovery = []
    for kill in kills:
        after = [answered - kill.at for sent, answered in out.acks_sent_at if sent >= kill.at]
        if after:
            recovery.append(min(after))
    during = sum(
        1 for at in out.refused_503 if any(k.at <= at <= k.at + k.new_primary_after_s + 5 for k in kills)
    )

    lines.append(f"kill-the-primary check: {len(kills)} failovers in {wall_s:.0f} s")
    lines.append(
        f"  primary: synchronous_commit {replication['sync']}, synchronous_standby_names"
        f" '{replication['standbys']}', statement_timeout {replication['timeout']}"
    )
    for n, kill in enumerate(kills, 1):
        lines.append(
            f"  failover {n}: killed {kill.node}; new primary after {kill.new_primary_after_s:.1f} s,"
            f" old primary back as standby after {kill.healthy_after_s:.1f} s"
        )
    for call in sorted({c for c, _ in out.counts}):
        parts = ", ".join(f"{kind} {out.counts[(call, kind)]}" for kind in ("ok", "refused", "unknown"))
        lines.append(f"  {call}: {parts}")
    lines.append(f"  acknowledged: {len(ids)}; final states {dict(statuses)}; failed with {dict(failures)}")
    lines.append(f"  503 answers: {len(out.refused_503)} ({during} of them within a failover)")
    lines.append(
        f"  streams followed: {len(out.request_streams)} request, {len(out.session_streams)} session;"
        f" resumed {out.stream_resumes} times"
    )
    lines.append(f"  usage entries recorded twice: {usage_twice}")
    for detail in lost[:5] + duplicates[:5] + gaps[:5] + out.server_errors[:5]:
        lines.append(f"  ! {detail}")
    p50 = statistics.median(recovery) if recovery else float("nan")
    worst = max(recovery) if recovery else float("nan")
    lines.append(
        f"failovers {len(kills)}, acknowledged lost {len(lost)}, duplicate executions {len(duplicates)},"
        f" stream gaps {len(gaps)}, server errors {len(out.server_errors)},"
        f" recovery p50 {p50:.1f} s max {worst:.1f} s"
    )
    return Report(
        "\n".join(lines),
        len(kills),
        len(lost),
        len(duplicates),
        len(gaps),
        len(out.server_errors),
        usage_twice,
    )
