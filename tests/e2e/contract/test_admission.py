"""SPEC §3, questions: admission, idempotency, records, history pages, path ids.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import uuid
from urllib.parse import quote

import httpx

from tests.e2e.contract.helpers import (
    SNAPSHOT,
    ask,
    assert_error,
    new_parent,
    parse_utc,
    wait_for,
)
from tests.scripted_provider import ScriptedServer

RECORD_FIELDS = {
    "id", "parent_id", "ordinal", "question", "status", "stage", "answer", "truncated", "stop_reason",
    "error", "usage", "context_info", "model", "snapshot_id", "attempt", "created_at", "started_at",
    "finished_at",
}  # fmt: skip
USAGE_FIELDS = {"input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens", "calls"}


CONTEXT_INFO_FIELDS = {
    "stage", "window", "max_output_tokens", "safety_margin", "input_budget", "estimate", "pressure",
    "replayed_groups", "replayed_ordinals", "qa_summary", "context_summary", "summary_calls",
    "overflow_retries", "provider_prompt_tokens", "drift",
}  # fmt: skip
ESTIMATE_FIELDS = {"system", "tools", "context", "qa_summary", "qa_raw", "question", "envelope", "total"}


async def test_post_returns_202_queued_record_with_every_spec_field(client: httpx.AsyncClient) -> None:
    parent = new_parent()
    response = await client.post(f"/v1/sessions/{parent}/questions", json={"question": "Which file?"})
    assert response.status_code == 202
    record = response.json()
    assert RECORD_FIELDS <= set(record), RECORD_FIELDS - set(record)
    assert record["status"] == "queued"
    assert record["parent_id"] == parent and record["ordinal"] == 1 and record["question"] == "Which file?"
    assert record["answer"] is None and record["error"] is None and record["snapshot_id"] is None
    assert record["started_at"] is None and record["finished_at"] is None
    parse_utc(record["created_at"])
    assert uuid.UUID(record["id"])
    await wait_for(client, record["id"])


async def test_idempotency_key_replays_same_body_with_200_and_refuses_other_body_with_409(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    path = f"/v1/sessions/{parent}/questions"
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    first = await client.post(path, json={"question": "Once?"}, headers=key)
    assert first.status_code == 202
    again = await client.post(path, json={"question": "Once?"}, headers=key)
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"] and again.json()["ordinal"] == 1
    other = await client.post(path, json={"question": "Twice?"}, headers=key)
    assert_error(other, 409)
    await wait_for(client, first.json()["id"])
    page = (await client.get(path)).json()
    assert [item["ordinal"] for item in page["items"]] == [1]


async def test_history_pages_are_ascending_with_has_more_next_before_and_limit_bounds(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    ids = [(await ask(client, parent, f"Question {n}?"))["id"] for n in range(1, 6)]
    for rid in ids:
        await wait_for(client, rid)
    path = f"/v1/sessions/{parent}/questions"

    newest = (await client.get(path, params={"limit": 2})).json()
    assert [i["ordinal"] for i in newest["items"]] == [4, 5]
    assert newest["has_more"] is True and newest["next_before"] == 4
    middle = (await client.get(path, params={"limit": 2, "before": newest["next_before"]})).json()
    assert [i["ordinal"] for i in middle["items"]] == [2, 3]
    assert middle["has_more"] is True and middle["next_before"] == 2
    oldest = (await client.get(path, params={"limit": 2, "before": 2})).json()
    assert [i["ordinal"] for i in oldest["items"]] == [1]
    assert oldest["has_more"] is False and oldest["next_before"] is None
    everything = (await client.get(path)).json()
    assert [i["ordinal"] for i in everything["items"]] == [1, 2, 3, 4, 5]
    assert everything["has_more"] is False and everything["next_before"] is None
    assert RECORD_FIELDS <= set(everything["items"][0])

    assert (await client.get(path, params={"limit": 1})).status_code == 200
    assert (await client.get(path, params={"limit": 100})).status_code == 200
    assert_error(await client.get(path, params={"limit": 0}), 422)
    assert_error(await client.get(path, params={"limit": 101}), 422)
    assert_error(await client.get(f"/v1/sessions/{new_parent()}/questions"), 404)


async def test_record_reports_answer_usage_context_info_and_ordered_timings(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    record = await ask(client, parent, "Which file is being edited?", snapshot=SNAPSHOT)
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["answer"] == "Scripted answer."
    assert done["truncated"] is False and done["stop_reason"] == "stop" and done["error"] is None
    assert done["model"] == "scripted-model"
    assert done["attempt"] >= 1
    created, started, finished = (parse_utc(done[k]) for k in ("created_at", "started_at", "finished_at"))
    assert created <= started <= finished
    assert USAGE_FIELDS <= set(done["usage"])
    info = done["context_info"]
    assert CONTEXT_INFO_FIELDS <= set(info), CONTEXT_INFO_FIELDS - set(info)
    assert ESTIMATE_FIELDS <= set(info["estimate"])
    assert {"used", "covered_through_ordinal", "updated", "calls"} <= set(info["qa_summary"])
    assert {"used", "cache", "summarized_messages", "kept_messages", "calls", "chunks"} <= set(
        info["context_summary"]
    )
    assert info["pressure"] in ("normal", "tight", "critical")
    assert info["window"] == 200000
    assert info["input_budget"] == info["window"] - info["max_output_tokens"] - info["safety_margin"]
    assert info["safety_margin"] == 8192  # 5 % of 200000 is 10000, capped at 8192


async def test_path_ids_may_hold_spaces_unicode_percent_and_question_marks(client: httpx.AsyncClient) -> None:
    suffix = uuid.uuid4().hex[:8]
    for parent in (f"task 7 {suffix}", f"タスク-{suffix}", f"a%b-{suffix}", f"x?y#z-{suffix}"):
        encoded = quote(parent, safe="")
        record = (await client.post(f"/v1/sessions/{encoded}/questions", json={"question": "q"})).json()
        assert record["parent_id"] == parent
        assert (await client.get(f"/v1/sessions/{encoded}")).json()["parent_id"] == parent
        put = await client.put(f"/v1/sessions/{encoded}/snapshots/{encoded}", json=SNAPSHOT)
        assert put.status_code == 201 and put.json()["snapshot_id"] == parent
        await wait_for(client, record["id"])
    # docs/api.md, Decisions: a '/' cannot be part of an id, even percent-encoded.
    assert_error(await client.post("/v1/sessions/org%2Ftask/questions", json={"question": "q"}), 404)
