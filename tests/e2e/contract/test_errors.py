"""SPEC §8 and §3's limits: the error envelope on every status, size and queue limits.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import json
import uuid

import httpx

from tests.e2e.contract.helpers import (
    ask,
    assert_error,
    hang_and_wait_running,
    new_parent,
    wait_for,
)
from tests.scripted_provider import ScriptedServer


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
