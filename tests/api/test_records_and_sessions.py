"""History pages, one record, the session overview."""

from __future__ import annotations

import uuid

from sqlalchemy import update

from service.store.db import Database
from service.store.models import SessionRow
from tests.api.conftest import TOKENS, Server, StartServer
from tests.api.helpers import ask


async def test_history_pages_newest_first_pages_in_ascending_order(server: Server) -> None:
    async with server.client() as client:
        for i in range(7):
            await ask(client, "p-hist", f"q{i + 1}")
        page = (await client.get("/v1/sessions/p-hist/questions", params={"limit": 3})).json()
        assert [r["ordinal"] for r in page["items"]] == [5, 6, 7]
        assert page["has_more"] is True and page["next_before"] == 5
        page = (await client.get("/v1/sessions/p-hist/questions", params={"limit": 3, "before": 5})).json()
        assert [r["ordinal"] for r in page["items"]] == [2, 3, 4] and page["next_before"] == 2
        page = (await client.get("/v1/sessions/p-hist/questions", params={"limit": 3, "before": 2})).json()
        assert [r["ordinal"] for r in page["items"]] == [1]
        assert page["has_more"] is False and page["next_before"] is None
        default = (await client.get("/v1/sessions/p-hist/questions")).json()
        assert [r["ordinal"] for r in default["items"]] == list(range(1, 8)) and default["has_more"] is False
        for bad in ({"limit": 0}, {"limit": 101}, {"before": 0}, {"limit": "x"}):
            response = await client.get("/v1/sessions/p-hist/questions", params=bad)
            assert response.status_code == 422 and response.json()["error"]["code"] == "validation_error"
        assert (await client.get("/v1/sessions/nobody/questions")).status_code == 404


async def test_record_endpoint_and_unknown_ids(server: Server) -> None:
    async with server.client() as client:
        record = await ask(client, "p-rec", "what?")
        got = await client.get(f"/v1/questions/{record['id']}")
        assert got.status_code == 200 and got.json() == record
        for missing in (str(uuid.uuid4()), "not-a-uuid"):
            response = await client.get(f"/v1/questions/{missing}")
            assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
        assert (await client.get("/v1/nothing-here")).json()["error"]["code"] == "not_found"


async def test_session_overview_counts_and_memory(server: Server, db: Database) -> None:
    async with server.client() as client:
        assert (await client.get("/v1/sessions/p-ov")).status_code == 404
        await ask(client, "p-ov")
        await ask(client, "p-ov")
        memory = {
            "qa_summary": {
                "first_ordinal": 9,
                "covered_through_ordinal": 12,
                "tokens": 340,
                "updated_at": "2026-11-29T10:00:00.000000Z",
                "document": {"objective": "secret text is not shown"},
            },
            "context_summaries": [
                {
                    "key": "abc",
                    "snapshot_id": "s-1",
                    "covered_messages": 40,
                    "tokens": 900,
                    "created_at": "2026-11-29T10:00:00.000000Z",
                    "document": {"objective": "hidden"},
                }
            ],
        }
        async with db.sessions() as tx:
            await tx.execute(update(SessionRow).where(SessionRow.parent_id == "p-ov").values(memory=memory))
            await tx.commit()
        body = (await client.get("/v1/sessions/p-ov")).json()
        assert body["parent_id"] == "p-ov" and body["clear_version"] == 0 and body["next_ordinal"] == 3
        assert body["counts"] == {"queued": 2, "running": 0, "succeeded": 0, "failed": 0, "cancelled": 0}
        assert body["memory"] == {
            "qa_summary": {
                "first_ordinal": 9,
                "covered_through_ordinal": 12,
                "tokens": 340,
                "updated_at": "2026-11-29T10:00:00.000000Z",
            },
            "context_summaries": [
                {
                    "key": "abc",
                    "snapshot_id": "s-1",
                    "covered_messages": 40,
                    "tokens": 900,
                    "created_at": "2026-11-29T10:00:00.000000Z",
                }
            ],
        }


async def test_same_parent_id_in_two_tenants_is_two_sessions(start_server: StartServer) -> None:
    server = await start_server(api_tokens=TOKENS)
    async with server.client("tok-acme") as acme, server.client("tok-globex") as globex:
        a = await ask(acme, "shared")
        await ask(acme, "shared")
        g = await ask(globex, "shared")
        assert (a["ordinal"], g["ordinal"]) == (1, 1)
        assert (await acme.get("/v1/sessions/shared")).json()["counts"]["queued"] == 2
        assert (await globex.get("/v1/sessions/shared")).json()["counts"]["queued"] == 1
