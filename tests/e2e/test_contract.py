"""The product contract (SPEC.md), checked from the outside the way an examiner would.

Two real ``python -m service.cli serve`` processes (one without auth, one with two tenants) run for
the whole module against the test run's database, with the OpenAI-compatible provider pointed at one
scripted model server; everything below talks to them over HTTP (httpx) or through the CLI only.
Both processes run a worker, so any of them may run any request (SPEC §9: workers share nothing but
PostgreSQL); the scripted server hands out its steps per purpose, first in first out, so every test
lets its own requests finish (or cancels them) before it ends.

A third process (``limited``: Anthropic provider, short deadline, one summary call, CORS, short
leases) has its own database and scripted server, for the settings that would disturb the others;
the crash test at the end kills it and brings up ``sidequest api`` + ``sidequest worker`` instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import asyncpg
import httpx
import pytest

from service.store.models import Base
from tests.api.sse_client import Message, messages
from tests.scripted_provider import STREAM_OVERFLOW_ERROR, STREAM_SERVER_ERROR, ScriptedServer, Step, Usage

READY_WITHIN_S = 30.0
TOKENS = "acme:tok-a,globex:tok-g"
TERMINAL = ("succeeded", "failed", "cancelled")
STAGES = ("preparing", "organizing_history", "compacting_context", "answering")
# Every table of the schema (the models are the one list), emptied between tests.
TABLES = tuple(table.name for table in Base.metadata.sorted_tables)

RECORD_FIELDS = {
    "id", "parent_id", "ordinal", "question", "status", "stage", "answer", "truncated", "stop_reason",
    "error", "usage", "context_info", "model", "snapshot_id", "attempt", "created_at", "started_at",
    "finished_at",
}  # fmt: skip
USAGE_FIELDS = {"input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens", "calls"}
CALL_FIELDS = {
    "purpose", "model", "status", "reported", "input_tokens", "output_tokens", "reasoning_tokens",
    "cached_tokens",
}  # fmt: skip
CONTEXT_INFO_FIELDS = {
    "stage", "window", "max_output_tokens", "safety_margin", "input_budget", "estimate", "pressure",
    "replayed_groups", "replayed_ordinals", "qa_summary", "context_summary", "summary_calls",
    "overflow_retries", "provider_prompt_tokens", "drift",
}  # fmt: skip
ESTIMATE_FIELDS = {"system", "tools", "context", "qa_summary", "qa_raw", "question", "envelope", "total"}
SPEC_ROUTES = {
    ("post", "/v1/sessions/{}/questions"),
    ("get", "/v1/sessions/{}/questions"),
    ("delete", "/v1/sessions/{}/questions"),
    ("get", "/v1/questions/{}"),
    ("get", "/v1/questions/{}/events"),
    ("get", "/v1/sessions/{}/events"),
    ("post", "/v1/questions/{}/cancel"),
    ("put", "/v1/sessions/{}/snapshots/{}"),
    ("get", "/v1/sessions/{}"),
    ("get", "/v1/sessions/{}/archive"),
    ("post", "/v1/sessions/{}/archive"),
    ("post", "/v1/questions/{}/stream-token"),
    ("post", "/v1/sessions/{}/stream-token"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
}
ISO_UTC_MICROS = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}(Z|\+00:00)$")

SNAPSHOT: dict[str, Any] = {
    "taken_at": "2026-11-29T10:00:00Z",
    "system": "You are a coding agent working on the billing service.",
    "tools": [{"name": "grep", "description": "Search files.", "input_schema": {"type": "object"}}],
    "messages": [
        {"role": "user", "content": "Fix the rounding bug in invoices."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me search for it."},
                {"type": "tool_use", "id": "t1", "name": "grep", "input": {"pattern": "round("}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "billing/invoice.py:12"}],
        },
        {"role": "assistant", "content": "The bug is in billing/invoice.py line 12; editing it now."},
    ],
    "context_window": 200000,
    "max_output_tokens": 32000,
}


# ------------------------------------------------------------------------------------ the service


@dataclass
class Service:
    """One ``sidequest serve`` process."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _empty_tables(database_url: str) -> None:
    """Start from empty tables: requests left queued by earlier modules would otherwise be run by
    these workers and consume the scripted steps (the ``db`` fixture empties them per test too)."""
    conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        await conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")
    finally:
        await conn.close()


def _environment(database_url: str, scripted: ScriptedServer, **extra: str) -> dict[str, str]:
    prefixes = ("SIDEQUEST_", "OPENAI_", "ANTHROPIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(
        SIDEQUEST_DATABASE_URL=database_url,
        SIDEQUEST_PROVIDER="openai",
        SIDEQUEST_BASE_URL=scripted.base_url,
        SIDEQUEST_API_KEY="sk-scripted",
        SIDEQUEST_MODEL="scripted-model",
        SIDEQUEST_LEASE_S="3",
        SIDEQUEST_HEARTBEAT_S="0.5",
        SIDEQUEST_POLL_S="0.2",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    env.update(extra)
    return env


def _start(env: dict[str, str], log: Path, command: str = "serve") -> Service:
    """Start ``sidequest <command>`` (serve, api: on a free port; worker: no port)."""
    port = _free_port()
    args = ["--port", str(port)] if command in ("serve", "api") else []
    # A file, not a pipe: nobody reads a pipe while the server runs, and a full one would block it.
    out: IO[bytes] = log.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", command, *args],
        env=env,
        cwd=log.parent,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    out.close()
    return Service(f"http://127.0.0.1:{port}", proc, log)


def _wait_ready(service: Service) -> None:
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise AssertionError(f"serve exited with {service.proc.returncode}:\n{service.log.read_text()}")
        try:
            if httpx.get(service.url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"/readyz not 200 within {READY_WITHIN_S} s:\n{service.log.read_text()}")


def _stop(service: Service) -> None:
    if service.proc.poll() is None:
        service.proc.send_signal(signal.SIGTERM)
        try:
            service.proc.wait(20)
        except subprocess.TimeoutExpired:
            service.proc.kill()
            service.proc.wait(10)


@pytest.fixture(scope="module")
def scripted() -> Iterator[ScriptedServer]:
    with ScriptedServer() as server:
        yield server


@pytest.fixture(scope="module")
def services(
    database_url: str,
    scripted: ScriptedServer,
    _limited_box: Isolated,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Service]]:
    """``open`` (no auth, tenant default) and ``auth`` (tenants acme and globex), both ready; and the
    ``limited`` service of the isolated tests below, started at the same time to save a start-up."""
    asyncio.run(_empty_tables(database_url))
    folder = tmp_path_factory.mktemp("contract")
    started: dict[str, Service] = {}
    try:
        started["open"] = _start(_environment(database_url, scripted), folder / "open.log")
        started["auth"] = _start(
            _environment(database_url, scripted, SIDEQUEST_API_TOKENS=TOKENS), folder / "auth.log"
        )
        started["limited"] = _limited_box.launch(**limited_env(_limited_box.scripted))
        for service in started.values():
            _wait_ready(service)
        yield started
    finally:
        for service in started.values():
            if service.proc.poll() is None:
                service.proc.send_signal(signal.SIGTERM)
        for service in started.values():
            _stop(service)


@pytest.fixture(autouse=True)
def _fresh_script(scripted: ScriptedServer) -> None:
    """Each test scripts its own steps and counts its own provider calls."""
    scripted.reset()


@pytest.fixture
async def client(services: dict[str, Service]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=services["open"].url, timeout=10) as http:
        yield http


def _tenant_client(services: dict[str, Service], token: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=services["auth"].url, headers=headers, timeout=10)


@pytest.fixture
async def acme(services: dict[str, Service]) -> AsyncIterator[httpx.AsyncClient]:
    async with _tenant_client(services, "tok-a") as http:
        yield http


@pytest.fixture
async def globex(services: dict[str, Service]) -> AsyncIterator[httpx.AsyncClient]:
    async with _tenant_client(services, "tok-g") as http:
        yield http


# ------------------------------------------------------------------------------------ helpers


def new_parent() -> str:
    """A parent id no other test (or earlier run on this database) uses."""
    return f"e2e-{uuid.uuid4().hex[:12]}"


async def ask(
    http: httpx.AsyncClient, parent: str, question: str = "What is the agent doing?", **body: Any
) -> dict[str, Any]:
    response = await http.post(f"/v1/sessions/{parent}/questions", json={"question": question, **body})
    assert response.status_code == 202, response.text
    record: dict[str, Any] = response.json()
    return record


async def wait_for(
    http: httpx.AsyncClient, request_id: str, statuses: tuple[str, ...] = TERMINAL, within_s: float = 15.0
) -> dict[str, Any]:
    """Poll the record until its status is one of ``statuses``."""
    deadline = time.monotonic() + within_s
    while True:
        response = await http.get(f"/v1/questions/{request_id}")
        assert response.status_code == 200, response.text
        record: dict[str, Any] = response.json()
        if record["status"] in statuses:
            return record
        if time.monotonic() > deadline:
            raise AssertionError(f"{request_id} still {record['status']} after {within_s} s")
        await asyncio.sleep(0.05)


async def read_stream(
    http: httpx.AsyncClient,
    path: str,
    *,
    headers: Mapping[str, str] | None = None,
    params: Mapping[str, Any] | None = None,
    within_s: float = 15.0,
) -> tuple[int, list[Message]]:
    """Status and every message (retry hint and comments included) of a stream that ends by itself."""
    async with asyncio.timeout(within_s):
        async with http.stream("GET", path, headers=headers, params=params) as response:
            if response.status_code != 200:
                await response.aread()
                return response.status_code, []
            return 200, [m async for m in messages(response)]


def events_of(stream: list[Message]) -> list[Message]:
    return [m for m in stream if m.event is not None]


async def session_events_until(
    http: httpx.AsyncClient, parent: str, done: int, *, headers: Mapping[str, str] | None = None
) -> list[Message]:
    """Session stream events until ``done`` terminal events (done / error) were seen (it never ends)."""
    seen: list[Message] = []
    async with asyncio.timeout(15):
        async with http.stream("GET", f"/v1/sessions/{parent}/events", headers=headers) as response:
            assert response.status_code == 200
            async for message in messages(response):
                if message.event is None:
                    continue
                seen.append(message)
                if sum(m.event in ("done", "error") for m in seen) >= done:
                    return seen
    raise AssertionError("unreachable")


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The response is ``status`` with SPEC's error envelope (and ``code``, when given)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert {"code", "message", "detail"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["detail"], dict)
    if code is not None:
        assert error["code"] == code, error
    return error


def parse_utc(value: str) -> datetime:
    assert ISO_UTC_MICROS.match(value), value
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


