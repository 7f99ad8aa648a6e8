"""Session settings over HTTP (SPEC §11.2): partial PUT, null clears, bad input writes nothing,
tenant isolation, the session object shows them, a clear keeps them."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from service.store.db import Database
from service.store.models import SessionRow
from tests.api.conftest import Server

UNSET = {
    "summary_instructions": None,
    "summary_model": None,
    "answer_model": None,
    "context_window": None,
    "max_output_tokens": None,
    "on_busy": None,
    "mask_tool_results": None,
}


async def session_count(db: Database) -> int:
    async with db.sessions() as tx:
        return int(await tx.scalar(select(func.count()).select_from(SessionRow)) or 0)


async def test_put_creates_the_session_changes_only_named_fields_and_null_clears(server: Server) -> None:
    async with server.client() as client:
        assert (await client.get("/v1/sessions/p/settings")).status_code == 404
        first = await client.put(
            "/v1/sessions/p/settings",
            json={"summary_instructions": "Keep file paths.", "summary_model": "cheap", "on_busy": "reject"},
        )
        assert first.status_code == 200, first.text
        assert first.json() == {
            **UNSET,
            "summary_instructions": "Keep file paths.",
            "summary_model": "cheap",
            "on_busy": "reject",
        }
        second = await client.put(
            "/v1/sessions/p/settings", json={"context_window": 64000, "summary_model": None}
        )
        assert second.json() == {
            **UNSET,
            "summary_instructions": "Keep file paths.",
            "context_window": 64000,
            "on_busy": "reject",
        }
        assert (await client.put("/v1/sessions/p/settings", json={})).json() == second.json()
        assert (await client.get("/v1/sessions/p/settings")).json() == second.json()
        session = (await client.get("/v1/sessions/p")).json()
        assert session["settings"] == second.json() and session["handed_off_through"] == 0
        # A clear keeps the settings.
        assert (await client.delete("/v1/sessions/p/questions")).status_code == 200
        assert (await client.get("/v1/sessions/p/settings")).json() == second.json()


async def test_instructions_of_exactly_4_kib_are_accepted_multibyte_counted_in_bytes(server: Server) -> None:
    async with server.client() as client:
        exact = "ü" * 2048  # 4096 bytes
        ok = await client.put("/v1/sessions/p/settings", json={"summary_instructions": exact})
        assert ok.status_code == 200 and ok.json()["summary_instructions"] == exact
        over = await client.put("/v1/sessions/p/settings", json={"summary_instructions": exact + "a"})
        assert over.status_code == 422 and "4096 bytes" in over.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"summary_instructions": "x" * 4097},
        {"on_busy": "queue"},
        {"context_window": 10},
        {"max_output_tokens": 255},
        {"max_output_tokens": 32769},
        {"summary_model": ""},
        {"answer_model": "a\u0000b"},
        {"unknown": 1},
        {"max_output_tokens": "512"},  # a number is a JSON number, not a string or a boolean
        {"context_window": True},
        {"on_busy": "reject", "max_output_tokens": 100},  # one bad field refuses the whole PUT
    ],
)
async def test_bad_settings_are_422_with_a_clear_message_and_nothing_is_written(
    server: Server, db: Database, body: dict[str, Any]
) -> None:
    async with server.client() as client:
        response = await client.put("/v1/sessions/fresh/settings", json=body)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "validation_error" and error["message"].startswith("invalid request")
        assert error["detail"]["errors"]
        assert (await client.get("/v1/sessions/fresh/settings")).status_code == 404
        await client.put("/v1/sessions/kept/settings", json={"on_busy": "interrupt"})
        assert (await client.put("/v1/sessions/kept/settings", json=body)).status_code == 422
        assert (await client.get("/v1/sessions/kept/settings")).json() == {**UNSET, "on_busy": "interrupt"}
    assert await session_count(db) == 1


async def test_malformed_json_is_400(server: Server, db: Database) -> None:
    async with server.client() as client:
        response = await client.put(
            "/v1/sessions/p/settings", content=b"{nope", headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400 and response.json()["error"]["code"] == "malformed_json"
    assert await session_count(db) == 0


async def test_another_tenant_has_its_own_settings_and_never_sees_these(auth_server: Server) -> None:
    async with auth_server.client("tok-acme") as acme, auth_server.client("tok-globex") as globex:
        await acme.put("/v1/sessions/shared/settings", json={"answer_model": "acme-model"})
        assert (await globex.get("/v1/sessions/shared/settings")).status_code == 404
        theirs = await globex.put("/v1/sessions/shared/settings", json={"on_busy": "reject"})
        assert theirs.json() == {**UNSET, "on_busy": "reject"}
        assert (await acme.get("/v1/sessions/shared/settings")).json() == {
            **UNSET,
            "answer_model": "acme-model",
        }
    async with auth_server.client() as anonymous:
        assert (await anonymous.get("/v1/sessions/shared/settings")).status_code == 401
