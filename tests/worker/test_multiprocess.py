"""Two real worker processes on one PostgreSQL: global cap, per-session order, fairness, kill -9."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from service.config import Settings
from service.store import lease
from service.store.db import Database
from service.vocabulary import JobKind
from tests.factories import add_history, admit, enqueue_job, make_session
from tests.scripted_provider import ScriptedServer, Step, Usage
from tests.worker.conftest import events_of, row_of, status_of, wait_for

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcesses:
    """Starts ``sidequest worker`` subprocesses; kills whatever is left at the end."""

    def __init__(self, settings: Settings, server: ScriptedServer) -> None:
        self.env = {
            **os.environ,
            "SIDEQUEST_DATABASE_URL": str(settings.database_url),
            "SIDEQUEST_PROVIDER": "openai",
            "SIDEQUEST_BASE_URL": server.base_url,
            "SIDEQUEST_API_KEY": "test-key",
            "SIDEQUEST_MODEL": "scripted-model",
            "SIDEQUEST_MAX_CONCURRENCY": "4",
            # Leases long enough that a starved process on a loaded 2-core machine is not taken for
            # a dead one (the cap and fairness are what these tests check; the kill test waits it out).
            "SIDEQUEST_LEASE_S": "3.0",
            "SIDEQUEST_HEARTBEAT_S": "0.3",
            "SIDEQUEST_POLL_S": "0.1",
            "SIDEQUEST_REQUEST_TIMEOUT_S": "30",
        }
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "worker"],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.processes.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def workers(worker_settings: Settings, server: ScriptedServer) -> Iterator[WorkerProcesses]:
    group = WorkerProcesses(worker_settings, server)
    try:
        yield group
    finally:
        group.stop_all()


async def test_two_processes_share_the_cap_in_order_and_round_robin(
    db: Database, server: ScriptedServer, workers: WorkerProcesses
) -> None:
    server.set_default("answer", Step.text("ok", usage=Usage(20, 1), delay_before_s=0.06))
    sessions = [await make_session(db, f"fair-{i:02d}") for i in range(20)]
    ids: dict[uuid.UUID, list[uuid.UUID]] = defaultdict(list)
    # Admitted session by session: a plain FIFO queue would serve fair-00 five times before fair-19
    # ever started; round robin must not.
    for sid in sessions:
        for round_no in range(5):
            ids[sid].append(await admit(db, sid, f"question {round_no}"))
    all_ids = [rid for per in ids.values() for rid in per]

    max_running = 0
    max_per_session = 0
    owners: set[str] = set()
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal max_running, max_per_session
        while not done.is_set():
            async with db.sessions() as session:
                rows = (
                    await session.execute(
                        text(
                            "SELECT session_id, lease_owner FROM side_question_requests "
                            "WHERE status = 'running'"
                        )
                    )
                ).all()
            max_running = max(max_running, len(rows))
            per_session: dict[uuid.UUID, int] = defaultdict(int)
            for row in rows:
                per_session[row.session_id] += 1
                if row.lease_owner:
                    owners.add(lease.worker_of(row.lease_owner))
            max_per_session = max([max_per_session, *per_session.values()])
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    workers.start()
    workers.start()

    async def all_succeeded() -> bool:
        async with db.sessions() as session:
            left = await session.scalar(
                text("SELECT count(*) FROM side_question_requests WHERE status <> 'succeeded'")
            )
        return bool(left == 0)

    try:
        await wait_for(all_succeeded, within=60)
    finally:
        done.set()
        await sampler

    assert max_running <= 4, f"saw {max_running} running at once"
    assert max_running == 4  # the slots were actually shared, not serialised
    assert max_per_session == 1
    assert len(owners) == 2, "both worker processes ran requests"

    # Claim order = order of the `preparing` status events (their global ids are taken under the
    # claim lock, so they are the exact order in which requests were claimed).
    async with db.sessions() as session:
        claims = (
            await session.execute(
                text(
                    "SELECT e.id, r.session_id, r.ordinal FROM side_question_events e "
                    "JOIN side_question_requests r ON r.id = e.request_id "
                    "WHERE e.type = 'status' AND e.data->>'stage' = 'preparing' ORDER BY e.id"
                )
            )
        ).all()
    assert len(claims) == 100
    positions: dict[uuid.UUID, list[int]] = defaultdict(list)
    for index, claim in enumerate(claims):
        positions[claim.session_id].append(index)
        # per-session ordinal order
        assert claim.ordinal == len(positions[claim.session_id])
    for sid, seen in positions.items():
        # The first round serves every session once before any session gets a second turn …
        assert seen[0] < 20, f"session {sid} first started at claim #{seen[0]}"
        # … and afterwards no session waits behind more than one round of the others.
        gaps = [b - a - 1 for a, b in itertools.pairwise(seen)]
        assert max(gaps) <= 19, f"session {sid} waited behind {max(gaps)} other claims"
    assert {await status_of(db, rid) for rid in all_ids} == {"succeeded"}


async def test_kill_9_mid_answer_reruns_the_request_and_keeps_recorded_usage(
    db: Database, server: ScriptedServer, workers: WorkerProcesses
) -> None:
    sid = await make_session(db, "crash")
    await add_history(db, sid, [(f"q{i}", f"a{i}") for i in range(1, 22)])  # one summary call first
    server.script("qa_summary", Step.valid_summary(usage=Usage(321, 45)))
    server.script(
        "answer", Step.text("word " * 100, chunks=100, usage=Usage(99, 99)).with_delay(between_s=0.05)
    )
    rid = await admit(db, sid, "will the worker survive?")
    victim = workers.start()

    async def streaming() -> bool:
        return any(e.type == "delta" for e in await events_of(db, rid))

    await wait_for(streaming, within=20)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=5)
    before = await row_of(db, rid)
    assert before.status == "running"
    assert [(c["purpose"], c["status"], c["input_tokens"]) for c in before.usage["calls"]] == [
        ("qa_summary", "ok", 321)
    ]

    workers.start()  # a survivor: its sweep finds the expired lease, re-queues, and runs it again

    async def ended() -> bool:
        return await status_of(db, rid) in ("succeeded", "failed")

    await wait_for(ended, within=30)
    row = await row_of(db, rid)
    assert row.status == "succeeded" and row.attempt == 2
    assert row.answer == "Scripted answer."
    calls = [(c["purpose"], c["status"], c["input_tokens"]) for c in row.usage["calls"]]
    # The usage recorded before the kill is kept; the killed answer call never reported any.
    assert calls[0] == ("qa_summary", "ok", 321)
    # The re-run answer is the default step, which counts its prompt from the body it received.
    assert calls[-1][:2] == ("answer", "ok") and calls[-1][2] > 0
    assert row.usage["input_tokens"] == sum(c["input_tokens"] for c in row.usage["calls"])
    events = await events_of(db, rid)
    kinds = [(e.type, e.data.get("status"), e.data.get("what")) for e in events]
    assert ("progress", None, "worker_lost_rerun") in kinds
    assert ("status", "queued", None) in kinds
    assert [e.type for e in events][-2:] == ["status", "done"]
    # Attempt 2 found the rolling summary attempt 1 had saved: no second summary call of its own
    # (a background fold queued by its success carries a job id, not this request's id).
    own = [r for r in server.requests("qa_summary") if r.headers.get("x-sidequest-request-id") == str(rid)]
    assert len(own) == 1


async def test_two_processes_never_run_the_same_background_job(
    workers: WorkerProcesses, db: Database, server: ScriptedServer
) -> None:
    """SPEC 6.6: jobs are claimed like requests (SKIP LOCKED under a cap): across processes, each runs
    exactly once."""

    workers.env["SIDEQUEST_MAX_BACKGROUND_CONCURRENCY"] = "4"
    server.set_default("qa_summary", Step.valid_summary().with_delay(before_s=0.3))
    ids: list[uuid.UUID] = []
    for i in range(8):
        sid = await make_session(db, f"jobs-{i}")
        await add_history(db, sid, [(f"q{n}", f"a{n}") for n in range(1, 4)])
        ids.append(await enqueue_job(db, sid, JobKind.QA_FOLD, "1-3", {"through_ordinal": 3}))
    workers.start()
    workers.start()

    async def all_succeeded() -> bool:
        async with db.sessions() as session:
            left = await session.scalar(
                text("SELECT count(*) FROM side_question_jobs WHERE status <> 'succeeded'")
            )
        return bool(left == 0)

    await wait_for(all_succeeded, within=60)
    calls = server.requests("qa_summary")
    assert sorted(r.headers["x-sidequest-job-id"] for r in calls) == sorted(str(i) for i in ids)
    async with db.sessions() as session:
        rows = (await session.execute(text("SELECT attempt, lease_owner FROM side_question_jobs"))).all()
    assert [r.attempt for r in rows] == [1] * len(ids)
