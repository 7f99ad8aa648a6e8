"""SPEC §5 and §6, budget and preparation: the window, replay, rolling and context summaries.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.e2e.contract.helpers import (
    SNAPSHOT,
    Limited,
    _long_transcript,
    ask,
    new_parent,
    wait_for,
)
from tests.scripted_provider import ScriptedServer, Step, Usage


async def test_window_comes_from_request_then_snapshot_and_sets_margin_and_input_budget(
    client: httpx.AsyncClient,
) -> None:
    parent = new_parent()
    snapshot = dict(SNAPSHOT, context_window=100000)
    from_snapshot = await wait_for(client, (await ask(client, parent, snapshot=snapshot))["id"])
    info = from_snapshot["context_info"]
    assert (info["window"], info["safety_margin"], info["max_output_tokens"]) == (100000, 5000, 8192)
    assert info["input_budget"] == 100000 - 8192 - 5000
    from_request = await wait_for(
        client, (await ask(client, parent, snapshot=snapshot, context_window=150000))["id"]
    )
    assert from_request["context_info"]["window"] == 150000
    assert from_request["context_info"]["safety_margin"] == 7500


async def test_summary_call_failures_fail_the_request_with_their_code_and_detail(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    # Truncated twice (first attempt, then the one retry with the 8192 cap) → summary_truncated.
    scripted.script("context_summary", Step.truncated('{"objective": '), Step.truncated('{"objective": '))
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    record = await ask(client, new_parent(), "Compaction fails?", snapshot=big, context_window=32000)
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "summary_truncated", done["error"]
    assert done["error"]["detail"]["max_output_tokens"] == 8192
    assert done["error"]["detail"]["stop_reason"] == "length"
    caps = [
        r.body["max_tokens"] for r in scripted.requests("context_summary") if r.request_id == record["id"]
    ]
    assert caps == [2048, 8192]
    assert not scripted.requests("answer")


async def test_context_summaries_are_cached_by_content_hit_prefix_and_miss(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    base = dict(SNAPSHOT, messages=_long_transcript(60), context_window=32000)
    extended = dict(base, messages=_long_transcript(64))
    changed = dict(
        base, messages=[{"role": "user", "content": "A different beginning."}, *_long_transcript(60)[1:]]
    )
    for snapshot_id, content in (("base", base), ("extended", extended), ("changed", changed)):
        assert (
            await client.put(f"/v1/sessions/{parent}/snapshots/{snapshot_id}", json=content)
        ).status_code == 201

    async def run(snapshot_id: str) -> tuple[dict[str, Any], int]:
        record = await ask(client, parent, f"About {snapshot_id}?", snapshot_id=snapshot_id)
        done = await wait_for(client, record["id"])
        assert done["status"] == "succeeded", done["error"]
        calls = [r for r in scripted.requests("context_summary") if r.request_id == record["id"]]
        return done["context_info"]["context_summary"], len(calls)

    first, first_calls = await run("base")
    assert first["used"] is True and first["cache"] == "miss" and first_calls >= 1
    again, again_calls = await run("base")
    assert again["cache"] == "hit" and again_calls == 0
    longer, _ = await run("extended")
    assert longer["cache"] in ("prefix", "hit")
    other, other_calls = await run("changed")
    assert other["cache"] == "miss" and other_calls >= 1
    keys = [
        e["key"] for e in (await client.get(f"/v1/sessions/{parent}")).json()["memory"]["context_summaries"]
    ]
    assert len(keys) == len(set(keys)) >= 2


async def test_at_most_20_groups_are_replayed_and_older_ones_fold_into_the_rolling_summary(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    # 1 running + 20 queued is within the limit; they run one at a time, in ordinal order.
    records = [await ask(client, parent, f"Earlier question {n}?") for n in range(1, 22)]
    for record in records:
        assert (await wait_for(client, record["id"], within_s=30))["status"] == "succeeded"
    last = await ask(client, parent, "And the 22nd?")
    done = await wait_for(client, last["id"])
    assert done["status"] == "succeeded", done["error"]
    info = done["context_info"]
    assert info["replayed_groups"] == 20 and info["replayed_ordinals"] == [2, 21]
    assert info["qa_summary"]["used"] is True and info["qa_summary"]["covered_through_ordinal"] == 1
    # Group 1 was folded into the summary either by this request itself or — background summaries
    # being on by default (SPEC 6.6) — by the job the 21st answer queued; made_by says which.
    own = [r for r in scripted.requests("qa_summary") if r.request_id == last["id"]]
    if info["qa_summary"]["made_by"] == "request":
        assert own
    else:
        assert info["qa_summary"]["made_by"] == "background" and not own
        assert [r for r in scripted.requests("qa_summary") if "x-sidequest-job-id" in r.headers]
    orders = [(await client.get(f"/v1/questions/{r['id']}")).json()["started_at"] for r in records]
    assert orders == sorted(orders)


async def test_a_summary_plan_beyond_the_call_cap_fails_before_spending_calls(limited: Limited) -> None:
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    async with limited.client() as http:
        record = await ask(http, new_parent(), "Too many chunks?", snapshot=big, context_window=24000)
        done = await wait_for(http, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "summary_call_cap", done["error"]
    detail = done["error"]["detail"]
    assert detail["calls_made"] == 0 and detail["calls_needed"] > 1
    assert not limited.scripted.requests("context_summary")
    assert not limited.scripted.requests("answer")


_LONG_SUMMARY = {
    "objective": "o",
    "state": "s",
    "decisions": ["A decision that goes on and on. " * 60] * 32,
    "open_work": [],
    "risks": [],
}


@pytest.mark.parametrize(
    ("steps", "code"),
    [
        ((Step.tool_call("grep"),), "summary_tool_call"),
        ((Step.empty(), Step.reasoning_only("thinking")), "summary_empty"),
        ((Step.invalid_summary(), Step.invalid_summary()), "summary_invalid"),
        ((Step.valid_summary(_LONG_SUMMARY), Step.valid_summary(_LONG_SUMMARY)), "summary_too_long"),
        ((Step.server_error(500),), "provider_error"),
    ],
    ids=["tool_call", "empty", "invalid", "too_long", "provider_error"],
)
async def test_a_failing_context_summary_fails_the_request_with_its_code(
    client: httpx.AsyncClient, scripted: ScriptedServer, steps: tuple[Step, ...], code: str
) -> None:
    scripted.script("context_summary", *steps)
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    record = await ask(client, new_parent(), "Compaction fails?", snapshot=big, context_window=32000)
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == code, done["error"]
    calls = [r for r in scripted.requests("context_summary") if r.request_id == record["id"]]
    assert len(calls) == len(steps)  # a tool call or provider error fails at once; others retry once
    if code == "summary_too_long":
        assert done["error"]["detail"]["limit"] == 2200 and done["error"]["detail"]["body_tokens"] > 2200
    assert not [r for r in scripted.requests("answer") if r.request_id == record["id"]]
    memory = (await client.get(f"/v1/sessions/{record['parent_id']}")).json()["memory"]
    assert memory["context_summaries"] == []  # nothing unvalidated is cached


async def test_an_invalid_summary_is_retried_once_with_the_larger_cap_and_then_used(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("context_summary", Step.invalid_summary(), Step.valid_summary())
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    record = await ask(client, new_parent(), "Retried?", snapshot=big, context_window=32000)
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    caps = [
        r.body["max_tokens"] for r in scripted.requests("context_summary") if r.request_id == record["id"]
    ]
    assert caps[:2] == [2048, 8192]
    assert done["context_info"]["summary_calls"] == len(caps)
    # Compacted layout: system, the context summary, then the kept messages unchanged, then the question.
    kept = done["context_info"]["context_summary"]["kept_messages"]
    assert kept > 0
    body = [r for r in scripted.requests("answer") if r.request_id == record["id"]][-1].body
    sent = body["messages"]
    assert sent[0] == {"role": "system", "content": SNAPSHOT["system"]}
    assert [m["content"] for m in sent[-1 - kept : -1]] == [m["content"] for m in big["messages"][-kept:]]
    assert record["question"] in json.dumps(sent[-1])


async def test_replayed_qa_is_capped_at_a_quarter_of_the_input_budget(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    scripted.set_default(
        "answer", Step.text("A long earlier answer about invoices. " * 80, usage=Usage(100, 900))
    )
    for n in range(4):
        await wait_for(client, (await ask(client, parent, f"Earlier {n}?"))["id"])
    scripted.reset()
    done = await wait_for(client, (await ask(client, parent, "Now?", context_window=20000))["id"])
    assert done["status"] == "succeeded", done["error"]
    info = done["context_info"]
    limit = min(info["input_budget"] // 4, 16000)
    assert info["estimate"]["qa_raw"] <= limit
    assert 1 <= info["replayed_groups"] < 4
    assert info["qa_summary"]["used"] is True
    assert info["qa_summary"]["covered_through_ordinal"] == 4 - info["replayed_groups"]