async def hang_and_wait_running(
    http: httpx.AsyncClient, scripted: ScriptedServer, parent: str, **body: Any
) -> dict[str, Any]:
    """A request whose answer call never returns, once it runs (cancel or clear it afterwards)."""
    scripted.script("answer", Step.hang())
    record = await ask(http, parent, "This one hangs.", **body)
    running = await wait_for(http, record["id"], ("running", *TERMINAL))
    assert running["status"] == "running", running
    deadline = time.monotonic() + 10
    while not any(r.request_id == record["id"] for r in scripted.requests("answer")):
        assert time.monotonic() < deadline, "the hanging answer call never reached the provider"
        await asyncio.sleep(0.02)
    return running


# ------------------------------------------------------------------------------------ admission


async def test_post_returns_202_queued_record_with_every_spec_field(client: httpx.AsyncClient) -> None:
    parent = new_parent()
    response = await client.post(f"/v1/sessions/{parent}/questions", json={"question": "Which file?"})
    assert response.status_code == 202
    record = response.json()
    assert RECORD_FIELDS <= set(record), RECORD_FIELDS - set(record)
    assert record["status"] == "queued"
    assert record["parent_id"] == parent and record["ordinal"] == 1 and record["question"] == "Which file?"
    assert record["answer"] is None and record["error"] is None and record["snapshot_id"] is None
    assert record["started_at"] is None and record["finished_at"] is None
    parse_utc(record["created_at"])
    assert uuid.UUID(record["id"])
    await wait_for(client, record["id"])


