"""SPEC §10, archives: export v1/v2/v3, restore, restore into a cleared session.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.e2e.contract.helpers import (
    SNAPSHOT,
    _long_transcript,
    ask,
    assert_error,
    new_parent,
    wait_for,
)
from tests.scripted_provider import ScriptedServer, Step


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
