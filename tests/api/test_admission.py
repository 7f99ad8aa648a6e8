"""POST /v1/sessions/{parent_id}/questions: admission, snapshots, limits, bad input, idempotency."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import func, select

from service.api.app import BODY_SLACK_BYTES
from service.store.db import Database
from service.store.models import EventRow, RequestRow, SessionRow, SnapshotRow
from tests.api.conftest import Server, StartServer
from tests.api.helpers import ask

SNAPSHOT: dict[str, Any] = {
    "taken_at": "2026-11-29T10:00:00Z",
    "system": "You are the main agent.",
    "tools": [{"name": "grep", "description": "search", "input_schema": {"type": "object"}}],
    "messages": [
        {"role": "user", "content": "Fix the bug."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Searching."},
                {"type": "tool_use", "id": "t1", "name": "grep", "input": {"q": "bug"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py:3"}]},
    ],
    "context_window": 200000,
    "max_output_tokens": 32000,
}


async def _row_counts(db: Database) -> tuple[int, int, int, int]:
    async with db.sessions() as tx:
        counts = []
        for table in (SessionRow, RequestRow, EventRow, SnapshotRow):
            counts.append(int(await tx.scalar(select(func.count()).select_from(table)) or 0))
    return counts[0], counts[1], counts[2], counts[3]


async def test_admission_answers_202_with_a_queued_record_and_its_queued_event(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        first = await ask(client, "p1", "what is x?", model="m-1", max_output_tokens=1024)
        second = await ask(client, "p1", "and y?")
        assert first["status"] == "queued" and first["stage"] is None
        assert (first["ordinal"], second["ordinal"]) == (1, 2)
        assert first["parent_id"] == "p1" and first["model"] == "m-1" and first["answer"] is None
        expected = {
            "id",
            "parent_id",
            "ordinal",
            "question",
            "status",
            "stage",
            "answer",
            "truncated",
            "stop_reason",
            "error",
            "usage",
            "context_info",
            "model",
            "snapshot_id",
            "attempt",
            "created_at",
            "started_at",
            "finished_at",
        }
        assert expected <= set(first)
    async with db.sessions() as tx:
        row = await tx.scalar(select(RequestRow).where(RequestRow.ordinal == 1))
        assert row is not None
        assert row.options == {"model": "m-1", "max_output_tokens": 1024}
        event = await tx.scalar(select(EventRow).where(EventRow.request_id == row.id))
        assert event is not None and event.type == "status"
        assert event.data["status"] == "queued" and event.data["stage"] is None


async def test_inline_snapshot_is_stored_under_its_id_or_content_hash(server: Server, db: Database) -> None:
    async with server.client() as client:
        named = await ask(client, "p-snap", snapshot={**SNAPSHOT, "snapshot_id": "s-42"})
        assert named["snapshot_id"] == "s-42"
        hashed = await ask(client, "p-snap", snapshot=SNAPSHOT)
        assert len(hashed["snapshot_id"]) == 64
        # The same content again (keys reordered) is the same snapshot; a reference works too.
        again = await ask(client, "p-snap", snapshot=dict(reversed(list(SNAPSHOT.items()))))
        assert again["snapshot_id"] == hashed["snapshot_id"]
        by_ref = await ask(client, "p-snap", snapshot_id="s-42")
        assert by_ref["snapshot_id"] == "s-42"
        # Immutable: same id, other content.
        other = {**SNAPSHOT, "snapshot_id": "s-42", "system": "changed"}
        response = await client.post(
            "/v1/sessions/p-snap/questions", json={"question": "q", "snapshot": other}
        )
        assert response.status_code == 409 and response.json()["error"]["code"] == "snapshot_conflict"
    async with db.sessions() as tx:
        stored = await tx.scalar(select(SnapshotRow).where(SnapshotRow.snapshot_id == "s-42"))
        assert stored is not None and next(iter(stored.content)) == "taken_at"  # kept as posted
        assert stored.token_estimate > 0


async def test_put_snapshot_is_immutable(server: Server) -> None:
    async with server.client() as client:
        url = "/v1/sessions/p-put/snapshots/s-1"
        created = await client.put(url, json=SNAPSHOT)
        assert created.status_code == 201 and created.json()["created"] is True
        same = await client.put(url, json=dict(reversed(list(SNAPSHOT.items()))))
        assert same.status_code == 200 and same.json()["content_hash"] == created.json()["content_hash"]
        conflict = await client.put(url, json={**SNAPSHOT, "messages": []})
        assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "snapshot_conflict"
        record = await ask(client, "p-put", snapshot_id="s-1")
        assert record["snapshot_id"] == "s-1"


async def test_unknown_snapshot_id_is_404_snapshot_missing_and_writes_nothing(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        response = await client.post(
            "/v1/sessions/p-miss/questions", json={"question": "q", "snapshot_id": "nope"}
        )
        assert response.status_code == 404
        body = response.json()["error"]
        assert body["code"] == "snapshot_missing" and body["detail"] == {"snapshot_id": "nope"}
    assert await _row_counts(db) == (0, 0, 0, 0)


async def test_question_limit_is_65536_bytes_of_utf8(server: Server, db: Database) -> None:
    async with server.client() as client:
        exact = "é" * 32768  # 65536 bytes
        assert (
            await client.post("/v1/sessions/p-big/questions", json={"question": exact})
        ).status_code == 202
        over = "é" * 32768 + "a"
        response = await client.post("/v1/sessions/p-big/questions", json={"question": over})
        assert response.status_code == 413
        error = response.json()["error"]
        assert (
            error["code"] == "question_too_large"
            and "65537" in error["message"]
            and "65536" in error["message"]
        )
    assert (await _row_counts(db))[1] == 1


async def test_snapshot_limit_is_413(start_server: StartServer, db: Database) -> None:
    server = await start_server(max_snapshot_bytes=2000)
    big = {**SNAPSHOT, "system": "x" * 3000}
    async with server.client() as client:
        response = await client.post("/v1/sessions/p-s/questions", json={"question": "q", "snapshot": big})
        assert response.status_code == 413 and response.json()["error"]["code"] == "snapshot_too_large"
        nan = await client.put(
            "/v1/sessions/p-s/snapshots/s1",
            content=b'{"messages": [], "x": NaN}',
            headers={"Content-Type": "application/json"},
        )
        assert nan.status_code == 400 and nan.json()["error"]["code"] == "malformed_json"
        put = await client.put("/v1/sessions/p-s/snapshots/s1", json=big)
        assert put.status_code == 413 and put.json()["error"]["code"] == "snapshot_too_large"
        # A body far beyond every limit is refused before it is read.
        huge = b'{"question": "' + b"x" * 2_000_000 + b'"}'
        refused = await client.post(
            "/v1/sessions/p-s/questions", content=huge, headers={"Content-Type": "application/json"}
        )
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "payload_too_large"
    assert await _row_counts(db) == (0, 0, 0, 0)


async def test_the_21st_queued_request_is_429_and_running_ones_do_not_count(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        records = [await ask(client, "p-q", f"q{i}") for i in range(20)]
        response = await client.post("/v1/sessions/p-q/questions", json={"question": "one too many"})
        assert response.status_code == 429
        error = response.json()["error"]
        assert error["code"] == "queue_full" and "20" in error["message"]
        assert (await _row_counts(db))[1] == 20
        # One starts running: a slot in the queue frees up.
        async with db.sessions() as tx:
            row = await tx.get(RequestRow, uuid.UUID(records[0]["id"]))
            assert row is not None
            row.status = "running"
            await tx.commit()
        assert (await client.post("/v1/sessions/p-q/questions", json={"question": "fits"})).status_code == 202
        # Other sessions are not affected.
        assert (
            await client.post("/v1/sessions/p-other/questions", json={"question": "q"})
        ).status_code == 202


async def test_the_text_backslash_u0000_in_a_snapshot_is_stored_not_refused(
    server: Server, db: Database
) -> None:
    # Source code in a tool result often holds the six characters \u0000; only a real NUL is refused.
    text = 'assert s != "\\u0000"'
    body = {"question": "q", "snapshot": {"messages": [{"role": "user", "content": text}]}}
    async with server.client() as client:
        response = await client.post("/v1/sessions/p-escaped/questions", json=body)
        assert response.status_code == 202, response.text
        put = await client.put("/v1/sessions/p-escaped/snapshots/s1", json=body["snapshot"])
        assert put.status_code in (200, 201), put.text
    async with db.sessions() as tx:
        stored = await tx.scalar(select(SnapshotRow).where(SnapshotRow.snapshot_id == "s1"))
        assert stored is not None and stored.content["messages"][0]["content"] == text


VALIDATION = "validation_error"
JSON_MEDIA_TYPES = ("application/json", "application/vnd.example+json; charset=utf-8")


async def test_bad_input_is_400_or_422_and_writes_nothing(server: Server, db: Database) -> None:
    url = "/v1/sessions/p-bad/questions"
    cases: list[tuple[bytes, int, str]] = [
        (b'{"question": "unterminated', 400, "malformed_json"),
        (b'{"question": "\xff\xfe bad utf-8"}', 400, "malformed_json"),
        (b'{"question": "q", "snapshot": {"messages": [], "x": NaN}}', 400, "malformed_json"),
        (b'{"question": "q", "snapshot": {"messages": [], "x": -Infinity}}', 400, "malformed_json"),
        (b'{"question": 42}', 422, "validation_error"),
        (b'{"question": ""}', 422, "validation_error"),
        (b"{}", 422, "validation_error"),
        (b"[1, 2]", 422, "validation_error"),
        (b'{"question": "q", "max_output_tokens": 100}', 422, "validation_error"),
        (b'{"question": "q", "max_output_tokens": "lots"}', 422, "validation_error"),
        (b'{"question": "q", "unknown_field": 1}', 422, "validation_error"),
        # Numbers are JSON numbers: a string or a boolean is refused, not read as an integer (which
        # would also leave an inline snapshot's own fields ignored as posted).
        (b'{"question": "q", "context_window": "100000"}', 422, "validation_error"),
        (b'{"question": "q", "context_window": true}', 422, "validation_error"),
        (b'{"question": "q", "snapshot": {"messages": [], "context_window": "5000"}}', 422, VALIDATION),
        (b'{"question": "q", "snapshot": {"messages": [], "max_output_tokens": true}}', 422, VALIDATION),
        # Not JSON: NaN anywhere (also in a typed field), and text that is not UTF-8 (RFC 8259 §8.1).
        (b'{"question": NaN}', 400, "malformed_json"),
        (b'{"question": "q", "max_output_tokens": Infinity}', 400, "malformed_json"),
        ('{"question": "utf-16"}'.encode("utf-16"), 400, "malformed_json"),
        ('{"question": "utf-32"}'.encode("utf-32"), 400, "malformed_json"),
        (b'\xef\xbb\xbf{"question": "a byte order mark"}', 400, "malformed_json"),
        (b'{"question": "nul \\u0000 inside"}', 422, "validation_error"),
        (b'{"question": "lone \\ud800 surrogate"}', 422, "validation_error"),
        (b'{"question": "q", "snapshot": {"messages": "not a list"}}', 422, "validation_error"),
        (
            b'{"question": "q", "snapshot": {"messages": [{"role": "user", "content": "\\u0000"}]}}',
            422,
            "invalid_snapshot",
        ),
        (b'{"question": "q", "snapshot_id": "a", "snapshot": {"messages": []}}', 422, "validation_error"),
        (b'{"question": "q", "snapshot": {"messages": [], "x": "\\ud800"}}', 422, "invalid_snapshot"),
        (
            b'{"question": "q", "snapshot": {"messages": [], "x": ' + b"[" * 200 + b"]" * 200 + b"}}",
            422,
            "invalid_snapshot",
        ),
        (
            b'{"question": "q", "snapshot": {"messages": [], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}}",
            400,
            "malformed_json",
        ),
    ]
    # The same rules for every JSON media type: the fast path takes application/json, the route the rest.
    sent = [(body, media, status, code) for body, status, code in cases for media in JSON_MEDIA_TYPES]
    async with server.client() as client:
        for body, media, status, code in sent:
            response = await client.post(url, content=body, headers={"Content-Type": media})
            assert response.status_code == status, (body, media, response.text)
            error = response.json()["error"]
            assert error["code"] == code, (body, error)
            assert error["message"] and isinstance(error["detail"], dict)
            if code == "validation_error":  # each names its field (docs/api.md)
                assert error["detail"]["errors"] and error["detail"]["errors"][0]["loc"], (body, error)
        long_parent = "p" * 501
        response = await client.post(f"/v1/sessions/{long_parent}/questions", json={"question": "q"})
        assert response.status_code == 422
        nul_parent = await client.post("/v1/sessions/a%00b/questions", json={"question": "q"})
        assert nul_parent.status_code == 422
        assert nul_parent.json()["error"]["detail"]["errors"][0]["loc"] == ["path", "parent_id"]
        # An id that is not UTF-8 once percent-decoded: refused, not read as U+FFFD (which would make
        # %FF and %C3 one session).
        for bad in ("%FF", "a%C3", "%ED%A0%80"):
            response = await client.post(f"/v1/sessions/{bad}/questions", json={"question": "q"})
            assert response.status_code == 422, (bad, response.text)
            assert response.json()["error"]["code"] == "validation_error"
            put = await client.put(f"/v1/sessions/p-ok/snapshots/{bad}", json={"messages": []})
            assert put.status_code == 422, (bad, put.text)
    assert await _row_counts(db) == (0, 0, 0, 0)


async def test_the_literal_text_of_a_nul_escape_is_not_a_nul(server: Server) -> None:
    """``\\u0000`` typed as text (six characters, a code snippet say) is storable; a real NUL is not."""
    literal = {"messages": [{"role": "user", "content": 'print("\\u0000")'}]}
    real = {"messages": [{"role": "user", "content": "a\x00b"}]}
    async with server.client() as client:
        record = await ask(client, "p-escape", snapshot=literal)
        assert len(record["snapshot_id"]) == 64
        stored = await client.put("/v1/sessions/p-escape/snapshots/s-escape", json=literal)
        assert stored.status_code == 201, stored.text
        for response in (
            await client.post("/v1/sessions/p-escape/questions", json={"question": "q", "snapshot": real}),
            await client.put("/v1/sessions/p-escape/snapshots/s-real", json=real),
        ):
            assert response.status_code == 422
            error = response.json()["error"]
            assert error["code"] == "invalid_snapshot"
            assert error["message"] == "the snapshot contains NUL characters"


async def test_a_nameless_tool_or_a_typeless_block_is_refused_not_sent_or_dropped(
    server: Server, db: Database
) -> None:
    """Refused at admission: a tool without a name would go to the provider as "name": "" (which
    refuses it), and a content block without a type would be dropped, its message with it, without
    a word."""
    user = {"role": "user", "content": "hi"}
    cases = {
        "tools[0] has no name": {"messages": [user], "tools": [{"description": "d"}]},
        "tools[1] has no name": {
            "messages": [user],
            "tools": [{"name": "grep"}, {"type": "function", "function": {"name": "", "parameters": {}}}],
        },
        "messages[1].content[0] has no type": {
            "messages": [user, {"role": "user", "content": [{"text": "hi"}]}]
        },
        # Inside a tool_result too (not replaced by "[content omitted]"); and a tool call without a
        # name, which would go to the provider as "name": "".
        "messages[1].content[0].content[0] has no type": {
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "g", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"text": "S"}]}],
                },
            ]
        },
        "messages[0].content[0] has no name": {
            "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "input": {}}]}]
        },
        "messages[1].tool_calls[0] has no name": {
            "messages": [
                user,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"arguments": "{}"}}],
                },
            ]
        },
        # Refused here rather than stored and sent on, for the provider to refuse.
        "messages[1] has no known role": {"messages": [user, {"role": "wizard", "content": "x"}]},
        "messages[1] has no content": {"messages": [user, {"role": "assistant"}]},
        "messages[1] (role tool) has no tool_call_id": {
            "messages": [user, {"role": "tool", "content": "result"}]
        },
        "messages[1].tool_calls is not a list": {
            "messages": [user, {"role": "assistant", "content": "x", "tool_calls": "x"}]
        },
        "taken_at is not an ISO 8601 time": {"messages": [user], "taken_at": "yesterday"},
    }
    async with server.client() as client:
        for reason, snapshot in cases.items():
            for response in (
                await client.post(
                    "/v1/sessions/p-shape/questions", json={"question": "q", "snapshot": snapshot}
                ),
                await client.put("/v1/sessions/p-shape/snapshots/s1", json=snapshot),
            ):
                assert response.status_code == 422, response.text
                error = response.json()["error"]
                assert error["code"] == "invalid_snapshot" and reason in error["message"], error
        # Both styles of a named tool, and typed blocks, are fine.
        fine = {
            "taken_at": "2026-11-29T10:00:00.5+01:00",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "ls"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
            ],
            "tools": [{"name": "grep"}, {"type": "function", "function": {"name": "ls"}}],
        }
        assert (await client.put("/v1/sessions/p-shape/snapshots/s1", json=fine)).status_code == 201
    assert await _row_counts(db) == (1, 0, 0, 1)  # the session and the one stored snapshot


async def test_idempotency_key_replays_the_original_or_conflicts(server: Server, db: Database) -> None:
    url = "/v1/sessions/p-idem/questions"
    async with server.client() as client:
        first = await client.post(
            url, json={"question": "q", "model": "m"}, headers={"Idempotency-Key": "k1"}
        )
        assert first.status_code == 202
        # Same body (other key order and spacing): the original record, 200.
        same = await client.post(
            url,
            content=b'{ "model": "m",   "question": "q" }',
            headers={"Idempotency-Key": "k1", "Content-Type": "application/json"},
        )
        assert same.status_code == 200 and same.json()["id"] == first.json()["id"]
        other = await client.post(url, json={"question": "other"}, headers={"Idempotency-Key": "k1"})
        assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"
        fresh = await client.post(
            url, json={"question": "q", "model": "m"}, headers={"Idempotency-Key": "k2"}
        )
        assert fresh.status_code == 202 and fresh.json()["ordinal"] == 2
    assert (await _row_counts(db))[1] == 2


async def test_idempotent_replay_still_answers_when_the_queue_is_full(server: Server) -> None:
    url = "/v1/sessions/p-idem-full/questions"
    async with server.client() as client:
        first = await client.post(url, json={"question": "q0"}, headers={"Idempotency-Key": "k"})
        for i in range(19):
            await ask(client, "p-idem-full", f"q{i + 1}")
        replay = await client.post(url, json={"question": "q0"}, headers={"Idempotency-Key": "k"})
        assert replay.status_code == 200 and replay.json()["id"] == first.json()["id"]


async def test_admission_does_not_wait_for_a_lock_a_worker_holds_on_a_running_request(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        running = await ask(client, "p-lock")
        async with db.sessions() as worker_tx:
            # A worker in the middle of a write on its running request (row locked, not committed).
            await worker_tx.execute(
                select(RequestRow).where(RequestRow.id == uuid.UUID(running["id"])).with_for_update()
            )
            started = time.perf_counter()
            response = await asyncio.wait_for(
                client.post("/v1/sessions/p-lock/questions", json={"question": "meanwhile"}), 5
            )
            elapsed = time.perf_counter() - started
            await worker_tx.rollback()
        assert response.status_code == 202 and response.json()["ordinal"] == 2
        assert elapsed < 2.0


async def test_a_chunked_body_whose_last_chunk_passes_the_limit_is_413_at_once(
    start_server: StartServer, db: Database
) -> None:
    """A body sent without Content-Length that passes the limit in its last chunk is answered 413 at
    once: a refusal that waits for more body, which never comes, hangs."""
    server = await start_server(max_snapshot_bytes=2000, max_question_bytes=1000)
    limit = 2000 + 1000 + BODY_SLACK_BYTES

    async def chunked(size: int) -> AsyncIterator[bytes]:
        body = b'{"question": "q", "pad": "' + b"a" * (size - 28) + b'"}'
        assert len(body) == size
        for start in range(0, size, 1 << 20):
            yield body[start : start + (1 << 20)]

    async with server.client() as client:
        for excess in (1, 26, 65536, 70000):
            refused = await asyncio.wait_for(
                client.post(
                    "/v1/sessions/p-c/questions",
                    content=chunked(limit + excess),
                    headers={"Content-Type": "application/json"},
                ),
                timeout=10,
            )
            assert refused.status_code == 413, excess
            assert refused.json()["error"]["code"] == "payload_too_large"
    assert await _row_counts(db) == (0, 0, 0, 0)
