"""Archive routes over real HTTP: export and restore, refusals with SPEC's error body, tenants."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.api.conftest import Server, StartServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "archives"


def fixture_bytes(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def without_envelope(document: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in document.items() if k not in ("parent_id", "exported_at")}


async def post_archive(
    client: httpx.AsyncClient, parent_id: str, body: bytes, *, mode: str | None = None
) -> httpx.Response:
    params = {"mode": mode} if mode else {}
    return await client.post(
        f"/v1/sessions/{parent_id}/archive",
        content=body,
        params=params,
        headers={"Content-Type": "application/json"},
    )


async def test_every_version_restores_and_v3_round_trips_over_http(server: Server) -> None:
    async with server.client() as client:
        for name, parent in (("v1.json", "one"), ("v2.json", "two"), ("v3.json", "three")):
            response = await post_archive(client, parent, fixture_bytes(name))
            assert response.status_code == 200, response.text
            assert response.json()["restored"] == len(json.loads(fixture_bytes(name))["questions"])
        first = (await client.get("/v1/sessions/three/archive", params={"version": 3})).json()
        assert first["parent_id"] == "three"
        restored = await post_archive(client, "elsewhere", json.dumps(first).encode())
        assert restored.status_code == 200
        second = (await client.get("/v1/sessions/elsewhere/archive")).json()
        assert without_envelope(second) == without_envelope(first)
        assert without_envelope(first) == without_envelope(json.loads(fixture_bytes("v3.json")))

        session = (await client.get("/v1/sessions/one")).json()
        assert session["next_ordinal"] == 5 and session["counts"]["succeeded"] == 3


async def test_restored_history_is_readable_and_its_streams_replay_and_close(server: Server) -> None:
    async with server.client() as client:
        assert (await post_archive(client, "p", fixture_bytes("v2.json"))).status_code == 200
        page = (await client.get("/v1/sessions/p/questions")).json()
        assert [(r["ordinal"], r["status"]) for r in page["items"]] == [
            (1, "succeeded"),
            (2, "failed"),
            (3, "cancelled"),
        ]
        failed = page["items"][1]
        assert failed["error"]["code"] == "provider_error"
        async with client.stream("GET", f"/v1/questions/{failed['id']}/events") as stream:
            body = (await stream.aread()).decode()
        assert "event: status" in body and "event: error" in body and "provider_error" in body
        # Resuming at the terminal event: nothing more will come.
        resumed = await client.get(f"/v1/questions/{failed['id']}/events", headers={"Last-Event-ID": "2"})
        assert resumed.status_code == 204


async def test_history_conflict_is_409_unless_replace(server: Server) -> None:
    async with server.client() as client:
        assert (await post_archive(client, "p", fixture_bytes("v3.json"))).status_code == 200
        refused = await post_archive(client, "p", fixture_bytes("v1.json"))
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "session_has_history"
        assert "mode=replace" in refused.json()["error"]["message"]
        assert len((await client.get("/v1/sessions/p/archive")).json()["questions"]) == 2

        replaced = await post_archive(client, "p", fixture_bytes("v1.json"), mode="replace")
        assert replaced.status_code == 200
        assert replaced.json()["replaced"] == 2 and replaced.json()["clear_version"] == 1
        ordinals = [q["ordinal"] for q in (await client.get("/v1/sessions/p/archive")).json()["questions"]]
        assert ordinals == [1, 2, 4]

        unknown_mode = await post_archive(client, "p", fixture_bytes("v1.json"), mode="merge")
        assert unknown_mode.status_code == 422


def _v1(*, question: str) -> dict[str, object]:
    return {
        "version": 1,
        "parent_id": "x",
        "questions": [
            {"ordinal": 1, "question": question, "answer": "a", "created_at": "2026-11-29T10:00:00Z"}
        ],
    }


async def test_malformed_archives_get_400_or_422_and_nothing_is_written(server: Server) -> None:
    v3 = json.loads(fixture_bytes("v3.json"))
    v3["questions"][1]["ordinal"] = 1
    cases = [
        (b"{not json", 400),
        (b"\xff\xfe\x00", 400),
        (b'"just a string"', 400),
        (b'{"version": 9, "parent_id": "x", "questions": []}', 400),
        (json.dumps(v3).encode(), 422),
        (b'{"version": 2, "parent_id": "x", "questions": [{"ordinal": 1}]}', 422),
        # A question admission refuses (empty, over the 64 KiB limit) is not restored either.
        (json.dumps(_v1(question="")).encode(), 422),
        (json.dumps(_v1(question="é" * 32769)).encode(), 422),
    ]
    async with server.client() as client:
        for body, status in cases:
            response = await post_archive(client, "p", body)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert error["code"] == "invalid_archive" and error["message"]
            if status == 422:
                assert error["detail"]["errors"][0]["loc"].startswith("questions[")
        # Not even the session was created.
        assert (await client.get("/v1/sessions/p")).status_code == 404
        # A parent id PostgreSQL cannot store is an input error too, never a 500.
        nul = await post_archive(client, "a%00b", fixture_bytes("v1.json"))
        assert nul.status_code == 422 and nul.json()["error"]["code"] == "validation_error"
        assert (await client.get(f"/v1/sessions/{'x' * 501}/archive")).status_code == 422


async def test_export_of_unknown_session_or_version_is_refused(server: Server) -> None:
    async with server.client() as client:
        missing = await client.get("/v1/sessions/nobody/archive")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        await post_archive(client, "p", fixture_bytes("v1.json"))
        assert (await client.get("/v1/sessions/p/archive", params={"version": 4})).status_code == 422
        v1 = (await client.get("/v1/sessions/p/archive", params={"version": 1})).json()
        assert v1["version"] == 1 and "session" not in v1


async def test_archives_belong_to_the_tenant(start_server: StartServer) -> None:
    server = await start_server(api_tokens="acme:tok-acme,globex:tok-globex")
    async with (
        server.client("tok-acme") as acme,
        server.client("tok-globex") as globex,
        server.client() as anon,
    ):
        assert (await post_archive(acme, "p", fixture_bytes("v3.json"))).status_code == 200
        assert (await globex.get("/v1/sessions/p/archive")).status_code == 404
        assert (await anon.get("/v1/sessions/p/archive")).status_code == 401
        assert (await post_archive(anon, "p", fixture_bytes("v1.json"))).status_code == 401
        # The same parent id is another, separate session for another tenant.
        assert (await post_archive(globex, "p", fixture_bytes("v1.json"))).status_code == 200
        assert len((await acme.get("/v1/sessions/p/archive")).json()["questions"]) == 2
        assert len((await globex.get("/v1/sessions/p/archive")).json()["questions"]) == 3


async def test_archive_larger_than_the_limit_is_413(start_server: StartServer) -> None:
    server = await start_server(max_snapshot_bytes=2048)
    async with server.client() as client:
        response = await post_archive(client, "p", fixture_bytes("v3.json"))
        assert response.status_code == 413
        # The same detail as the body limit's own 413, so a client reads one shape.
        assert response.json()["error"]["code"] == "payload_too_large"
        assert response.json()["error"]["detail"] == {"limit_bytes": 2048}
        assert (await client.get("/v1/sessions/p")).status_code == 404


async def test_a_session_restored_up_to_the_last_ordinal_refuses_new_questions_with_409(
    server: Server, db: Any
) -> None:
    """A v1 archive may carry ordinals up to MAX_ORDINAL; the session's next ordinal then cannot be
    taken, and an admission says so (409 ordinals_exhausted) instead of a 500, writing nothing."""
    from sqlalchemy import func, select

    from service.archive import MAX_ORDINAL
    from service.store.models import RequestRow

    archive: dict[str, Any] = {
        "version": 1,
        "parent_id": "full",
        "questions": [
            {"ordinal": MAX_ORDINAL, "question": "q", "answer": "a", "created_at": "2026-12-01T00:00:00Z"}
        ],
    }
    async with server.client() as client:
        assert (await post_archive(client, "full", json.dumps(archive).encode())).status_code == 200
        plain = await client.post("/v1/sessions/full/questions", json={"question": "one more?"})
        inline = await client.post(
            "/v1/sessions/full/questions",
            json={"question": "one more?", "snapshot": {"messages": [{"role": "user", "content": "hi"}]}},
        )
        routed = await client.post(  # through the FastAPI route rather than the fast path
            "/v1/sessions/full/questions",
            content=json.dumps({"question": "one more?"}).encode(),
            headers={"content-type": "application/vnd.api+json"},
        )
        for reply in (plain, inline, routed):
            assert reply.status_code == 409, reply.text
            assert reply.json()["error"]["code"] == "ordinals_exhausted"
        history = (await client.get("/v1/sessions/full/questions")).json()
    assert [r["ordinal"] for r in history["items"]] == [MAX_ORDINAL]
    async with db.sessions() as tx:
        assert await tx.scalar(select(func.count()).select_from(RequestRow)) == 1


async def test_archived_settings_written_as_integral_floats_restore_as_integers(server: Server) -> None:
    """JSON Schema counts 4096.0 as an integer, and so does restore (the settings' one rule); it is
    stored as the integer."""
    archive: dict[str, Any] = {
        "version": 3,
        "parent_id": "p",
        "questions": [],
        "session": {"settings": {"context_window": 4096.0, "max_output_tokens": 1024.0}},
    }
    async with server.client() as client:
        restored = await post_archive(client, "floats", json.dumps(archive).encode())
        assert restored.status_code == 200, restored.text
        settings = (await client.get("/v1/sessions/floats/settings")).json()
        exported = (await client.get("/v1/sessions/floats/archive", params={"version": 3})).json()
    assert (settings["context_window"], settings["max_output_tokens"]) == (4096, 1024)
    assert isinstance(settings["context_window"], int)
    assert exported["session"]["settings"]["context_window"] == 4096
    # A fractional number is still refused.
    archive["session"]["settings"]["context_window"] = 4096.5
    async with server.client() as client:
        refused = await post_archive(client, "floats-2", json.dumps(archive).encode())
    assert refused.status_code == 422
