"""SPEC §3, sessions: snapshots (immutable, inline, content-hashed) and the session overview.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import re

import httpx

from tests.e2e.contract.helpers import (
    SNAPSHOT,
    _long_transcript,
    ask,
    assert_error,
    new_parent,
    parse_utc,
    wait_for,
)
from tests.scripted_provider import ScriptedServer, Step


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


async def test_inline_snapshot_with_a_taken_id_and_other_content_is_409_and_writes_nothing(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    assert (await client.put(f"/v1/sessions/{parent}/snapshots/s-1", json=SNAPSHOT)).status_code == 201
    other = {**SNAPSHOT, "system": "Changed.", "snapshot_id": "s-1"}
    refused = await client.post(f"/v1/sessions/{parent}/questions", json={"question": "x", "snapshot": other})
    assert_error(refused, 409)
    assert (await client.get(f"/v1/sessions/{parent}")).json()["next_ordinal"] == 1