async def test_idempotency_key_replays_same_body_with_200_and_refuses_other_body_with_409(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    path = f"/v1/sessions/{parent}/questions"
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    first = await client.post(path, json={"question": "Once?"}, headers=key)
    assert first.status_code == 202
    again = await client.post(path, json={"question": "Once?"}, headers=key)
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"] and again.json()["ordinal"] == 1
    other = await client.post(path, json={"question": "Twice?"}, headers=key)
    assert_error(other, 409)
    await wait_for(client, first.json()["id"])
    page = (await client.get(path)).json()
    assert [item["ordinal"] for item in page["items"]] == [1]


async def test_history_pages_are_ascending_with_has_more_next_before_and_limit_bounds(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    ids = [(await ask(client, parent, f"Question {n}?"))["id"] for n in range(1, 6)]
    for rid in ids:
        await wait_for(client, rid)
    path = f"/v1/sessions/{parent}/questions"

    newest = (await client.get(path, params={"limit": 2})).json()
    assert [i["ordinal"] for i in newest["items"]] == [4, 5]
    assert newest["has_more"] is True and newest["next_before"] == 4
    middle = (await client.get(path, params={"limit": 2, "before": newest["next_before"]})).json()
    assert [i["ordinal"] for i in middle["items"]] == [2, 3]
    assert middle["has_more"] is True and middle["next_before"] == 2
    oldest = (await client.get(path, params={"limit": 2, "before": 2})).json()
    assert [i["ordinal"] for i in oldest["items"]] == [1]
    assert oldest["has_more"] is False and oldest["next_before"] is None
    everything = (await client.get(path)).json()
    assert [i["ordinal"] for i in everything["items"]] == [1, 2, 3, 4, 5]
    assert everything["has_more"] is False and everything["next_before"] is None
    assert RECORD_FIELDS <= set(everything["items"][0])

    assert (await client.get(path, params={"limit": 1})).status_code == 200
    assert (await client.get(path, params={"limit": 100})).status_code == 200
    assert_error(await client.get(path, params={"limit": 0}), 422)
    assert_error(await client.get(path, params={"limit": 101}), 422)
    assert_error(await client.get(f"/v1/sessions/{new_parent()}/questions"), 404)


async def test_record_reports_answer_usage_context_info_and_ordered_timings(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    record = await ask(client, parent, "Which file is being edited?", snapshot=SNAPSHOT)
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["answer"] == "Scripted answer."
    assert done["truncated"] is False and done["stop_reason"] == "stop" and done["error"] is None
    assert done["model"] == "scripted-model"
    assert done["attempt"] >= 1
    created, started, finished = (parse_utc(done[k]) for k in ("created_at", "started_at", "finished_at"))
    assert created <= started <= finished
    assert USAGE_FIELDS <= set(done["usage"])
    info = done["context_info"]
    assert CONTEXT_INFO_FIELDS <= set(info), CONTEXT_INFO_FIELDS - set(info)
    assert ESTIMATE_FIELDS <= set(info["estimate"])
    assert {"used", "covered_through_ordinal", "updated", "calls"} <= set(info["qa_summary"])
    assert {"used", "cache", "summarized_messages", "kept_messages", "calls", "chunks"} <= set(
        info["context_summary"]
    )
    assert info["pressure"] in ("normal", "tight", "critical")
    assert info["window"] == 200000
    assert info["input_budget"] == info["window"] - info["max_output_tokens"] - info["safety_margin"]
    assert info["safety_margin"] == 8192  # 5 % of 200000 is 10000, capped at 8192


# ------------------------------------------------------------------------------------ streams


async def test_request_stream_ids_are_seq_with_spec_data_and_status_order(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.text("It is editing billing/invoice.py.", chunks=3, usage=Usage(200, 9)))
    record = await ask(client, new_parent(), "Which file?", snapshot=SNAPSHOT)
    status, stream = await read_stream(client, f"/v1/questions/{record['id']}/events")
    assert status == 200
    assert any(m.retry is not None and m.retry > 0 for m in stream), "no retry: hint"
    events = events_of(stream)
    assert [int(m.id or 0) for m in events] == list(range(1, len(events) + 1))
    for message in events:
        data = message.json()
        assert message.event in ("status", "progress", "delta", "usage", "done", "error")
        assert data["request_id"] == record["id"] and data["ordinal"] == record["ordinal"]
        assert data["seq"] == int(message.id or 0)
        parse_utc(data["at"])
    statuses = [m.json() for m in events if m.event == "status"]
    assert statuses[0]["status"] == "queued"
    assert statuses[1]["status"] == "running" and statuses[1]["stage"] == "preparing"
    stages = [s["stage"] for s in statuses[1:-1]]
    assert stages == sorted(stages, key=STAGES.index) and len(set(stages)) == len(stages)
    assert "answering" in stages
    assert events[-2].event == "status" and events[-2].json()["status"] == "succeeded"
    assert events[-1].event == "done"
    final = events[-1].json()["record"]
    assert final["status"] == "succeeded" and final["answer"] == "It is editing billing/invoice.py."
    assert "".join(m.json()["text"] for m in events if m.event == "delta") == final["answer"]
    assert any(m.event == "usage" for m in events)
    times = [parse_utc(m.json()["at"]) for m in events]
    assert times == sorted(times)


async def test_request_stream_resumes_exactly_after_last_event_id_or_after_and_the_header_wins(
    client: httpx.AsyncClient,
) -> None:
    record = await ask(client, new_parent())
    await wait_for(client, record["id"])
    path = f"/v1/questions/{record['id']}/events"
    _, full = await read_stream(client, path)  # opened after the end: replays and closes
    events = events_of(full)
    assert events[-1].event == "done"
    cut = len(events) // 2
    expected = [(m.id, m.event, m.data) for m in events[cut:]]
    last_id = events[cut - 1].id or ""

    _, by_header = await read_stream(client, path, headers={"Last-Event-ID": last_id})
    assert [(m.id, m.event, m.data) for m in events_of(by_header)] == expected
    _, by_query = await read_stream(client, path, params={"after": last_id})
    assert [(m.id, m.event, m.data) for m in events_of(by_query)] == expected
    _, both = await read_stream(client, path, headers={"Last-Event-ID": last_id}, params={"after": 1})
    assert [(m.id, m.event, m.data) for m in events_of(both)] == expected

    terminal = events[-1].id or ""
    assert (await read_stream(client, path, headers={"Last-Event-ID": terminal}))[0] == 204
    assert (await read_stream(client, path, params={"after": int(terminal) + 3}))[0] == 204
    assert (await read_stream(client, path, headers={"Last-Event-ID": terminal}, params={"after": 1}))[
        0
    ] == 204


async def test_live_request_stream_resumed_mid_request_has_no_gap_and_no_duplicate(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.text("one two three four", chunks=4, delay_between_s=0.1))
    record = await ask(client, new_parent())
    path = f"/v1/questions/{record['id']}/events"
    first: list[Message] = []
    async with client.stream("GET", path) as response:
        async for message in messages(response):
            if message.event is not None:
                first.append(message)
            if message.event == "status" and message.json().get("stage") == "answering":
                break  # the connection drops mid-request
    _, rest = await read_stream(client, path, headers={"Last-Event-ID": first[-1].id or ""})
    seqs = [int(m.id or 0) for m in first + events_of(rest)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert events_of(rest)[-1].event == "done"


async def test_session_stream_ids_are_global_event_ids_across_requests(client: httpx.AsyncClient) -> None:
    parent = new_parent()
    first = await ask(client, parent, "First?")
    second = await ask(client, parent, "Second?")
    await wait_for(client, second["id"])
    session_events = await session_events_until(client, parent, 2)
    ids = [int(m.id or 0) for m in session_events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    by_request: dict[str, list[Message]] = {}
    for message in session_events:
        by_request.setdefault(message.json()["request_id"], []).append(message)
    assert set(by_request) == {first["id"], second["id"]}
    for rid, own in by_request.items():
        _, stream = await read_stream(client, f"/v1/questions/{rid}/events")
        # Same events in the same order; the session stream's id is not the per-request seq.
        assert [(m.event, m.data) for m in own] == [(m.event, m.data) for m in events_of(stream)]
    assert by_request[second["id"]][0].json()["seq"] == 1
    assert int(by_request[second["id"]][0].id or 0) > int(by_request[first["id"]][0].id or 0) >= 1
    # Resuming the session stream with a global id continues exactly after it.
    resumed = await session_events_until(client, parent, 1, headers={"Last-Event-ID": str(ids[2])})
    assert [int(m.id or 0) for m in resumed] == ids[3 : 3 + len(resumed)]


# ------------------------------------------------------------------------------------ cancel, clear


async def test_cancel_queued_and_running_is_idempotent_and_ends_the_stream_with_cancelled(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    running = await hang_and_wait_running(client, scripted, parent)
    queued = await ask(client, parent, "Behind the hanging one.")
    assert (await client.get(f"/v1/questions/{queued['id']}")).json()["status"] == "queued"

    cancelled_queued = await client.post(f"/v1/questions/{queued['id']}/cancel")
    assert cancelled_queued.status_code == 200
    assert cancelled_queued.json()["status"] == "cancelled"
    assert cancelled_queued.json()["error"]["code"] == "cancelled"
    again = await client.post(f"/v1/questions/{queued['id']}/cancel")
    assert again.status_code == 200 and again.json() == cancelled_queued.json()

    live = asyncio.create_task(read_stream(client, f"/v1/questions/{running['id']}/events"))
    await asyncio.sleep(0.2)
    cancelled_running = await client.post(f"/v1/questions/{running['id']}/cancel")
    assert cancelled_running.status_code == 200 and cancelled_running.json()["status"] == "cancelled"
    status, stream = await live
    events = events_of(stream)
    assert status == 200
    assert events[-2].event == "status" and events[-2].json()["status"] == "cancelled"
    assert events[-1].event == "error" and events[-1].json()["code"] == "cancelled"
    settled = await wait_for(client, running["id"])
    assert settled["status"] == "cancelled"
    await asyncio.sleep(0.3)  # a worker that notices late must not change the terminal state
    later = (await client.get(f"/v1/questions/{running['id']}")).json()
    # …except usage: the answer call cut by the cancel is recorded when the worker stops it (SPEC 7:
    # cancelled calls count), which may land after the API's terminal write.
    assert {k: v for k, v in later.items() if k != "usage"} == {
        k: v for k, v in settled.items() if k != "usage"
    }
    assert all(call["status"] == "cancelled" for call in later["usage"]["calls"])
    for rid in (queued["id"], running["id"]):
        _, replay = await read_stream(client, f"/v1/questions/{rid}/events")
        assert events_of(replay)[-1].event == "error" and events_of(replay)[-1].json()["code"] == "cancelled"
        assert [m.event for m in events_of(replay)].count("error") == 1

    # A terminal request comes back unchanged.
    finished = await ask(client, parent, "Now an ordinary one.")
    done = await wait_for(client, finished["id"])
    assert done["status"] == "succeeded"
    unchanged = await client.post(f"/v1/questions/{finished['id']}/cancel")
    assert unchanged.status_code == 200 and unchanged.json() == done
    assert_error(await client.post(f"/v1/questions/{uuid.uuid4()}/cancel"), 404)


async def test_clear_cancels_deletes_history_bumps_clear_version_and_keeps_snapshots_and_ordinals(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    put = await client.put(f"/v1/sessions/{parent}/snapshots/s-1", json=SNAPSHOT)
    assert put.status_code == 201
    earlier = await ask(client, parent, "Before the clear?", snapshot_id="s-1")
    await wait_for(client, earlier["id"])
    running = await hang_and_wait_running(client, scripted, parent)
    queued = await ask(client, parent, "Queued behind it.")
    live = asyncio.create_task(read_stream(client, f"/v1/questions/{running['id']}/events"))
    await asyncio.sleep(0.2)

    cleared = await client.delete(f"/v1/sessions/{parent}/questions")
    assert cleared.status_code == 200
    _, stream = await live
    assert events_of(stream)[-1].event == "error" and events_of(stream)[-1].json()["code"] == "cancelled"

    session = (await client.get(f"/v1/sessions/{parent}")).json()
    assert session["clear_version"] == 1
    assert session["counts"] == {"queued": 0, "running": 0, "succeeded": 0, "failed": 0, "cancelled": 0}
    assert session["memory"] == {"qa_summary": None, "context_summaries": []}
    assert session["next_ordinal"] == 4
    page = (await client.get(f"/v1/sessions/{parent}/questions")).json()
    assert page == {"items": [], "has_more": False, "next_before": None}
    for rid in (earlier["id"], running["id"], queued["id"]):
        assert_error(await client.get(f"/v1/questions/{rid}"), 404)
        assert_error(await client.post(f"/v1/questions/{rid}/cancel"), 404)
        assert (await read_stream(client, f"/v1/questions/{rid}/events"))[0] == 404

    # Snapshots survive a clear; ordinals keep counting.
    after = await ask(client, parent, "After the clear?", snapshot_id="s-1")
    assert after["ordinal"] == 4
    done = await wait_for(client, after["id"])
    assert done["status"] == "succeeded", done["error"]
    assert (await client.put(f"/v1/sessions/{parent}/snapshots/s-1", json=SNAPSHOT)).status_code == 200
    assert_error(await client.delete(f"/v1/sessions/{new_parent()}/questions"), 404)


# ------------------------------------------------------------------------------------ snapshots, session


async def test_snapshots_are_immutable_and_inline_ones_are_stored_under_their_id_or_content_hash(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    path = f"/v1/sessions/{parent}/snapshots/s-7"
    assert (await client.put(path, json=SNAPSHOT)).status_code == 201
    assert (await client.put(path, json=SNAPSHOT)).status_code == 200
    other = {**SNAPSHOT, "system": "Another system prompt."}
    assert_error(await client.put(path, json=other), 409)

    named = await ask(client, parent, "Inline with an id?", snapshot={**other, "snapshot_id": "inline-1"})
    assert named["snapshot_id"] == "inline-1"
    hashed = await ask(client, parent, "Inline without an id?", snapshot=other)
    assert re.fullmatch(r"[0-9a-f]{64}", hashed["snapshot_id"] or ""), hashed["snapshot_id"]
    canonical = json.dumps(other, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    assert hashed["snapshot_id"] == hashlib.sha256(canonical.encode()).hexdigest()
    by_ref = await ask(client, parent, "By the stored id?", snapshot_id="inline-1")
    assert by_ref["snapshot_id"] == "inline-1"
    # The inline one is stored as if PUT: the same content under that id is accepted, other is not.
    assert (
        await client.put(f"/v1/sessions/{parent}/snapshots/{hashed['snapshot_id']}", json=other)
    ).status_code == 200
    assert_error(await client.put(f"/v1/sessions/{parent}/snapshots/inline-1", json=SNAPSHOT), 409)

    missing = await client.post(
        f"/v1/sessions/{parent}/questions", json={"question": "Unknown?", "snapshot_id": "nope"}
    )
    error = assert_error(missing, 404, "snapshot_missing")
    assert "nope" in error["message"]
    for record in (named, hashed, by_ref):
        assert (await wait_for(client, record["id"]))["status"] == "succeeded"
    assert len((await client.get(f"/v1/sessions/{parent}/questions")).json()["items"]) == 3


async def test_session_overview_has_counts_clear_version_next_ordinal_and_memory_shape(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    assert_error(await client.get(f"/v1/sessions/{parent}"), 404)
    # A small window forces compaction of the snapshot copy: a context summary lands in memory.
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    ok = await ask(client, parent, "What happened so far?", snapshot=big, context_window=32000)
    done = await wait_for(client, ok["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["context_info"]["context_summary"]["used"] is True
    scripted.script("answer", Step.server_error(500))
    failed = await ask(client, parent, "And now?")
    assert (await wait_for(client, failed["id"]))["status"] == "failed"

    session = (await client.get(f"/v1/sessions/{parent}")).json()
    assert {"parent_id", "clear_version", "next_ordinal", "counts", "memory"} <= set(session)
    assert session["parent_id"] == parent and session["clear_version"] == 0 and session["next_ordinal"] == 3
    assert session["counts"] == {"queued": 0, "running": 0, "succeeded": 1, "failed": 1, "cancelled": 0}
    memory = session["memory"]
    assert set(memory) >= {"qa_summary", "context_summaries"}
    assert memory["qa_summary"] is None or set(memory["qa_summary"]) >= {
        "covered_through_ordinal", "tokens", "updated_at"
    }  # fmt: skip
    assert len(memory["context_summaries"]) >= 1
    for entry in memory["context_summaries"]:
        assert set(entry) >= {"key", "snapshot_id", "covered_messages", "tokens", "created_at"}
        assert entry["snapshot_id"] == done["snapshot_id"]
        assert entry["covered_messages"] > 0 and entry["tokens"] > 0
        parse_utc(entry["created_at"])


def _long_transcript(turns: int) -> list[dict[str, Any]]:
    """A main transcript of ``turns`` user/assistant pairs, each a few hundred tokens."""
    out: list[dict[str, Any]] = []
    for n in range(turns):
        out.append({"role": "user", "content": f"Step {n}: " + "please look at the billing module. " * 20})
        out.append({"role": "assistant", "content": f"Done with step {n}. " + "Edited invoice totals. " * 20})
    return out


# ------------------------------------------------------------------------------------ archives


async def test_archive_exports_v1_v2_v3_and_restore_round_trips_apart_from_parent_and_time(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    # A long first answer that the second request folds into the rolling summary (small window), and
    # a big snapshot it compacts: the session's memory then has both kinds of summary to carry.
    scripted.script("answer", Step.text("A long earlier answer about invoices. " * 300))
    await wait_for(client, (await ask(client, parent, "First?", snapshot=SNAPSHOT))["id"])
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    second = await wait_for(
        client, (await ask(client, parent, "Second?", snapshot=big, context_window=20000))["id"]
    )
    assert second["status"] == "succeeded", second["error"]
    memory = (await client.get(f"/v1/sessions/{parent}")).json()["memory"]
    assert memory["qa_summary"] is not None and memory["context_summaries"]
    exported: dict[int, dict[str, Any]] = {}
    for version in (1, 2, 3):
        response = await client.get(f"/v1/sessions/{parent}/archive", params={"version": version})
        assert response.status_code == 200, response.text
        exported[version] = response.json()
        doc = exported[version]
        assert doc["version"] == version and doc["parent_id"] == parent
        assert [q["ordinal"] for q in doc["questions"]] == [1, 2]
        for item in doc["questions"]:
            assert {"ordinal", "question", "answer", "created_at"} <= set(item)
            assert "id" not in item and "request_id" not in item
            if version >= 2:
                assert {
                    "status",
                    "error",
                    "usage",
                    "model",
                    "started_at",
                    "finished_at",
                    "snapshot_id",
                } <= set(item)
            if version == 3:
                assert "context_info" in item
    assert exported[3]["session"]["memory"]["qa_summary"]
    assert len(exported[3]["session"]["memory"]["context_summaries"]) == len(memory["context_summaries"])
    assert_error(await client.get(f"/v1/sessions/{parent}/archive", params={"version": 4}), 422)

    def comparable(doc: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in doc.items() if k not in ("parent_id", "exported_at")}

    for version, doc in exported.items():
        copy = new_parent()
        restored = await client.post(f"/v1/sessions/{copy}/archive", json=doc)
        assert restored.status_code == 200, restored.text
        again = (await client.get(f"/v1/sessions/{copy}/archive", params={"version": version})).json()
        assert comparable(again) == comparable(doc), version
        assert_error(await client.post(f"/v1/sessions/{copy}/archive", json=doc), 409)
        replaced = await client.post(f"/v1/sessions/{copy}/archive", params={"mode": "replace"}, json=doc)
        assert replaced.status_code == 200, replaced.text
        again = (await client.get(f"/v1/sessions/{copy}/archive", params={"version": version})).json()
        assert comparable(again) == comparable(doc), version
        if version == 3:
            assert (await client.get(f"/v1/sessions/{copy}")).json()["memory"] == memory
    # A v1 archive restores as succeeded history.
    v1_copy = new_parent()
    assert (await client.post(f"/v1/sessions/{v1_copy}/archive", json=exported[1])).status_code == 200
    items = (await client.get(f"/v1/sessions/{v1_copy}/questions")).json()["items"]
    assert [(i["ordinal"], i["status"]) for i in items] == [(1, "succeeded"), (2, "succeeded")]


# ------------------------------------------------------------------------------------ operations


async def test_health_ready_and_metrics_need_no_token_and_carry_no_tenant_data(
    services: dict[str, Service], acme: httpx.AsyncClient
) -> None:
    parent = new_parent()
    record = await ask(acme, parent, "Tenant data must not leak into metrics.")
    await wait_for(acme, record["id"])
    async with _tenant_client(services, None) as anonymous:
        assert (await anonymous.get("/healthz")).status_code == 200
        assert (await anonymous.get("/readyz")).status_code == 200
        metrics = await anonymous.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        assert "sidequest_" in metrics.text
        for secret in ("acme", "globex", parent, "tok-a", "tok-g", record["id"]):
            assert secret not in metrics.text


async def test_openapi_lists_every_spec_route(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    listed = {
        (method, re.sub(r"\{[^}]+\}", "{}", path))
        for path, operations in document["paths"].items()
        for method in operations
    }
    assert SPEC_ROUTES <= listed, SPEC_ROUTES - listed


async def test_bad_input_gets_the_error_envelope_and_writes_nothing(client: httpx.AsyncClient) -> None:
    parent = new_parent()
    path = f"/v1/sessions/{parent}/questions"
    malformed = await client.post(
        path, content=b'{"question": ', headers={"Content-Type": "application/json"}
    )
    assert_error(malformed, 400)
    assert_error(await client.post(path, json={"question": 5}), 422)
    assert_error(await client.post(path, json={}), 422)
    assert_error(await client.post(path, json={"question": "x", "snapshot_id": 7}), 422)
    assert_error(await client.post(path, json={"question": "x", "snapshot": "not an object"}), 422)
    assert_error(await client.post(path, json=["question"]), 422)
    assert_error(await client.get(f"/v1/questions/{uuid.uuid4()}"), 404)
    assert_error(await client.get("/v1/questions/not-a-uuid"), 404)
    assert_error(
        await client.put(
            f"/v1/sessions/{parent}/snapshots/s", content=b"{", headers={"Content-Type": "application/json"}
        ),
        400,
    )
    assert_error(await client.get(f"/v1/sessions/{parent}"), 404)  # nothing was written


async def test_question_of_65536_utf8_bytes_is_accepted_and_65537_is_413(client: httpx.AsyncClient) -> None:
    parent = new_parent()
    path = f"/v1/sessions/{parent}/questions"
    at_limit = "é" * 32768  # 2 bytes each
    assert len(at_limit.encode()) == 65536
    accepted = await client.post(path, json={"question": at_limit})
    assert accepted.status_code == 202, accepted.text
    await client.post(f"/v1/questions/{accepted.json()['id']}/cancel")
    refused = await client.post(path, json={"question": at_limit + "a"})
    assert_error(refused, 413)
    items = (await client.get(path)).json()["items"]
    assert [i["ordinal"] for i in items] == [1]


async def test_the_21st_queued_request_of_a_session_gets_429(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    try:
        await hang_and_wait_running(client, scripted, parent)
        for n in range(20):
            await ask(client, parent, f"Queued {n}?")
        session = (await client.get(f"/v1/sessions/{parent}")).json()
        assert session["counts"]["running"] == 1 and session["counts"]["queued"] == 20
        refused = await client.post(f"/v1/sessions/{parent}/questions", json={"question": "One too many?"})
        assert_error(refused, 429)
        assert (await client.get(f"/v1/sessions/{parent}")).json()["next_ordinal"] == 22
        # Another session is not affected.
        elsewhere = await ask(client, new_parent(), "Elsewhere?")
    finally:
        assert (await client.delete(f"/v1/sessions/{parent}/questions")).status_code == 200
    assert (await wait_for(client, elsewhere["id"]))["status"] == "succeeded"


# ------------------------------------------------------------------------------------ auth, tokens


async def test_auth_requires_a_token_and_other_tenants_get_404_everywhere(
    services: dict[str, Service], acme: httpx.AsyncClient, globex: httpx.AsyncClient
) -> None:
    parent = new_parent()
    record = await ask(acme, parent, "Acme's question.")
    await wait_for(acme, record["id"])
    rid = record["id"]
    async with _tenant_client(services, None) as anonymous, _tenant_client(services, "wrong") as wrong:
        for http in (anonymous, wrong):
            assert_error(await http.get(f"/v1/questions/{rid}"), 401)
            assert_error(await http.post(f"/v1/sessions/{parent}/questions", json={"question": "x"}), 401)
            assert (await read_stream(http, f"/v1/questions/{rid}/events"))[0] == 401

    for response in (
        await globex.get(f"/v1/questions/{rid}"),
        await globex.post(f"/v1/questions/{rid}/cancel"),
        await globex.post(f"/v1/questions/{rid}/stream-token"),
        await globex.get(f"/v1/sessions/{parent}"),
        await globex.get(f"/v1/sessions/{parent}/questions"),
        await globex.delete(f"/v1/sessions/{parent}/questions"),
        await globex.get(f"/v1/sessions/{parent}/archive"),
        await globex.post(f"/v1/sessions/{parent}/stream-token"),
    ):
        assert_error(response, 404)
    assert (await read_stream(globex, f"/v1/questions/{rid}/events"))[0] == 404
    assert (await read_stream(globex, f"/v1/sessions/{parent}/events"))[0] == 404

    # The same parent id in another tenant is another session.
    theirs = await ask(globex, parent, "Globex's question.")
    assert theirs["ordinal"] == 1
    await wait_for(globex, theirs["id"])
    assert [
        i["question"] for i in (await globex.get(f"/v1/sessions/{parent}/questions")).json()["items"]
    ] == ["Globex's question."]
    assert [i["question"] for i in (await acme.get(f"/v1/sessions/{parent}/questions")).json()["items"]] == [
        "Acme's question."
    ]
    assert_error(await globex.get(f"/v1/questions/{rid}"), 404)
    assert (await acme.get(f"/v1/questions/{rid}")).json()["status"] == "succeeded"


async def test_stream_tokens_open_their_own_stream_only(
    services: dict[str, Service], acme: httpx.AsyncClient
) -> None:
    parent = new_parent()
    first = await ask(acme, parent, "First.")
    second = await ask(acme, parent, "Second.")
    await wait_for(acme, second["id"])
    issued = await acme.post(f"/v1/questions/{first['id']}/stream-token")
    assert issued.status_code == 200, issued.text
    body = issued.json()
    assert set(body) >= {"token", "expires_at", "url"}
    expires = parse_utc(body["expires_at"])
    assert timedelta(minutes=9) < expires - datetime.now(UTC) <= timedelta(minutes=10, seconds=5)
    assert body["url"].endswith(f"/v1/questions/{first['id']}/events?token={body['token']}")
    token = body["token"]
    async with _tenant_client(services, None) as browser:
        status, stream = await read_stream(browser, body["url"])
        assert status == 200 and events_of(stream)[-1].event == "done"
        assert events_of(stream)[0].json()["request_id"] == first["id"]
        other = await read_stream(browser, f"/v1/questions/{second['id']}/events", params={"token": token})
        assert other[0] == 401
        assert_error(await browser.get(f"/v1/questions/{first['id']}", params={"token": token}), 401)
        assert_error(await browser.get(f"/v1/sessions/{parent}/questions", params={"token": token}), 401)
        assert (await read_stream(browser, f"/v1/sessions/{parent}/events", params={"token": token}))[
            0
        ] == 401

        session_token = (await acme.post(f"/v1/sessions/{parent}/stream-token")).json()
        assert session_token["url"].endswith(f"/v1/sessions/{parent}/events?token={session_token['token']}")
        async with asyncio.timeout(10):
            async with browser.stream("GET", session_token["url"]) as response:
                assert response.status_code == 200
                async for message in messages(response):
                    if message.event is not None:
                        assert message.json()["request_id"] in (first["id"], second["id"])
                        break
        assert (
            await read_stream(
                browser, f"/v1/questions/{first['id']}/events", params={"token": session_token["token"]}
            )
        )[0] == 401


# ------------------------------------------------------------------------------------ model behaviour


async def test_max_output_tokens_outside_256_32768_is_422_and_inside_caps_the_answer(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    path = f"/v1/sessions/{parent}/questions"
    for bad in (255, 32769, 0, -1):
        assert_error(await client.post(path, json={"question": "x", "max_output_tokens": bad}), 422)
    cases = [
        ({"max_output_tokens": 256}, 256),
        ({"max_output_tokens": 32768}, 32000),  # the snapshot's own cap (main cap) is lower
        ({"max_output_tokens": 20000, "main_max_output_tokens": 4000}, 4000),
        ({}, 8192),  # SIDEQUEST_MAX_OUTPUT_TOKENS default
    ]
    for options, expected in cases:
        record = await ask(client, parent, "Capped?", snapshot=SNAPSHOT, **options)
        done = await wait_for(client, record["id"])
        assert done["status"] == "succeeded", done["error"]
        assert done["context_info"]["max_output_tokens"] == expected, options
        calls = [r for r in scripted.requests("answer") if r.request_id == record["id"]]
        assert calls[-1].body["max_tokens"] == expected


async def test_usage_reports_tokens_and_one_entry_per_provider_call(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script(
        "answer", Step.text("Cached.", usage=Usage(1500, 40, cached_tokens=1024, reasoning_tokens=7))
    )
    record = await ask(client, new_parent(), "How much did it cost?", snapshot=SNAPSHOT)
    done = await wait_for(client, record["id"])
    usage = done["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (1500, 40)
    assert (usage["cached_tokens"], usage["reasoning_tokens"]) == (1024, 7)
    assert len(usage["calls"]) == 1
    call = usage["calls"][0]
    assert CALL_FIELDS <= set(call)
    assert (call["purpose"], call["model"], call["status"], call["reported"]) == (
        "answer",
        "scripted-model",
        "ok",
        True,
    )
    assert (call["input_tokens"], call["output_tokens"], call["cached_tokens"], call["reasoning_tokens"]) == (
        1500, 40, 1024, 7
    )  # fmt: skip
    assert done["context_info"]["provider_prompt_tokens"] == 1500
    _, stream = await read_stream(client, f"/v1/questions/{record['id']}/events")
    usage_events = [m.json()["usage"] for m in events_of(stream) if m.event == "usage"]
    assert usage_events and usage_events[-1] == usage


async def test_answer_cut_by_its_output_cap_succeeds_truncated_with_stop_reason_length(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.truncated("The answer was cut", chunks=2))
    done = await wait_for(client, (await ask(client, new_parent()))["id"])
    assert done["status"] == "succeeded"
    assert (done["truncated"], done["stop_reason"], done["answer"]) == (True, "length", "The answer was cut")


async def test_provider_http_500_fails_with_provider_error_status_and_message(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.server_error(500))
    record = await ask(client, new_parent())
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "provider_error"
    assert done["error"]["detail"]["status"] == 500
    assert "server had an error" in done["error"]["detail"]["message"]
    calls = done["usage"]["calls"]
    assert len(calls) == 1 and calls[0]["status"] == "failed" and calls[0]["reported"] is False
    _, stream = await read_stream(client, f"/v1/questions/{record['id']}/events")
    events = events_of(stream)
    assert events[-2].json()["status"] == "failed"
    assert events[-1].event == "error" and events[-1].json()["code"] == "provider_error"
    assert events[-1].json()["detail"] == done["error"]["detail"]


@pytest.mark.parametrize(
    ("step", "code"),
    [
        (Step.model_not_found(), "model_unavailable"),
        (Step.tool_call("grep", arguments='{"pattern": "x"}'), "answer_tool_call"),
    ],
    ids=["model_not_found", "tool_call"],
)
async def test_answer_failures_get_their_spec_code(
    client: httpx.AsyncClient, scripted: ScriptedServer, step: Step, code: str
) -> None:
    scripted.script("answer", step)
    done = await wait_for(client, (await ask(client, new_parent(), snapshot=SNAPSHOT))["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == code, done["error"]


async def test_overflow_before_output_is_retried_once_after_shrinking(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    # A long earlier answer: replayed verbatim at first, folded into the (short) Q&A summary to shrink.
    scripted.script("answer", Step.text("A long earlier answer about invoices. " * 150))
    earlier = await ask(client, parent, "An earlier side question?", snapshot=SNAPSHOT)
    await wait_for(client, earlier["id"])
    scripted.script("answer", Step.overflow())
    record = await ask(client, parent, "Now it overflows?", snapshot=SNAPSHOT)
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    calls = [r for r in scripted.requests("answer") if r.request_id == record["id"]]
    assert len(calls) == 2
    assert done["context_info"]["overflow_retries"] == 1
    assert [c["status"] for c in done["usage"]["calls"] if c["purpose"] == "answer"] == ["failed", "ok"]
    # The replayed Q&A was folded into the rolling summary, which the session now shows.
    assert done["context_info"]["qa_summary"]["used"] is True
    memory = (await client.get(f"/v1/sessions/{parent}")).json()["memory"]
    assert memory["qa_summary"]["covered_through_ordinal"] == 1
    assert memory["qa_summary"]["tokens"] > 0
    parse_utc(memory["qa_summary"]["updated_at"])


async def test_overflow_that_cannot_shrink_fails_with_context_overflow_at_once(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.overflow(), Step.overflow())
    record = await ask(client, new_parent(), "Nothing to shrink?")
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "context_overflow", done["error"]
    assert len([r for r in scripted.requests("answer") if r.request_id == record["id"]]) == 1


async def test_every_provider_call_carries_purpose_and_request_id_headers(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    record = await ask(client, new_parent(), "Headers?", snapshot=big, context_window=32000)
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    calls = scripted.requests(path="/v1/chat/completions")
    assert calls
    assert {c.purpose for c in calls} >= {"answer", "context_summary"}
    for call in calls:
        assert call.purpose in ("answer", "qa_summary", "context_summary")
        assert call.request_id == record["id"]
    assert len(done["usage"]["calls"]) == len(calls)
    # One cumulative usage event per provider call; progress tells the chunks and the cache outcome.
    _, stream = await read_stream(client, f"/v1/questions/{record['id']}/events")
    usages = [m.json()["usage"] for m in events_of(stream) if m.event == "usage"]
    assert [len(u["calls"]) for u in usages] == list(range(1, len(calls) + 1))
    assert usages[-1] == done["usage"]
    progress = [m.json() for m in events_of(stream) if m.event == "progress"]
    assert any(p.get("what") == "summary_chunk" and p["stage"] == "compacting_context" for p in progress)
    assert any(p.get("what") == "context_summary_cache" and p.get("cache") == "miss" for p in progress)
    stages = [m.json()["stage"] for m in events_of(stream) if m.event == "status"][1:-1]
    assert stages == ["preparing", "organizing_history", "compacting_context", "answering"]


# ------------------------------------------------------------------------------------ the CLI


def _cli(*args: str, url: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDEQUEST_")}
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args, "--url", url],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )


async def test_cli_ask_prints_the_answer_and_exits_0_or_names_the_error_code_and_exits_nonzero(
    services: dict[str, Service], scripted: ScriptedServer, tmp_path: Path
) -> None:
    url = services["open"].url
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text(json.dumps(SNAPSHOT))
    parent = new_parent()
    scripted.script("answer", Step.text("The agent edits billing/invoice.py.", chunks=3))
    ok = await asyncio.to_thread(
        _cli, "ask", parent, "Which file?", "--snapshot", str(snapshot), url=url, cwd=tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    assert "The agent edits billing/invoice.py." in ok.stdout

    scripted.script("answer", Step.server_error(500))
    failed = await asyncio.to_thread(_cli, "ask", parent, "And now?", url=url, cwd=tmp_path)
    assert failed.returncode != 0
    assert "provider_error" in failed.stdout + failed.stderr

    missing = await asyncio.to_thread(
        _cli, "ask", parent, "Unknown snapshot?", "--snapshot-id", "nope", url=url, cwd=tmp_path
    )
    assert missing.returncode != 0 and "snapshot_missing" in missing.stderr


async def test_cli_archive_export_then_import_round_trips(
    services: dict[str, Service], client: httpx.AsyncClient, tmp_path: Path
) -> None:
    url = services["open"].url
    parent = new_parent()
    await wait_for(client, (await ask(client, parent, "Archived?"))["id"])
    archive = tmp_path / "archive.json"
    exported = await asyncio.to_thread(
        _cli, "archive", "export", parent, "--output", str(archive), url=url, cwd=tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    document = json.loads(archive.read_text())
    assert document["version"] == 3 and [q["question"] for q in document["questions"]] == ["Archived?"]
    copy = new_parent()
    imported = await asyncio.to_thread(
        _cli, "archive", "import", str(archive), "--parent-id", copy, url=url, cwd=tmp_path
    )
    assert imported.returncode == 0, imported.stderr
    again = (await client.get(f"/v1/sessions/{copy}/archive")).json()
    assert {k: v for k, v in again.items() if k not in ("parent_id", "exported_at")} == {
        k: v for k, v in document.items() if k not in ("parent_id", "exported_at")
    }
    refused = await asyncio.to_thread(
        _cli, "archive", "import", str(archive), "--parent-id", copy, url=url, cwd=tmp_path
    )
    assert refused.returncode != 0
    assert "session_has_history" in refused.stderr


# ------------------------------------------------------------------------------------ more of the contract


@pytest.mark.parametrize(
    ("finish", "expected"),
    [("stop", "stop"), ("content_filter", "content_filter"), ("end_of_world", "end_of_world")],
)
async def test_stop_reason_is_normalised_or_kept_as_the_provider_sent_it(
    client: httpx.AsyncClient, scripted: ScriptedServer, finish: str, expected: str
) -> None:
    scripted.script("answer", Step.text("Some text.", finish=finish))
    done = await wait_for(client, (await ask(client, new_parent()))["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["stop_reason"] == expected


async def test_rate_limits_are_retried_twice_then_rate_limited_and_quota_is_not_retried(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", *[Step.rate_limited(retry_after="0")] * 3)
    record = await ask(client, new_parent())
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed" and done["error"]["code"] == "rate_limited", done["error"]
    assert done["error"]["detail"]["status"] == 429 and done["error"]["detail"]["attempts"] == 3
    assert len([r for r in scripted.requests("answer") if r.request_id == record["id"]]) == 3
    assert [c["status"] for c in done["usage"]["calls"]] == ["failed"] * 3

    scripted.script("answer", Step.rate_limited(retry_after="0"), Step.text("Third time lucky."))
    recovered = await wait_for(client, (await ask(client, new_parent()))["id"])
    assert recovered["status"] == "succeeded" and recovered["answer"] == "Third time lucky."
    assert [c["status"] for c in recovered["usage"]["calls"]] == ["failed", "ok"]

    scripted.script("answer", Step.quota_exhausted())
    quota = await ask(client, new_parent())
    done = await wait_for(client, quota["id"])
    assert done["error"]["code"] == "rate_limited", done["error"]
    assert len([r for r in scripted.requests("answer") if r.request_id == quota["id"]]) == 1


async def test_window_comes_from_request_then_snapshot_and_sets_margin_and_input_budget(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    snapshot = dict(SNAPSHOT, context_window=100000)
    from_snapshot = await wait_for(client, (await ask(client, parent, snapshot=snapshot))["id"])
    info = from_snapshot["context_info"]
    assert (info["window"], info["safety_margin"], info["max_output_tokens"]) == (100000, 5000, 8192)
    assert info["input_budget"] == 100000 - 8192 - 5000
    from_request = await wait_for(
        client, (await ask(client, parent, snapshot=snapshot, context_window=150000))["id"]
    )
    assert from_request["context_info"]["window"] == 150000
    assert from_request["context_info"]["safety_margin"] == 7500


async def test_summary_call_failures_fail_the_request_with_their_code_and_detail(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    # Truncated twice (first attempt, then the one retry with the 8192 cap) → summary_truncated.
    scripted.script("context_summary", Step.truncated('{"objective": '), Step.truncated('{"objective": '))
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    record = await ask(client, new_parent(), "Compaction fails?", snapshot=big, context_window=32000)
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "summary_truncated", done["error"]
    assert done["error"]["detail"]["max_output_tokens"] == 8192
    assert done["error"]["detail"]["stop_reason"] == "length"
    caps = [
        r.body["max_tokens"] for r in scripted.requests("context_summary") if r.request_id == record["id"]
    ]
    assert caps == [2048, 8192]
    assert not scripted.requests("answer")


async def test_done_record_equals_the_stored_record_and_error_event_matches_record_error(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    ok = await ask(client, new_parent())
    final = await wait_for(client, ok["id"])
    _, stream = await read_stream(client, f"/v1/questions/{ok['id']}/events")
    assert events_of(stream)[-1].json()["record"] == final
    scripted.script("answer", Step.model_not_found())
    bad = await ask(client, new_parent())
    failed = await wait_for(client, bad["id"])
    _, stream = await read_stream(client, f"/v1/questions/{bad['id']}/events")
    error = events_of(stream)[-1].json()
    assert {k: error[k] for k in ("code", "message", "detail")} == {
        k: failed["error"][k] for k in ("code", "message", "detail")
    }


async def test_restore_into_a_cleared_session_needs_no_replace_and_ordinals_continue(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    source = new_parent()
    await wait_for(client, (await ask(client, source, "Kept?"))["id"])
    scripted.script("answer", Step.server_error(500))
    await wait_for(client, (await ask(client, source, "Failed?"))["id"])
    archive = (await client.get(f"/v1/sessions/{source}/archive", params={"version": 3})).json()
    assert [q["status"] for q in archive["questions"]] == ["succeeded", "failed"]

    target = new_parent()
    await wait_for(client, (await ask(client, target, "To be cleared."))["id"])
    assert (await client.delete(f"/v1/sessions/{target}/questions")).status_code == 200
    restored = await client.post(f"/v1/sessions/{target}/archive", json=archive)
    assert restored.status_code == 200, restored.text
    again = (await client.get(f"/v1/sessions/{target}/archive", params={"version": 3})).json()
    strip = ("parent_id", "exported_at")
    assert {k: v for k, v in again.items() if k not in strip} == {
        k: v for k, v in archive.items() if k not in strip
    }
    after = await ask(client, target, "After the restore?")
    assert after["ordinal"] == 3
    await wait_for(client, after["id"])

    # A v3 archive without the newer fields restores, with empty objects in their place.
    bare = {
        "version": 3,
        "parent_id": "anything",
        "questions": [
            {"ordinal": 1, "question": "Old?", "answer": "Yes.", "created_at": "2026-11-29T10:00:00.000000Z"}
        ],
    }
    empty = new_parent()
    response = await client.post(f"/v1/sessions/{empty}/archive", json=bare)
    assert response.status_code == 200, response.text
    items = (await client.get(f"/v1/sessions/{empty}/questions")).json()["items"]
    assert [(i["ordinal"], i["answer"]) for i in items] == [(1, "Yes.")]
    assert items[0]["context_info"] == {}


async def test_stream_edges_unknown_ids_bad_cursor_and_no_cors_by_default(client: httpx.AsyncClient) -> None:
    assert_error(await client.get(f"/v1/questions/{uuid.uuid4()}/events"), 404)
    assert_error(await client.get(f"/v1/sessions/{new_parent()}/events"), 404)
    record = await ask(client, new_parent())
    await wait_for(client, record["id"])
    assert_error(
        await client.get(f"/v1/questions/{record['id']}/events", headers={"Last-Event-ID": "abc"}), 400
    )
    assert_error(await client.get(f"/v1/questions/{record['id']}/events", params={"after": -1}), 422)
    cors = await client.get(f"/v1/questions/{record['id']}", headers={"Origin": "https://example.com"})
    assert not any(h.lower().startswith("access-control-") for h in cors.headers)
    assert_error(await client.patch(f"/v1/questions/{record['id']}"), 405)


async def test_stream_tokens_never_appear_in_the_server_log(
    services: dict[str, Service], acme: httpx.AsyncClient
) -> None:
    record = await ask(acme, new_parent())
    await wait_for(acme, record["id"])
    issued = (await acme.post(f"/v1/questions/{record['id']}/stream-token")).json()
    async with _tenant_client(services, None) as browser:
        assert (await read_stream(browser, issued["url"]))[0] == 200
        assert (
            await read_stream(
                browser, f"/v1/questions/{uuid.uuid4()}/events", params={"token": issued["token"]}
            )
        )[0] in (401, 404)
    await asyncio.sleep(0.2)
    assert issued["token"] not in services["auth"].log.read_text()


async def test_inline_snapshot_with_a_taken_id_and_other_content_is_409_and_writes_nothing(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    assert (await client.put(f"/v1/sessions/{parent}/snapshots/s-1", json=SNAPSHOT)).status_code == 201
    other = {**SNAPSHOT, "system": "Changed.", "snapshot_id": "s-1"}
    refused = await client.post(f"/v1/sessions/{parent}/questions", json={"question": "x", "snapshot": other})
    assert_error(refused, 409)
    assert (await client.get(f"/v1/sessions/{parent}")).json()["next_ordinal"] == 1


async def test_a_cancelled_running_call_is_recorded_in_usage(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    running = await hang_and_wait_running(client, scripted, new_parent())
    assert (await client.post(f"/v1/questions/{running['id']}/cancel")).status_code == 200
    deadline = time.monotonic() + 5
    while True:
        record = (await client.get(f"/v1/questions/{running['id']}")).json()
        calls = record["usage"]["calls"]
        if calls or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert record["status"] == "cancelled"
    assert [(c["purpose"], c["status"], c["reported"]) for c in calls] == [("answer", "cancelled", False)]


async def test_max_concurrency_is_shared_by_both_processes(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parents = [new_parent() for _ in range(6)]
    scripted.script("answer", *[Step.hang()] * 6)
    records = [await ask(client, parent, "Hang.") for parent in parents]
    try:
        deadline = time.monotonic() + 10
        while len(scripted.requests("answer")) < 4:
            assert time.monotonic() < deadline, "fewer than 4 requests started"
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # both workers poll every 0.2 s: time enough to over-claim
        statuses = [(await client.get(f"/v1/questions/{r['id']}")).json()["status"] for r in records]
        assert statuses.count("running") == 4 and statuses.count("queued") == 2, statuses
        assert len(scripted.requests("answer")) == 4
    finally:
        for parent in parents:
            await client.delete(f"/v1/sessions/{parent}/questions")


async def test_context_summaries_are_cached_by_content_hit_prefix_and_miss(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    base = dict(SNAPSHOT, messages=_long_transcript(60), context_window=32000)
    extended = dict(base, messages=_long_transcript(64))
    changed = dict(
        base, messages=[{"role": "user", "content": "A different beginning."}, *_long_transcript(60)[1:]]
    )
    for snapshot_id, content in (("base", base), ("extended", extended), ("changed", changed)):
        assert (
            await client.put(f"/v1/sessions/{parent}/snapshots/{snapshot_id}", json=content)
        ).status_code == 201

    async def run(snapshot_id: str) -> tuple[dict[str, Any], int]:
        record = await ask(client, parent, f"About {snapshot_id}?", snapshot_id=snapshot_id)
        done = await wait_for(client, record["id"])
        assert done["status"] == "succeeded", done["error"]
        calls = [r for r in scripted.requests("context_summary") if r.request_id == record["id"]]
        return done["context_info"]["context_summary"], len(calls)

    first, first_calls = await run("base")
    assert first["used"] is True and first["cache"] == "miss" and first_calls >= 1
    again, again_calls = await run("base")
    assert again["cache"] == "hit" and again_calls == 0
    longer, _ = await run("extended")
    assert longer["cache"] in ("prefix", "hit")
    other, other_calls = await run("changed")
    assert other["cache"] == "miss" and other_calls >= 1
    keys = [
        e["key"] for e in (await client.get(f"/v1/sessions/{parent}")).json()["memory"]["context_summaries"]
    ]
    assert len(keys) == len(set(keys)) >= 2


async def test_deltas_are_coalesced_to_about_20_per_second(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    text = "".join(f"w{n} " for n in range(80))
    scripted.script("answer", Step.text(text, chunks=80, delay_between_s=0.01))
    record = await ask(client, new_parent())
    started = time.monotonic()
    _, stream = await read_stream(client, f"/v1/questions/{record['id']}/events")
    elapsed = time.monotonic() - started
    deltas = [m.json()["text"] for m in events_of(stream) if m.event == "delta"]
    assert "".join(deltas) == text
    assert len(deltas) <= elapsed * 20 + 2, (len(deltas), elapsed)


async def test_at_most_20_groups_are_replayed_and_older_ones_fold_into_the_rolling_summary(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    # 1 running + 20 queued is within the limit; they run one at a time, in ordinal order.
    records = [await ask(client, parent, f"Earlier question {n}?") for n in range(1, 22)]
    for record in records:
        assert (await wait_for(client, record["id"], within_s=30))["status"] == "succeeded"
    last = await ask(client, parent, "And the 22nd?")
    done = await wait_for(client, last["id"])
    assert done["status"] == "succeeded", done["error"]
    info = done["context_info"]
    assert info["replayed_groups"] == 20 and info["replayed_ordinals"] == [2, 21]
    assert info["qa_summary"]["used"] is True and info["qa_summary"]["covered_through_ordinal"] == 1
    assert [r for r in scripted.requests("qa_summary") if r.request_id == last["id"]]
    orders = [(await client.get(f"/v1/questions/{r['id']}")).json()["started_at"] for r in records]
    assert orders == sorted(orders)


def _serve_refuses(env_extra: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDEQUEST_")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )


async def test_serve_refuses_an_out_of_range_output_cap_and_a_public_bind_without_tokens(
    database_url: str, tmp_path: Path
) -> None:
    for value, bound in (("255", "256"), ("32769", "32768")):
        refused = await asyncio.to_thread(
            _serve_refuses,
            {"SIDEQUEST_DATABASE_URL": database_url, "SIDEQUEST_MAX_OUTPUT_TOKENS": value},
            "--port",
            str(_free_port()),
            cwd=tmp_path,
        )
        assert refused.returncode != 0
        assert "SIDEQUEST_MAX_OUTPUT_TOKENS" in refused.stderr and bound in refused.stderr
    public = await asyncio.to_thread(
        _serve_refuses,
        {"SIDEQUEST_DATABASE_URL": database_url},
        "--host",
        "0.0.0.0",
        "--port",
        str(_free_port()),
        cwd=tmp_path,
    )
    assert public.returncode != 0 and "SIDEQUEST_API_TOKENS" in public.stderr
    assert not (tmp_path / ".sidequest").exists()


async def test_every_error_status_uses_the_envelope(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/no-such-route"), 404)
    assert_error(await client.get(f"/v1/sessions/{'p' * 501}"), 422)
    too_long_key = {"Idempotency-Key": "k" * 301}
    assert_error(
        await client.post(
            f"/v1/sessions/{new_parent()}/questions", json={"question": "x"}, headers=too_long_key
        ),
        422,
    )
    assert_error(
        await client.post(
            f"/v1/sessions/{new_parent()}/archive",
            content=b"nope",
            headers={"Content-Type": "application/json"},
        ),
        400,
    )
    assert_error(
        await client.post(f"/v1/sessions/{new_parent()}/archive", json={"version": 9, "questions": []}), 400
    )


# ------------------------------------------------------------------------------------ isolated services
# Settings that would disturb the shared services (a short deadline, a summary-call cap, another
# provider, a killed process) get their own database, scripted server and process, so that no other
# worker claims their requests.


@dataclass
class Isolated:
    """A fresh database and scripted server; ``start`` runs ``sidequest serve`` on them."""

    database_url: str
    scripted: ScriptedServer
    folder: Path
    started: list[Service]

    def launch(self, command: str = "serve", **env: str) -> Service:
        """Start ``sidequest <command>`` without waiting for it."""
        log = self.folder / f"isolated-{len(self.started)}-{command}.log"
        service = _start(_environment(self.database_url, self.scripted, **env), log, command)
        self.started.append(service)
        return service

    def start(self, command: str = "serve", **env: str) -> Service:
        """Start ``sidequest <command>`` and wait until it is ready (a worker has no /readyz)."""
        service = self.launch(command, **env)
        if command != "worker":
            _wait_ready(service)
        return service


@contextmanager
def _isolated(admin_url: str, folder: Path) -> Iterator[Isolated]:
    from tests import pg

    url = asyncio.run(pg.create_database(admin_url))  # empty: serve migrates it itself
    try:
        with ScriptedServer() as server:
            box = Isolated(url, server, folder, [])
            try:
                yield box
            finally:
                for service in box.started:
                    _stop(service)
    finally:
        asyncio.run(pg.drop_database(admin_url, url))


@dataclass
class Limited:
    """One process with the Anthropic provider, a 1.5 s deadline, one summary call per request, CORS
    for two origins and 1 s leases (the crash test replaces the process by a new one)."""

    box: Isolated
    service: Service

    @property
    def scripted(self) -> ScriptedServer:
        return self.box.scripted

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.service.url, timeout=10)


def limited_env(scripted: ScriptedServer) -> dict[str, str]:
    return {
        "SIDEQUEST_PROVIDER": "anthropic",
        "SIDEQUEST_BASE_URL": scripted.root_url,
        "SIDEQUEST_REQUEST_TIMEOUT_S": "1.5",
        "SIDEQUEST_MAX_SUMMARY_CALLS": "1",
        "SIDEQUEST_CORS_ORIGINS": "https://app.example,https://other.example",
        # Short leases, so that a killed process's request is taken over within a second.
        "SIDEQUEST_LEASE_S": "1",
        "SIDEQUEST_HEARTBEAT_S": "0.2",
    }


@pytest.fixture(scope="module")
def _limited_box(pg_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Isolated]:
    with _isolated(pg_server.admin_url, tmp_path_factory.mktemp("limited")) as box:
        yield box


@pytest.fixture(scope="module")
def _limited_service(services: dict[str, Service], _limited_box: Isolated) -> Limited:
    return Limited(_limited_box, services["limited"])


@pytest.fixture
def limited(_limited_service: Limited) -> Limited:
    _limited_service.scripted.reset()
    return _limited_service


async def test_a_request_past_its_deadline_fails_with_timeout_and_its_stage(limited: Limited) -> None:
    limited.scripted.script("answer", Step.hang())
    async with limited.client() as http:
        record = await ask(http, new_parent())
        done = await wait_for(http, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "timeout", done["error"]
    assert done["error"]["detail"]["timeout_s"] == 1.5
    assert done["error"]["detail"]["stage"] == "answering"


async def test_a_summary_plan_beyond_the_call_cap_fails_before_spending_calls(limited: Limited) -> None:
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    async with limited.client() as http:
        record = await ask(http, new_parent(), "Too many chunks?", snapshot=big, context_window=24000)
        done = await wait_for(http, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "summary_call_cap", done["error"]
    detail = done["error"]["detail"]
    assert detail["calls_made"] == 0 and detail["calls_needed"] > 1
    assert not limited.scripted.requests("context_summary")
    assert not limited.scripted.requests("answer")


async def test_anthropic_provider_counts_cached_input_and_normalises_stop_reasons(limited: Limited) -> None:
    limited.scripted.script(
        "answer",
        Step.text("Cached.", usage=Usage(1500, 40, cached_tokens=1024, cache_creation_tokens=100)),
        Step.truncated("Cut", usage=Usage(200, 10)),
    )
    async with limited.client() as http:
        parent = new_parent()
        cached = await wait_for(http, (await ask(http, parent, snapshot=SNAPSHOT))["id"])
        cut = await wait_for(http, (await ask(http, parent))["id"])
    assert cached["status"] == "succeeded", cached["error"]
    assert (cached["usage"]["input_tokens"], cached["usage"]["cached_tokens"]) == (1500, 1024)
    assert cached["usage"]["output_tokens"] == 40
    assert cached["stop_reason"] == "stop"
    assert (cut["status"], cut["truncated"], cut["stop_reason"]) == ("succeeded", True, "length")
    calls = limited.scripted.requests(path="/v1/messages")
    assert calls and all(
        c.purpose in ("answer", "qa_summary", "context_summary") and c.request_id for c in calls
    )


async def test_cors_answers_configured_origins_only(limited: Limited) -> None:
    async with limited.client() as http:
        preflight = await http.options(
            f"/v1/sessions/{new_parent()}/questions",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type,idempotency-key",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        allowed = await http.get("/healthz", headers={"Origin": "https://other.example"})
        assert allowed.headers["access-control-allow-origin"] == "https://other.example"
        foreign = await http.get("/healthz", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in foreign.headers


async def test_a_killed_process_loses_nothing_and_separate_api_and_worker_processes_take_over(
    limited: Limited,
) -> None:
    parent = new_parent()
    async with limited.client() as http:
        running = await hang_and_wait_running(http, limited.scripted, parent)
        queued = await ask(http, parent, "Admitted before the crash.")
    limited.service.proc.kill()
    limited.service.proc.wait(10)
    # Restart as the two halves: the worker reruns the request, the API streams what it wrote.
    env = limited_env(limited.scripted)
    worker = limited.box.start("worker", **env)
    limited.service = await asyncio.to_thread(limited.box.start, "api", **env)
    async with limited.client() as http:
        rerun = await wait_for(http, running["id"])
        after = await wait_for(http, queued["id"])
        _, stream = await read_stream(http, f"/v1/questions/{running['id']}/events")
    assert worker.proc.poll() is None
    assert rerun["status"] == "succeeded", rerun["error"]
    assert rerun["attempt"] == 2
    assert after["status"] == "succeeded" and after["ordinal"] == 2
    statuses = [m.json() for m in events_of(stream) if m.event == "status"]
    assert [s.get("stage") for s in statuses if s["status"] == "running"].count("preparing") == 2
    assert events_of(stream)[-1].event == "done"


_LONG_SUMMARY = {
    "objective": "o",
    "state": "s",
    "decisions": ["A decision that goes on and on. " * 60] * 32,
    "open_work": [],
    "risks": [],
}


@pytest.mark.parametrize(
    ("steps", "code"),
    [
        ((Step.tool_call("grep"),), "summary_tool_call"),
        ((Step.empty(), Step.reasoning_only("thinking")), "summary_empty"),
        ((Step.invalid_summary(), Step.invalid_summary()), "summary_invalid"),
        ((Step.valid_summary(_LONG_SUMMARY), Step.valid_summary(_LONG_SUMMARY)), "summary_too_long"),
        ((Step.server_error(500),), "provider_error"),
    ],
    ids=["tool_call", "empty", "invalid", "too_long", "provider_error"],
)
async def test_a_failing_context_summary_fails_the_request_with_its_code(
    client: httpx.AsyncClient, scripted: ScriptedServer, steps: tuple[Step, ...], code: str
) -> None:
    scripted.script("context_summary", *steps)
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    record = await ask(client, new_parent(), "Compaction fails?", snapshot=big, context_window=32000)
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == code, done["error"]
    calls = [r for r in scripted.requests("context_summary") if r.request_id == record["id"]]
    assert len(calls) == len(steps)  # a tool call or provider error fails at once; others retry once
    if code == "summary_too_long":
        assert done["error"]["detail"]["limit"] == 2200 and done["error"]["detail"]["body_tokens"] > 2200
    assert not [r for r in scripted.requests("answer") if r.request_id == record["id"]]
    memory = (await client.get(f"/v1/sessions/{record['parent_id']}")).json()["memory"]
    assert memory["context_summaries"] == []  # nothing unvalidated is cached


async def test_an_invalid_summary_is_retried_once_with_the_larger_cap_and_then_used(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("context_summary", Step.invalid_summary(), Step.valid_summary())
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    record = await ask(client, new_parent(), "Retried?", snapshot=big, context_window=32000)
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    caps = [
        r.body["max_tokens"] for r in scripted.requests("context_summary") if r.request_id == record["id"]
    ]
    assert caps[:2] == [2048, 8192]
    assert done["context_info"]["summary_calls"] == len(caps)
    # Compacted layout: system, the context summary, then the kept messages unchanged, then the question.
    kept = done["context_info"]["context_summary"]["kept_messages"]
    assert kept > 0
    body = [r for r in scripted.requests("answer") if r.request_id == record["id"]][-1].body
    sent = body["messages"]
    assert sent[0] == {"role": "system", "content": SNAPSHOT["system"]}
    assert [m["content"] for m in sent[-1 - kept : -1]] == [m["content"] for m in big["messages"][-kept:]]
    assert record["question"] in json.dumps(sent[-1])


async def test_replayed_qa_is_capped_at_a_quarter_of_the_input_budget(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    scripted.set_default(
        "answer", Step.text("A long earlier answer about invoices. " * 80, usage=Usage(100, 900))
    )
    for n in range(4):
        await wait_for(client, (await ask(client, parent, f"Earlier {n}?"))["id"])
    scripted.reset()
    done = await wait_for(client, (await ask(client, parent, "Now?", context_window=20000))["id"])
    assert done["status"] == "succeeded", done["error"]
    info = done["context_info"]
    limit = min(info["input_budget"] // 4, 16000)
    assert info["estimate"]["qa_raw"] <= limit
    assert 1 <= info["replayed_groups"] < 4
    assert info["qa_summary"]["used"] is True
    assert info["qa_summary"]["covered_through_ordinal"] == 4 - info["replayed_groups"]


async def test_concurrent_admissions_while_workers_finish_get_distinct_ordinals_and_never_a_500(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    path = f"/v1/sessions/{parent}/questions"
    responses: list[httpx.Response] = []
    for wave in range(3):  # later waves race the worker finishing (and appending events to) earlier ones
        responses += await asyncio.gather(
            *(client.post(path, json={"question": f"Wave {wave} #{n}?"}) for n in range(6))
        )
        await asyncio.sleep(0.15)
    assert [r.status_code for r in responses] == [202] * 18, [
        r.text for r in responses if r.status_code != 202
    ]
    assert sorted(r.json()["ordinal"] for r in responses) == list(range(1, 19))
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    same = await asyncio.gather(
        *(client.post(path, json={"question": "Once?"}, headers=key) for _ in range(5))
    )
    assert sorted(r.status_code for r in same) == [200, 200, 200, 200, 202]
    assert len({r.json()["id"] for r in same}) == 1
    for response in [*responses, same[0]]:
        assert (await wait_for(client, response.json()["id"], within_s=30))["status"] == "succeeded"


async def test_a_requested_model_is_used_for_the_call_and_recorded(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    record = await ask(client, new_parent(), "Which model?", model="other-model")
    assert record["model"] == "other-model"
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["model"] == "other-model"
    assert [c["model"] for c in done["usage"]["calls"]] == ["other-model"]
    assert [r.body["model"] for r in scripted.requests("answer") if r.request_id == record["id"]] == [
        "other-model"
    ]


async def test_a_stream_token_is_not_a_bearer_token_and_archive_export_defaults_to_v3(
    services: dict[str, Service], acme: httpx.AsyncClient
) -> None:
    parent = new_parent()
    record = await ask(acme, parent)
    await wait_for(acme, record["id"])
    token = (await acme.post(f"/v1/questions/{record['id']}/stream-token")).json()["token"]
    async with _tenant_client(services, token) as holder:
        assert (await read_stream(holder, f"/v1/questions/{record['id']}/events"))[0] == 401
        assert_error(await holder.get(f"/v1/questions/{record['id']}"), 401)
    exported = (await acme.get(f"/v1/sessions/{parent}/archive")).json()
    assert exported["version"] == 3 and "session" in exported
    assert_error(await acme.get(f"/v1/sessions/{new_parent()}/archive"), 404)


async def test_a_snapshot_over_32_mib_is_413(client: httpx.AsyncClient) -> None:
    parent = new_parent()
    base = {"system": "s", "messages": [{"role": "user", "content": ""}]}
    overhead = len(json.dumps(base, separators=(",", ":")).encode())
    over = dict(base, messages=[{"role": "user", "content": "x" * (32 * 1024 * 1024 - overhead + 1)}])
    body = json.dumps(over, separators=(",", ":")).encode()
    assert len(body) == 32 * 1024 * 1024 + 1
    headers = {"Content-Type": "application/json"}
    assert_error(await client.put(f"/v1/sessions/{parent}/snapshots/big", content=body, headers=headers), 413)
    assert_error(await client.get(f"/v1/sessions/{parent}"), 404)  # nothing written


_TPM_TOO_LARGE = {
    "error": {
        "message": "Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, "
        "Requested 45000. The input or output tokens must be reduced in order to run successfully.",
        "type": "tokens",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}
_MAX_TOKENS_CAP = {
    "error": {
        "message": "max_tokens is too large: 50000. This model supports at most 16384 completion tokens, "
        "whereas you provided 50000.",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": None,
    }
}
_OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}


@pytest.mark.parametrize(
    ("steps", "code", "calls"),
    [
        ([Step.rate_limited(status=413, body=_TPM_TOO_LARGE, retry_after="0")] * 3, "rate_limited", 3),
        ([Step.rate_limited(status=529, body=_OVERLOADED, retry_after="0")] * 3, "rate_limited", 3),
        ([Step.http_error(400, _MAX_TOKENS_CAP)], "provider_error", 1),
        ([Step.http_error(400, {"error": {"message": "The model `x` does not exist"}})],
         "model_unavailable", 1),
    ],
    ids=["413_tpm_is_a_rate_limit", "529_is_a_rate_limit", "max_tokens_cap_is_a_provider_error", "model_400"],
)  # fmt: skip
async def test_overflow_look_alikes_are_classified_as_spec_says(
    client: httpx.AsyncClient, scripted: ScriptedServer, steps: list[Step], code: str, calls: int
) -> None:
    scripted.script("answer", *steps)
    record = await ask(client, new_parent(), snapshot=SNAPSHOT)
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == code, done["error"]
    assert len([r for r in scripted.requests("answer") if r.request_id == record["id"]]) == calls
    assert done["context_info"]["overflow_retries"] == 0


async def test_openai_style_snapshots_are_accepted_and_sent_with_their_tools_and_tool_choice_none(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    snapshot = {
        "system": "You are a coding agent.",
        "tools": [{"name": "grep", "description": "Search.", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Find the bug."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "billing/invoice.py:12"},
        ],
    }
    record = await ask(client, new_parent(), "Where?", snapshot=snapshot)
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    body = next(r.body for r in scripted.requests("answer") if r.request_id == record["id"])
    assert body["tool_choice"] == "none"
    assert [t["function"]["name"] for t in body["tools"]] == ["grep"]
    sent = body["messages"]
    assert sent[0] == {"role": "system", "content": "You are a coding agent."}
    assert sent[2]["tool_calls"][0]["id"] == "c1"
    assert sent[3] == {"role": "tool", "tool_call_id": "c1", "content": "billing/invoice.py:12"}
    assert sent[-1]["role"] == "user" and "Where?" in json.dumps(sent[-1])

    plain = await ask(client, new_parent(), "No snapshot at all?")
    assert (await wait_for(client, plain["id"]))["status"] == "succeeded"
    plain_body = next(r.body for r in scripted.requests("answer") if r.request_id == plain["id"])
    assert "tools" not in plain_body


async def test_an_overflow_inside_the_stream_is_retried_but_a_partial_reply_never_is(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    scripted.script("answer", Step.text("A long earlier answer about invoices. " * 150))
    await wait_for(client, (await ask(client, parent, "Earlier?", snapshot=SNAPSHOT))["id"])

    scripted.script("answer", Step.overflow_in_stream())
    retried = await ask(client, parent, "Overflow in the stream?", snapshot=SNAPSHOT)
    done = await wait_for(client, retried["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["context_info"]["overflow_retries"] == 1
    assert len([r for r in scripted.requests("answer") if r.request_id == retried["id"]]) == 2

    for step in (
        Step.error_after_partial("Half an ans", error=STREAM_SERVER_ERROR),
        Step.error_after_partial("Half"),
    ):
        scripted.script("answer", step)
        broken = await ask(client, new_parent(), "Breaks midway?")
        failed = await wait_for(client, broken["id"])
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "provider_error", failed["error"]
        assert len([r for r in scripted.requests("answer") if r.request_id == broken["id"]]) == 1
    scripted.script("answer", Step.error_after_partial("Half", error=STREAM_OVERFLOW_ERROR))
    partial = await ask(client, new_parent(), "Overflow after some text?")
    failed = await wait_for(client, partial["id"])
    assert failed["status"] == "failed" and failed["context_info"]["overflow_retries"] == 0
    assert len([r for r in scripted.requests("answer") if r.request_id == partial["id"]]) == 1


async def test_a_freed_slot_goes_to_the_session_that_never_ran_before_an_older_queued_one(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    ran_before, never_ran = new_parent(), new_parent()
    await wait_for(client, (await ask(client, ran_before, "Runs first."))["id"])
    blockers = [new_parent() for _ in range(4)]
    scripted.script("answer", *[Step.hang()] * 5)
    try:
        hanging = [await ask(client, parent, "Holds a slot.") for parent in blockers]
        deadline = time.monotonic() + 10
        while len(scripted.requests("answer")) < 4:
            assert time.monotonic() < deadline, "the 4 slots did not fill"
            await asyncio.sleep(0.02)
        older = await ask(client, ran_before, "Queued first, but its session ran before.")
        newer = await ask(client, never_ran, "Queued second, in a session that never ran.")
        await asyncio.sleep(0.3)
        assert (await client.get(f"/v1/questions/{older['id']}")).json()["status"] == "queued"
        await client.post(f"/v1/questions/{hanging[0]['id']}/cancel")
        assert (await wait_for(client, newer["id"], ("running", *TERMINAL)))["status"] == "running"
        await asyncio.sleep(0.3)
        assert (await client.get(f"/v1/questions/{older['id']}")).json()["status"] == "queued"
    finally:
        for parent in (*blockers, ran_before, never_ran):
            await client.delete(f"/v1/sessions/{parent}/questions")


async def test_path_ids_may_hold_spaces_unicode_percent_and_question_marks(client: httpx.AsyncClient) -> None:
    suffix = uuid.uuid4().hex[:8]
    for parent in (f"task 7 {suffix}", f"タスク-{suffix}", f"a%b-{suffix}", f"x?y#z-{suffix}"):
        encoded = quote(parent, safe="")
        record = (await client.post(f"/v1/sessions/{encoded}/questions", json={"question": "q"})).json()
        assert record["parent_id"] == parent
        assert (await client.get(f"/v1/sessions/{encoded}")).json()["parent_id"] == parent
        put = await client.put(f"/v1/sessions/{encoded}/snapshots/{encoded}", json=SNAPSHOT)
        assert put.status_code == 201 and put.json()["snapshot_id"] == parent
        await wait_for(client, record["id"])
    # docs/api.md, Decisions: a '/' cannot be part of an id, even percent-encoded.
    assert_error(await client.post("/v1/sessions/org%2Ftask/questions", json={"question": "q"}), 404)


async def test_usage_the_provider_did_not_report_is_zero_and_reported_false(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.text("No usage sent."))
    done = await wait_for(client, (await ask(client, new_parent(), snapshot=SNAPSHOT))["id"])
    assert done["status"] == "succeeded", done["error"]
    (call,) = done["usage"]["calls"]
    assert (call["status"], call["reported"]) == ("ok", False)
    assert [call[k] for k in ("input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens")] == [
        0
    ] * 4
    assert done["usage"]["input_tokens"] == 0 and done["usage"]["output_tokens"] == 0
    assert done["context_info"]["provider_prompt_tokens"] is None
    assert done["context_info"]["estimate"]["total"] > 0  # the estimate stands on its own


async def test_a_session_stream_opened_before_any_question_tails_new_requests_live(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    assert (await client.put(f"/v1/sessions/{parent}/snapshots/s-1", json=SNAPSHOT)).status_code == 201
    live = asyncio.create_task(session_events_until(client, parent, 2))
    await asyncio.sleep(0.3)
    first = await ask(client, parent, "Live one?", snapshot_id="s-1")
    second = await ask(client, parent, "Live two?")
    events = await live
    assert [m.json()["request_id"] for m in events if m.event == "done"] == [first["id"], second["id"]]
    assert events[0].event == "status" and events[0].json()["status"] == "queued"
    ids = [int(m.id or 0) for m in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
