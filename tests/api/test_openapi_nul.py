"""The OpenAPI schema says what the service refuses: NUL characters anywhere in snapshots and archives.

Each case is checked both ways: the published schema (validated with the OpenAPI document as the
root, so its ``$ref``s resolve) refuses exactly what the service refuses (422), and accepts what it
stores.
"""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import pytest

from tests.api.conftest import Server

NUL = "\u0000"


def _validator(document: dict[str, Any], ref: str) -> jsonschema.Draft202012Validator:
    # The whole document is the root resource: "#/components/schemas/…" resolves inside it.
    return jsonschema.Draft202012Validator({**document, "$ref": ref})


def _snapshot(text: str = "fine", key: str = "note") -> dict[str, Any]:
    return {
        "system": "sys",
        "tools": [
            {"name": "grep", "input_schema": {"type": "object", "properties": {"q": {"description": text}}}}
        ],
        "messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": [{"type": "text", "text": text, key: [1, {"deep": text}]}]},
        ],
    }


NUL_SNAPSHOTS = [
    pytest.param(_snapshot(text=f"a{NUL}b"), id="nested-text"),
    pytest.param(_snapshot(key=f"k{NUL}"), id="nested-key"),
    pytest.param({**_snapshot(), "system": f"s{NUL}"}, id="system"),
    pytest.param({**_snapshot(), "extra": {"x": [f"{NUL}"]}}, id="extra-field"),
    pytest.param({"messages": [{"role": f"u{NUL}", "content": "x"}]}, id="role"),
]


@pytest.mark.parametrize("snapshot", NUL_SNAPSHOTS)
async def test_nul_in_a_snapshot_is_refused_and_the_schema_says_so(
    server: Server, snapshot: dict[str, Any]
) -> None:
    async with server.client() as client:
        document = (await client.get("/openapi.json")).json()
        response = await client.put("/v1/sessions/nul-parent/snapshots/s-nul", json=snapshot)
        inline = await client.post(
            "/v1/sessions/nul-parent/questions", json={"question": "q", "snapshot": snapshot}
        )
    assert response.status_code == 422, response.text
    assert inline.status_code == 422, inline.text
    assert not _validator(document, "#/components/schemas/Snapshot").is_valid(snapshot)


async def test_a_clean_snapshot_is_stored_and_valid(server: Server) -> None:
    snapshot = _snapshot()
    async with server.client() as client:
        document = (await client.get("/openapi.json")).json()
        response = await client.put("/v1/sessions/nul-parent/snapshots/s-ok", json=snapshot)
    assert response.status_code == 201, response.text
    _validator(document, "#/components/schemas/Snapshot").validate(snapshot)


def _archive(answer: str = "an answer", detail: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "version": 3,
        "parent_id": "p",
        "questions": [
            {
                "ordinal": 1,
                "question": "q?",
                "answer": answer,
                "created_at": "2026-11-29T10:00:00Z",
                "status": "succeeded",
                "context_info": {"note": detail or {}},
            }
        ],
    }


def _with_handoff(changes: dict[str, Any]) -> dict[str, Any]:
    """A v3 archive with one hand-off of the first question, changed by ``changes``."""
    handoff = {
        "created_at": "2026-11-29T10:05:00Z",
        "format": "text",
        "text": "handed off",
        "ordinals": [1],
        **changes,
    }
    return {**_archive(), "session": {"handoffs": [handoff], "handed_off_through": 1}}


@pytest.mark.parametrize(
    "archive",
    [
        pytest.param(_archive(answer=f"a{NUL}"), id="answer"),
        pytest.param(_archive(detail={"x": f"{NUL}"}), id="context_info"),
        pytest.param({**_archive(), "parent_id": f"p{NUL}"}, id="parent_id"),
        pytest.param(_with_handoff({"extra": {f"k{NUL}": 1}}), id="handoff_extra_key"),
        pytest.param(_with_handoff({"note": f"n{NUL}"}), id="handoff_extra_value"),
        pytest.param(_with_handoff({"text": f"t{NUL}"}), id="handoff_text"),
        pytest.param(
            _with_handoff({"message": {"role": "user", "content": "c", f"x{NUL}": 1}}), id="message_key"
        ),
    ],
)
async def test_nul_in_an_archive_is_refused_and_the_schema_says_so(
    server: Server, archive: dict[str, Any]
) -> None:
    validator, response = await _restore_beside_its_schema(server, "nul-archive", archive)
    assert response.status_code == 422, response.text
    assert not validator.is_valid(archive)
    assert validator.is_valid(_archive())


async def test_a_clean_handoff_in_an_archive_is_valid_and_restores(server: Server) -> None:
    archive = _with_handoff({"note": {"kept": "as is"}})
    validator, response = await _restore_beside_its_schema(server, "clean-handoff", archive)
    assert response.status_code == 200, response.text
    assert validator.is_valid(archive)


async def _restore_beside_its_schema(
    server: Server, parent_id: str, archive: dict[str, Any]
) -> tuple[jsonschema.Draft202012Validator, httpx.Response]:
    """The OpenAPI's validator of a restore's body, and the service's answer to restoring ``archive``."""
    async with server.client() as client:
        document = (await client.get("/openapi.json")).json()
        body = document["paths"]["/v1/sessions/{parent_id}/archive"]["post"]["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        response = await client.post(f"/v1/sessions/{parent_id}/archive", json=archive)
    return jsonschema.Draft202012Validator({**document, **schema}), response
