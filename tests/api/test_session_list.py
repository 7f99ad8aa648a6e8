"""GET /v1/sessions: the tenant's sessions, most recently active first, keyset-paginated."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

import httpx
from sqlalchemy import event, update

from service.store.db import Database
from service.store.models import SessionRow
from service.store.session_list import Cursor, sessions_page
from tests.api.conftest import Server
from tests.api.helpers import ask


async def _all_pages(client: httpx.AsyncClient, limit: int) -> list[dict[str, Any]]:
    pages = []
    params: dict[str, Any] = {"limit": limit}
    while True:
        response = await client.get("/v1/sessions", params=params)
        assert response.status_code == 200, response.text
        page = response.json()
        pages.append(page)
        if not page["has_more"]:
            assert page["next_before"] is None
            return pages
        assert isinstance(page["next_before"], str)
        params = {"limit": limit, "before": page["next_before"]}


async def test_sessions_most_recently_active_first(auth_server: Server) -> None:
    async with auth_server.client("tok-acme") as client:
        for parent in ("p-a", "p-b", "p-c"):
            await ask(client, parent, "first")
        await ask(client, "p-a", "again")  # p-a is active again: it moves to the front
        page = (await client.get("/v1/sessions")).json()
        assert [s["parent_id"] for s in page["items"]] == ["p-a", "p-c", "p-b"]
        assert page["has_more"] is False and page["next_before"] is None
        # Each item is exactly the session object of GET /v1/sessions/{parent_id}.
        for item in page["items"]:
            single = (await client.get(f"/v1/sessions/{item['parent_id']}")).json()
            assert item == single
        assert page["items"][0]["counts"]["queued"] == 2 and page["items"][0]["next_ordinal"] == 3
        # A clear is activity too.
        assert (await client.delete("/v1/sessions/p-b/questions")).status_code == 200
        page = (await client.get("/v1/sessions")).json()
        assert [s["parent_id"] for s in page["items"]] == ["p-b", "p-a", "p-c"]
        assert page["items"][0]["clear_version"] == 1 and page["items"][0]["counts"]["queued"] == 0


async def test_pagination_walks_every_session_once(auth_server: Server) -> None:
    async with auth_server.client("tok-acme") as client:
        for i in range(7):
            await ask(client, f"p-{i}", "q")
        pages = await _all_pages(client, limit=3)
    assert [[s["parent_id"] for s in p["items"]] for p in pages] == [
        ["p-6", "p-5", "p-4"],
        ["p-3", "p-2", "p-1"],
        ["p-0"],
    ]
    assert [p["has_more"] for p in pages] == [True, True, False]


async def test_sessions_active_in_the_same_microsecond_are_neither_skipped_nor_repeated(
    auth_server: Server, db: Database
) -> None:
    async with auth_server.client("tok-acme") as client:
        for i in range(5):
            await ask(client, f"p-tie-{i}", "q")
        same = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)
        async with db.sessions() as tx:
            await tx.execute(update(SessionRow).values(updated_at=same))
            await tx.commit()
        pages = await _all_pages(client, limit=2)
    seen = [s["parent_id"] for p in pages for s in p["items"]]
    assert sorted(seen) == [f"p-tie-{i}" for i in range(5)]  # each exactly once
    assert len(pages) == 3


async def test_another_tenants_sessions_are_never_listed(auth_server: Server) -> None:
    async with auth_server.client("tok-acme") as acme, auth_server.client("tok-globex") as globex:
        await ask(acme, "p-acme", "mine")
        await ask(acme, "p-shared", "acme's")
        await ask(globex, "p-shared", "globex's")  # same parent id, another tenant: its own session
        await ask(globex, "p-globex", "theirs")
        mine = (await acme.get("/v1/sessions")).json()
        theirs = (await globex.get("/v1/sessions")).json()
        # A cursor only positions within the caller's own sessions.
        cursor = (await globex.get("/v1/sessions", params={"limit": 1})).json()["next_before"]
        after_cursor = (await acme.get("/v1/sessions", params={"before": cursor})).json()
    assert [s["parent_id"] for s in mine["items"]] == ["p-shared", "p-acme"]
    assert [s["parent_id"] for s in theirs["items"]] == ["p-globex", "p-shared"]
    assert mine["items"][0]["counts"]["queued"] == 1 and theirs["items"][1]["counts"]["queued"] == 1
    assert {s["parent_id"] for s in after_cursor["items"]} <= {"p-acme", "p-shared"}
    async with auth_server.client() as anonymous:
        response = await anonymous.get("/v1/sessions")
    assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"


async def test_bad_cursor_and_limit_are_refused_with_the_error_body(auth_server: Server) -> None:
    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    bad_cursors = [
        "garbage!",
        b64(b"not json"),
        b64(json.dumps({"updated_at": "x"}).encode()),
        b64(json.dumps(["2026-11-30T12:00:00Z", "not-a-uuid"]).encode()),
        b64(json.dumps(["yesterday", "7f1c6a3e-8a43-4c8e-9a53-1f1f0c9d5a10"]).encode()),
        b64(json.dumps(["2026-11-30T12:00:00+02:00", "7f1c6a3e-8a43-4c8e-9a53-1f1f0c9d5a10"]).encode()),
        b64(b"\xff\xfe"),
        "",  # 400 as on the hand-off list, not 422
    ]
    async with auth_server.client("tok-acme") as client:
        await ask(client, "p-x", "q")
        for cursor in bad_cursors:
            response = await client.get("/v1/sessions", params={"before": cursor})
            assert response.status_code == 400, (cursor, response.text)
            error = response.json()["error"]
            assert (
                error["code"] == "invalid_cursor" and error["message"] and isinstance(error["detail"], dict)
            )
        overlong = await client.get("/v1/sessions", params={"before": "x" * 5000})
        assert overlong.status_code == 400 and overlong.json()["error"]["code"] == "invalid_cursor"
        assert overlong.json()["error"]["detail"] == {"before": "x" * 100}
        for params in ({"limit": 0}, {"limit": 101}, {"limit": "x"}):
            response = await client.get("/v1/sessions", params=params)
            assert response.status_code == 422, (params, response.text)
            assert response.json()["error"]["code"] == "validation_error"
        assert (await client.get("/v1/sessions", params={"limit": 100})).status_code == 200
        assert (await client.get("/v1/sessions", params={"limit": 1})).json()["has_more"] is False


async def test_an_empty_tenant_gets_an_empty_page(auth_server: Server) -> None:
    async with auth_server.client("tok-globex") as client:
        assert (await client.get("/v1/sessions")).json() == {
            "items": [],
            "has_more": False,
            "next_before": None,
        }


def test_cursor_round_trips_with_microseconds() -> None:
    moment = datetime(2026, 11, 30, 12, 0, 0, 1, tzinfo=UTC)
    cursor = Cursor(moment, __import__("uuid").uuid4())
    assert Cursor.decode(cursor.encode()) == cursor
    assert "=" not in cursor.encode()


async def test_a_page_costs_three_queries_however_many_sessions(auth_server: Server, db: Database) -> None:
    async with auth_server.client("tok-acme") as client:
        for i in range(12):
            await ask(client, f"p-n{i}", "q")
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    event.listen(db.engine.sync_engine, "before_cursor_execute", count)
    try:
        async with db.sessions() as tx:
            page = await sessions_page(tx, "acme", limit=10, before=None)
    finally:
        event.remove(db.engine.sync_engine, "before_cursor_execute", count)
    assert len(page["items"]) == 10 and page["has_more"] is True
    assert all(sum(item["counts"].values()) == 1 for item in page["items"])
    # One for the page of sessions, one for every status count of the page, one for the background
    # jobs of the page: never one per session.
    assert len(statements) == 3, statements
