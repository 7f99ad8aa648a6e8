"""SPEC §7, answering: output caps, stop reasons, usage, models, deadlines, the provider wire.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.contract.helpers import (
    SNAPSHOT,
    Limited,
    _long_transcript,
    ask,
    assert_error,
    events_of,
    new_parent,
    read_stream,
    wait_for,
)
from tests.scripted_provider import ScriptedServer, Step, Usage

CALL_FIELDS = {
    "purpose", "model", "status", "reported", "input_tokens", "output_tokens", "reasoning_tokens",
    "cached_tokens",
}  # fmt: skip


async def test_max_output_tokens_outside_256_32768_is_422_and_inside_caps_the_answer(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    path = f"/v1/sessions/{parent}/questions"
    for bad in (255, 32769, 0, -1):
        assert_error(await client.post(path, json={"question": "x", "max_output_tokens": bad}), 422)
    cases = [
        ({"max_output_tokens": 256}, 256),
        ({"max_output_tokens": 32768}, 32000),  # the snapshot's own cap (main cap) is lower
        ({"max_output_tokens": 20000, "main_max_output_tokens": 4000}, 4000),
        ({}, 8192),  # SIDEQUEST_MAX_OUTPUT_TOKENS default
    ]
    for options, expected in cases:
        record = await ask(client, parent, "Capped?", snapshot=SNAPSHOT, **options)
        done = await wait_for(client, record["id"])
        assert done["status"] == "succeeded", done["error"]
        assert done["context_info"]["max_output_tokens"] == expected, options
        calls = [r for r in scripted.requests("answer") if r.request_id == record["id"]]
        assert calls[-1].body["max_tokens"] == expected


async def test_usage_reports_tokens_and_one_entry_per_provider_call(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script(
        "answer", Step.text("Cached.", usage=Usage(1500, 40, cached_tokens=1024, reasoning_tokens=7))
    )
    record = await ask(client, new_parent(), "How much did it cost?", snapshot=SNAPSHOT)
    done = await wait_for(client, record["id"])
    usage = done["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (1500, 40)
    assert (usage["cached_tokens"], usage["reasoning_tokens"]) == (1024, 7)
    assert len(usage["calls"]) == 1
    call = usage["calls"][0]
    assert CALL_FIELDS <= set(call)
    assert (call["purpose"], call["model"], call["status"], call["reported"]) == (
        "answer",
        "scripted-model",
        "ok",
        True,
    )
    assert (call["input_tokens"], call["output_tokens"], call["cached_tokens"], call["reasoning_tokens"]) == (
        1500, 40, 1024, 7
    )  # fmt: skip
    assert done["context_info"]["provider_prompt_tokens"] == 1500
    _, stream = await read_stream(client, f"/v1/questions/{record['id']}/events")
    usage_events = [m.json()["usage"] for m in events_of(stream) if m.event == "usage"]
    assert usage_events and usage_events[-1] == usage


async def test_answer_cut_by_its_output_cap_succeeds_truncated_with_stop_reason_length(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.truncated("The answer was cut", chunks=2))
    done = await wait_for(client, (await ask(client, new_parent()))["id"])
    assert done["status"] == "succeeded"
    assert (done["truncated"], done["stop_reason"], done["answer"]) == (True, "length", "The answer was cut")


async def test_every_provider_call_carries_purpose_and_request_id_headers(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    big = dict(SNAPSHOT, messages=_long_transcript(60), context_window=None)
    record = await ask(client, new_parent(), "Headers?", snapshot=big, context_window=32000)
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    calls = scripted.requests(path="/v1/chat/completions")
    assert calls
    assert {c.purpose for c in calls} >= {"answer", "context_summary"}
    for call in calls:
        assert call.purpose in ("answer", "qa_summary", "context_summary")
        assert call.request_id == record["id"]
    assert len(done["usage"]["calls"]) == len(calls)
    # One cumulative usage event per provider call; progress tells the chunks and the cache outcome.
    _, stream = await read_stream(client, f"/v1/questions/{record['id']}/events")
    usages = [m.json()["usage"] for m in events_of(stream) if m.event == "usage"]
    assert [len(u["calls"]) for u in usages] == list(range(1, len(calls) + 1))
    assert usages[-1] == done["usage"]
    progress = [m.json() for m in events_of(stream) if m.event == "progress"]
    assert any(p.get("what") == "summary_chunk" and p["stage"] == "compacting_context" for p in progress)
    assert any(p.get("what") == "context_summary_cache" and p.get("cache") == "miss" for p in progress)
    stages = [m.json()["stage"] for m in events_of(stream) if m.event == "status"][1:-1]
    assert stages == ["preparing", "organizing_history", "compacting_context", "answering"]


@pytest.mark.parametrize(
    ("finish", "expected"),
    [("stop", "stop"), ("content_filter", "content_filter"), ("end_of_world", "end_of_world")],
)
async def test_stop_reason_is_normalised_or_kept_as_the_provider_sent_it(
    client: httpx.AsyncClient, scripted: ScriptedServer, finish: str, expected: str
) -> None:
    scripted.script("answer", Step.text("Some text.", finish=finish))
    done = await wait_for(client, (await ask(client, new_parent()))["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["stop_reason"] == expected


async def test_a_request_past_its_deadline_fails_with_timeout_and_its_stage(limited: Limited) -> None:
    limited.scripted.script("answer", Step.hang())
    async with limited.client() as http:
        record = await ask(http, new_parent())
        done = await wait_for(http, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "timeout", done["error"]
    assert done["error"]["detail"]["timeout_s"] == 1.5
    assert done["error"]["detail"]["stage"] == "answering"


async def test_anthropic_provider_counts_cached_input_and_normalises_stop_reasons(limited: Limited) -> None:
    limited.scripted.script(
        "answer",
        Step.text("Cached.", usage=Usage(1500, 40, cached_tokens=1024, cache_creation_tokens=100)),
        Step.truncated("Cut", usage=Usage(200, 10)),
    )
    async with limited.client() as http:
        parent = new_parent()
        cached = await wait_for(http, (await ask(http, parent, snapshot=SNAPSHOT))["id"])
        cut = await wait_for(http, (await ask(http, parent))["id"])
    assert cached["status"] == "succeeded", cached["error"]
    assert (cached["usage"]["input_tokens"], cached["usage"]["cached_tokens"]) == (1500, 1024)
    assert cached["usage"]["output_tokens"] == 40
    assert cached["stop_reason"] == "stop"
    assert (cut["status"], cut["truncated"], cut["stop_reason"]) == ("succeeded", True, "length")
    calls = limited.scripted.requests(path="/v1/messages")
    assert calls and all(
        c.purpose in ("answer", "qa_summary", "context_summary") and c.request_id for c in calls
    )


async def test_a_requested_model_is_used_for_the_call_and_recorded(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    record = await ask(client, new_parent(), "Which model?", model="other-model")
    assert record["model"] == "other-model"
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["model"] == "other-model"
    assert [c["model"] for c in done["usage"]["calls"]] == ["other-model"]
    assert [r.body["model"] for r in scripted.requests("answer") if r.request_id == record["id"]] == [
        "other-model"
    ]


async def test_openai_style_snapshots_are_accepted_and_sent_with_their_tools_and_tool_choice_none(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    snapshot = {
        "system": "You are a coding agent.",
        "tools": [{"name": "grep", "description": "Search.", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Find the bug."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "billing/invoice.py:12"},
        ],
    }
    record = await ask(client, new_parent(), "Where?", snapshot=snapshot)
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    body = next(r.body for r in scripted.requests("answer") if r.request_id == record["id"])
    assert body["tool_choice"] == "none"
    assert [t["function"]["name"] for t in body["tools"]] == ["grep"]
    sent = body["messages"]
    assert sent[0] == {"role": "system", "content": "You are a coding agent."}
    assert sent[2]["tool_calls"][0]["id"] == "c1"
    assert sent[3] == {"role": "tool", "tool_call_id": "c1", "content": "billing/invoice.py:12"}
    assert sent[-1]["role"] == "user" and "Where?" in json.dumps(sent[-1])

    plain = await ask(client, new_parent(), "No snapshot at all?")
    assert (await wait_for(client, plain["id"]))["status"] == "succeeded"
    plain_body = next(r.body for r in scripted.requests("answer") if r.request_id == plain["id"])
    assert "tools" not in plain_body


async def test_usage_the_provider_did_not_report_is_zero_and_reported_false(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.text("No usage sent."))
    done = await wait_for(client, (await ask(client, new_parent(), snapshot=SNAPSHOT))["id"])
    assert done["status"] == "succeeded", done["error"]
    (call,) = done["usage"]["calls"]
    assert (call["status"], call["reported"]) == ("ok", False)
    assert [call[k] for k in ("input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens")] == [
        0
    ] * 4
    assert done["usage"]["input_tokens"] == 0 and done["usage"]["output_tokens"] == 0
    assert done["context_info"]["provider_prompt_tokens"] is None
    assert done["context_info"]["estimate"]["total"] > 0  # the estimate stands on its own
