"""Hand-offs and pins over HTTP on a real uvicorn (SPEC §11.1): status codes, idempotency, bad input
writing nothing, tenant isolation, the `handoff` event on the session stream, clear."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update

from service.store.db import Database
from service.store.models import HandoffRow, RequestRow, SessionRow
from tests.api.conftest import Server
from tests.api.helpers import ask, finish, mark_running
from tests.api.sse_client import events


async def answered(
    client: httpx.AsyncClient, db: Database, parent: str, question: str = "why?"
) -> dict[str, Any]:
    record = await ask(client, parent, question)
    await mark_running(db, record["id"])
    await finish(db, record["id"], answer=f"because of {question}")
    return record


async def handoff_rows(db: Database) -> int:
    async with db.sessions() as tx:
        return int(await tx.scalar(select(func.count()).select_from(HandoffRow)) or 0)


async def test_post_handoff_is_201_then_nothing_new_is_200_and_get_lists_newest_first(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        first = await answered(client, db, "p", "which file?")
        response = await client.post("/v1/sessions/p/handoffs", json={})
        assert response.status_code == 201, response.text
        body = response.json()
        assert body["ordinals"] == [first["ordinal"]] and body["parent_id"] == "p" and body["id"]
        assert body["format"] == "anthropic" and body["message"]["role"] == "user"
        assert body["message"]["content"] == body["text"] and "Q: which file?" in body["text"]
        assert body["estimate_tokens"] <= 2000 and body["truncated"] is False

        nothing = await client.post("/v1/sessions/p/handoffs")  # no body at all: every field defaults
        assert (
            nothing.status_code == 200 and nothing.json()["ordinals"] == [] and nothing.json()["text"] == ""
        )

        await answered(client, db, "p", "and the tests?")
        text = await client.post("/v1/sessions/p/handoffs", json={"format": "text", "max_tokens": 256})
        assert text.status_code == 201 and text.json()["message"] is None
        assert text.json()["estimate_tokens"] <= 256

        listed = (await client.get("/v1/sessions/p/handoffs", params={"limit": 1})).json()
        assert [h["id"] for h in listed["items"]] == [text.json()["id"]] and listed["has_more"] is True
        older = (await client.get("/v1/sessions/p/handoffs", params={"before": listed["next_before"]})).json()
        assert [h["id"] for h in older["items"]] == [body["id"]] and older["next_before"] is None

        # A well-formed id that is not one of the session's hand-offs (one a clear deleted): an empty page.
        empty = await client.get(
            "/v1/sessions/p/handoffs", params={"before": "00000000-0000-0000-0000-000000000000"}
        )
        assert empty.status_code == 200 and empty.json() == {
            "items": [],
            "has_more": False,
            "next_before": None,
        }
        # Not an id at all: no cursor this service issued, 400 like the session list's.
        for garbage in ("not-an-id", "zzz", "", "0" * 37, "f" * 5000):  # any length: 400, not 422
            bad = await client.get("/v1/sessions/p/handoffs", params={"before": garbage})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_cursor"
            assert bad.json()["error"]["detail"] == {"before": garbage[:100]}

        session = (await client.get("/v1/sessions/p")).json()
        assert session["handed_off_through"] == 2
        everything = await client.post("/v1/sessions/p/handoffs", json={"include": "all", "format": "openai"})
        assert everything.status_code == 201 and everything.json()["ordinals"] == [1, 2]


async def test_pin_unpin_and_the_pinned_answer_goes_in_the_next_handoff(server: Server, db: Database) -> None:
    async with server.client() as client:
        one = await answered(client, db, "p")
        assert (await client.post("/v1/sessions/p/handoffs")).status_code == 201
        pinned = await client.post(f"/v1/questions/{one['id']}/pin")
        assert pinned.status_code == 200 and pinned.json()["pinned"] is True
        assert (await client.post(f"/v1/questions/{one['id']}/pin")).json()["pinned"] is True
        assert (await client.get(f"/v1/questions/{one['id']}")).json()["pinned"] is True
        unpinned = await client.delete(f"/v1/questions/{one['id']}/pin")
        assert unpinned.status_code == 200 and unpinned.json()["pinned"] is False
        assert (await client.delete(f"/v1/questions/{one['id']}/pin")).json()["pinned"] is False
        await client.post(f"/v1/questions/{one['id']}/pin")
        again = (await client.post("/v1/sessions/p/handoffs")).json()
        assert (
            again["ordinals"] == [1]
            and (await client.get(f"/v1/questions/{one['id']}")).json()["pinned"] is False
        )

        queued = await ask(client, "p", "still queued")
        refused = await client.post(f"/v1/questions/{queued['id']}/pin")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_pinnable"
        assert (await client.post("/v1/questions/not-a-uuid/pin")).status_code == 404


async def test_what_a_handoff_leaves_out_is_pinned_so_the_next_new_one_carries_it(
    server: Server, db: Database
) -> None:
    """A Q&A left out to fit is not shown to the main agent, yet the mark moves past it, so no
    include: "new" hand-off would ever carry it. It is pinned instead: the next one does."""
    async with server.client() as client:
        records = []
        for n in range(1, 6):
            records.append(await answered(client, db, "p-left", f"question {n} " + "x" * 900))
        first = (await client.post("/v1/sessions/p-left/handoffs", json={"max_tokens": 256})).json()
        assert first["omitted_ordinals"] and 5 in first["ordinals"], first
        for record in records:
            got = (await client.get(f"/v1/questions/{record['id']}")).json()
            assert got["pinned"] is (got["ordinal"] in first["omitted_ordinals"]), got["ordinal"]
        carried = set(first["ordinals"])
        for _ in range(5):  # each carries what fits of the rest, until nothing is left
            nxt = await client.post("/v1/sessions/p-left/handoffs", json={"max_tokens": 256})
            if nxt.status_code == 200:
                break
            carried |= set(nxt.json()["ordinals"])
        assert carried == {1, 2, 3, 4, 5}
        for record in records:
            assert (await client.get(f"/v1/questions/{record['id']}")).json()["pinned"] is False


async def test_an_all_handoff_pins_nothing_the_main_conversation_already_has(
    server: Server, db: Database
) -> None:
    """An include: "all" hand-off that leaves out Q&A handed off before does not pin them: the main
    conversation has them, and the next include: "new" hand-off would carry them a second time."""
    async with server.client() as client:
        records = []
        for n in range(1, 4):
            records.append(await answered(client, db, "p-all-left", f"question {n} " + "x" * 900))
        first = (await client.post("/v1/sessions/p-all-left/handoffs", json={"max_tokens": 8000})).json()
        assert first["ordinals"] == [1, 2, 3]
        tight = (
            await client.post("/v1/sessions/p-all-left/handoffs", json={"max_tokens": 256, "include": "all"})
        ).json()
        assert tight["omitted_ordinals"]
        for record in records:
            assert (await client.get(f"/v1/questions/{record['id']}")).json()["pinned"] is False
        assert (await client.post("/v1/sessions/p-all-left/handoffs", json={})).json()["ordinals"] == []


async def test_idempotency_key_replays_with_200_and_another_body_is_409(server: Server, db: Database) -> None:
    async with server.client() as client:
        await answered(client, db, "p")
        headers = {"Idempotency-Key": "handoff-1"}
        first = await client.post("/v1/sessions/p/handoffs", json={"max_tokens": 1000}, headers=headers)
        assert first.status_code == 201
        await answered(client, db, "p")
        replay = await client.post("/v1/sessions/p/handoffs", json={"max_tokens": 1000}, headers=headers)
        assert replay.status_code == 200 and replay.json() == first.json()
        other = await client.post("/v1/sessions/p/handoffs", json={"max_tokens": 999}, headers=headers)
        assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"
    assert await handoff_rows(db) == 1


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"max_tokens": 255}, 422, "validation_error"),
        ({"max_tokens": 32769}, 422, "validation_error"),
        ({"format": "xml"}, 422, "validation_error"),
        ({"include": "some"}, 422, "validation_error"),
        ({"ordinals": []}, 422, "validation_error"),
        ({"ordinals": [2]}, 422, "unknown_ordinals"),  # failed
        ({"ordinals": [1, 99]}, 422, "unknown_ordinals"),  # unknown
        ({"whatever": 1}, 422, "validation_error"),
        ({"max_tokens": "2000"}, 422, "validation_error"),  # JSON numbers, not strings or booleans
        ({"ordinals": ["1"]}, 422, "validation_error"),
        ({"max_tokens": True}, 422, "validation_error"),
        ("not json", 400, "malformed_json"),
    ],
)
async def test_bad_input_is_refused_with_a_clear_message_and_writes_nothing(
    server: Server, db: Database, body: object, status: int, code: str
) -> None:
    async with server.client() as client:
        await answered(client, db, "p")
        failed = await ask(client, "p")
        async with db.sessions() as tx, tx.begin():
            await tx.execute(
                update(RequestRow).where(RequestRow.id == uuid.UUID(failed["id"])).values(status="failed")
            )
        kwargs: dict[str, Any] = {"content": body} if isinstance(body, str) else {"json": body}
        response = await client.post(
            "/v1/sessions/p/handoffs", headers={"Content-Type": "application/json"}, **kwargs
        )
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == code and error["message"]
        if code == "unknown_ordinals":
            assert "not succeeded" in error["message"] and error["detail"]["ordinals"]
    assert await handoff_rows(db) == 0
    async with db.sessions() as tx:
        assert await tx.scalar(select(SessionRow.handed_off_through)) == 0


async def test_another_tenant_gets_404_everywhere(auth_server: Server, db: Database) -> None:
    async with auth_server.client("tok-acme") as acme, auth_server.client("tok-globex") as globex:
        one = await answered(acme, db, "shared")
        assert (await acme.post("/v1/sessions/shared/handoffs")).status_code == 201
        for response in (
            await globex.post("/v1/sessions/shared/handoffs"),
            await globex.get("/v1/sessions/shared/handoffs"),
            await globex.post(f"/v1/questions/{one['id']}/pin"),
            await globex.delete(f"/v1/questions/{one['id']}/pin"),
        ):
            assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
        assert (await globex.get("/v1/sessions/nobody/handoffs")).status_code == 404
        assert (await acme.post("/v1/sessions/nobody/handoffs")).status_code == 404
        assert (await acme.get("/v1/sessions/shared/handoffs")).json()["items"]


async def test_the_handoff_event_appears_on_the_session_stream(server: Server, db: Database) -> None:
    async with server.client() as client:
        await answered(client, db, "p-stream")
        got: list[Any] = []

        async def listen() -> None:
            async with client.stream("GET", "/v1/sessions/p-stream/events") as response:
                assert response.status_code == 200
                async for message in events(response):
                    got.append(message)
                    if message.event == "handoff":
                        return

        listener = asyncio.create_task(listen())
        await asyncio.sleep(0.3)  # the replayed request events first, then the live hand-off
        posted = (await client.post("/v1/sessions/p-stream/handoffs")).json()
        await asyncio.wait_for(listener, 10)
        handoff = got[-1].json()
        assert handoff["handoff"]["id"] == posted["id"] and handoff["handoff"]["ordinals"] == [1]
        assert handoff["handed_off_through"] == 1 and handoff["request_id"] is None and handoff["at"]
        ids = [int(m.id) for m in got if m.id]
        assert ids == sorted(ids)


async def test_clear_deletes_handoffs_and_resets_the_mark(server: Server, db: Database) -> None:
    async with server.client() as client:
        await answered(client, db, "p")
        assert (await client.post("/v1/sessions/p/handoffs")).status_code == 201
        assert (await client.delete("/v1/sessions/p/questions")).status_code == 200
        assert (await client.get("/v1/sessions/p/handoffs")).json()["items"] == []
        assert (await client.get("/v1/sessions/p")).json()["handed_off_through"] == 0
        after = await answered(client, db, "p")
        assert (await client.post("/v1/sessions/p/handoffs")).json()["ordinals"] == [after["ordinal"]]


async def test_openapi_describes_handoffs_pins_and_settings(server: Server) -> None:
    async with server.client() as client:
        spec = (await client.get("/openapi.json")).json()
    paths, schemas = spec["paths"], spec["components"]["schemas"]
    for path, methods in (
        ("/v1/sessions/{parent_id}/handoffs", {"post", "get"}),
        ("/v1/sessions/{parent_id}/settings", {"put", "get"}),
        ("/v1/questions/{request_id}/pin", {"post", "delete"}),
    ):
        assert methods <= set(paths[path])
    assert {"201", "200", "404", "409", "422"} <= set(
        paths["/v1/sessions/{parent_id}/handoffs"]["post"]["responses"]
    )
    assert {
        "id",
        "parent_id",
        "created_at",
        "format",
        "ordinals",
        "from_ordinal",
        "through_ordinal",
        "estimate_tokens",
        "summarized_ordinals",
        "truncated",
        "message",
        "text",
    } <= set(schemas["Handoff"]["properties"])
    assert {"handed_off_through", "settings"} <= set(schemas["SessionOut"]["properties"])
    assert set(schemas["SessionSettingsIn"]["properties"]) == {
        "summary_instructions",
        "summary_model",
        "answer_model",
        "context_window",
        "max_output_tokens",
        "on_busy",
        "mask_tool_results",
    }
