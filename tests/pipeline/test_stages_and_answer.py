"""The pipeline end to end against the scripted server: stages, events, ledger, answer outcomes."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from service.config import Settings
from service.pipeline.runtime import RequestRuntime
from service.providers import build_provider
from service.providers.base import Provider
from service.store import ledger, terminal
from service.store.db import Database, DatabaseUnavailable
from tests.factories import add_history, add_snapshot, admit, fail_once, make_session
from tests.pipeline.conftest import run_one
from tests.scripted_provider import ScriptedServer, Step, Usage

SNAPSHOT: dict[str, Any] = {
    "taken_at": "2026-11-29T10:00:00Z",
    "system": "You are the main agent.",
    "tools": [{"name": "grep", "description": "search", "input_schema": {"type": "object"}}],
    "messages": [
        {"role": "user", "content": "Fix the flaky test in tests/test_io.py"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "t1", "name": "grep", "input": {"q": "flaky"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "test_io.py:12"}],
        },
    ],
    "context_window": 100000,
    "max_output_tokens": 4000,
}


async def test_success_walks_the_stages_and_ends_with_done(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db, "parent-ok")
    await add_snapshot(db, sid, "s1", SNAPSHOT)
    rid = await admit(db, sid, "Which file is flaky?", snapshot_id="s1")
    server.script(
        "answer", Step.text("It is tests/test_io.py.", chunks=4, usage=Usage(500, 7, cached_tokens=300))
    )

    ran = await run_one(db, model_settings, provider, rid)

    assert ran.outcome.status == "succeeded"
    assert ran.stages() == ["preparing", "organizing_history", "answering"]
    assert ran.types()[-2:] == ["status", "done"]
    assert ran.events[-2].data["status"] == "succeeded"
    assert "".join(d["text"] for d in ran.of("delta")) == "It is tests/test_io.py."
    # The answer's text is all written before the usage event of its call.
    types = ran.types()
    assert max(i for i, t in enumerate(types) if t == "delta") < types.index("usage")
    record = ran.of("done")[0]["record"]
    assert record["answer"] == "It is tests/test_io.py." and record["truncated"] is False
    assert record["stop_reason"] == "stop" and record["parent_id"] == "parent-ok"
    # Nothing was compacted: every message of the snapshot went verbatim, and kept_messages counts them.
    context = record["context_info"]["context_summary"]
    assert context["used"] is False and context["summarized_messages"] == 0
    assert context["kept_messages"] == len(SNAPSHOT["messages"])
    usage = ran.of("usage")[-1]["usage"]
    assert usage["input_tokens"] == 500 and usage["cached_tokens"] == 300 and usage["output_tokens"] == 7
    assert [(c["purpose"], c["status"], c["reported"]) for c in usage["calls"]] == [("answer", "ok", True)]
    assert ran.row.usage == usage

    info = ran.row.context_info
    # window from the snapshot, output cap = min(config 8192, snapshot's 4000), 5 % margin.
    assert (info["window"], info["max_output_tokens"], info["safety_margin"]) == (100000, 4000, 5000)
    assert info["input_budget"] == 100000 - 4000 - 5000
    assert set(info["estimate"]) == {
        "system",
        "tools",
        "context",
        "qa_summary",
        "qa_raw",
        "question",
        "envelope",
        "total",
    }
    assert info["pressure"] == "normal" and info["stage"] == "answering"
    assert info["provider_prompt_tokens"] == 500
    assert info["drift"] == 500 - info["estimate"]["total"]
    assert info["context_summary"]["cache"] == "none" and info["overflow_retries"] == 0

    sent = server.requests("answer")[0]
    assert sent.headers["x-sidequest-request-id"] == str(rid)
    assert sent.body["max_tokens"] == 4000 and sent.body["tool_choice"] == "none"
    assert sent.body["messages"][0] == {"role": "system", "content": "You are the main agent."}
    assert "Which file is flaky?" in str(sent.body["messages"][-1])


async def succeed_on_anthropic(
    db: Database, settings: Settings, server: ScriptedServer, sid: uuid.UUID, question: str
) -> None:
    """Ask ``question`` on snapshot ``s1`` of session ``sid`` through the Anthropic wire (the scripted
    server's /v1/messages) and run it to success."""
    anthropic_settings = settings.model_copy(update={"provider": "anthropic", "base_url": server.root_url})
    anthropic = build_provider(anthropic_settings)
    try:
        rid = await admit(db, sid, question, snapshot_id="s1")
        assert (await run_one(db, anthropic_settings, anthropic, rid)).outcome.status == "succeeded"
    finally:
        await anthropic.aclose()


async def test_a_system_prompt_of_blocks_reaches_anthropic_as_posted_and_openai_as_its_text(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    """SPEC §7: the answer starts with the snapshot's own system prompt exactly as the main session had
    it, so its prefix cache serves the side question. Anthropic takes blocks: they go as posted, their
    cache_control breakpoints included; joined into one string they would lose the breakpoints."""
    blocks = [
        {"type": "text", "text": "You are the main agent."},
        {"type": "text", "text": "Project rules.", "cache_control": {"type": "ephemeral"}},
    ]
    sid = await make_session(db, "parent-blocks")
    await add_snapshot(db, sid, "s1", {**SNAPSHOT, "system": blocks})
    await succeed_on_anthropic(db, model_settings, server, sid, "Which file?")
    assert server.requests("answer")[-1].body["system"] == blocks

    rid = await admit(db, sid, "Which file, again?", snapshot_id="s1")
    assert (await run_one(db, model_settings, provider, rid)).outcome.status == "succeeded"
    first = server.requests("answer")[-1].body["messages"][0]
    assert first == {"role": "system", "content": "You are the main agent.\nProject rules."}


async def test_openai_style_messages_and_tools_reach_an_openai_provider_exactly_as_posted(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    """SPEC §7: the snapshot's messages and tools go first, exactly as the main session had them.
    Byte for byte: re-encoding a tool call's compact arguments ({"pattern":"foo"} → {"pattern":
    "foo"}, 1e3 → 1000.0), joining content parts into strings or dropping a tool's "strict" would
    stop the provider's prefix cache from matching at the first tool call."""
    tools: list[dict[str, Any]] = [
        {
            "type": "function",
            "function": {
                "name": "grep",
                "description": "search",
                "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}},
                "strict": True,
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You are the main agent."},
        {"role": "user", "content": "Find the bug."},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Searching."}],
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "grep", "arguments": '{"pattern":"foo","n":1e3}'},  # compact
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a.py:3: foo"}]},
    ]
    sid = await make_session(db, "parent-openai")
    await add_snapshot(db, sid, "s1", {"tools": tools, "messages": messages})
    rid = await admit(db, sid, "Which file?", snapshot_id="s1")
    assert (await run_one(db, model_settings, provider, rid)).outcome.status == "succeeded"
    body = server.requests("answer")[-1].body
    assert body["tools"] == tools
    assert body["messages"][:4] == messages  # the system message is the snapshot's own, then the rest
    # The trailing tool message stays as posted; Sidequest's final turn follows it as its own message.
    assert body["messages"][4]["role"] == "user" and "Which file?" in json.dumps(body["messages"][4])
    assert len(body["messages"]) == 5

    # The same snapshot on the Anthropic wire: canonical blocks, nothing of the posted form.
    await succeed_on_anthropic(db, model_settings, server, sid, "Which file, again?")
    body = server.requests("answer")[-1].body
    assert "_sidequest_posted" not in json.dumps(body)
    assert body["tools"] == [
        {"name": "grep", "description": "search", "input_schema": tools[0]["function"]["parameters"]}
    ]
    assert body["messages"][1]["content"][1] == {
        "type": "tool_use",
        "id": "c1",
        "name": "grep",
        "input": {"pattern": "foo", "n": 1000.0},
    }


# asyncpg's command timeout is a bare TimeoutError (a statement stuck on a primary being killed): long
# before the request's own deadline it is the database gone too, never "did not finish within its deadline".
@pytest.mark.parametrize("refusal", [DatabaseUnavailable("connection dropped"), TimeoutError()], ids=repr)
async def test_an_answer_whose_success_the_database_refused_keeps_its_call_in_the_ledger(
    db: Database,
    model_settings: Settings,
    provider: Provider,
    server: ScriptedServer,
    monkeypatch: pytest.MonkeyPatch,
    refusal: Exception,
) -> None:
    """SPEC §9: usage already recorded is kept when the request is run again. The case: an answer
    that finished right after a PostgreSQL restart has its success refused on a dropped connection;
    its call's usage must not ride on that one commit, or it is lost."""
    sid = await make_session(db, "parent-outage")
    await add_snapshot(db, sid, "s1", SNAPSHOT)
    rid = await admit(db, sid, "Which file?", snapshot_id="s1")
    server.script("answer", Step.text("It is io.", usage=Usage(120, 9)))
    fail_once(monkeypatch, terminal, "finish_succeeded", refusal)
    ran = await run_one(db, model_settings, provider, rid)
    # Written nothing else: run again once the lease expires.
    assert ran.outcome.status == "lost" and ran.row.status == "running" and ran.row.error is None
    calls = [(c["purpose"], c["status"], c["input_tokens"]) for c in ran.row.usage["calls"]]
    assert calls == [("answer", "ok", 120)]


async def test_a_call_whose_ledger_write_meets_a_dropped_connection_is_written_on_the_next_try(
    db: Database,
    model_settings: Settings,
    provider: Provider,
    server: ScriptedServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pooled connection dropped by a PostgreSQL restart fails its first use: the ledger write is
    tried again over a fresh one (tokens were spent), and the request goes on."""
    sid = await make_session(db, "parent-retry")
    await add_history(db, sid, [(f"q{i}", f"a{i}") for i in range(1, 22)])  # a Q&A fold first
    rid = await admit(db, sid, "Still there?")
    failures = fail_once(monkeypatch, ledger, "append_calls")
    ran = await run_one(db, model_settings, provider, rid)
    assert failures == [1] and ran.outcome.status == "succeeded"
    assert [c["purpose"] for c in ran.row.usage["calls"]] == ["qa_summary", "answer"]


async def test_a_refused_answers_call_is_written_even_when_its_last_text_meets_the_database_away(
    db: Database,
    model_settings: Settings,
    provider: Provider,
    server: ScriptedServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When an answer is refused before its success (a tool call) and its buffered text cannot
    be written because the database is away, the held call (tokens spent) must still be written."""
    rid = await admit(db, await make_session(db), "q")
    server.script("answer", Step.tool_call("grep", text="Let me look", usage=Usage(40, 3)))
    real = RequestRuntime.emit_delta

    async def away(self: RequestRuntime, text: str) -> bool:
        if text:
            raise DatabaseUnavailable("connection dropped")
        return await real(self, text)

    monkeypatch.setattr(RequestRuntime, "emit_delta", away)
    ran = await run_one(db, model_settings, provider, rid)
    assert [(c["purpose"], c["status"], c["input_tokens"]) for c in ran.row.usage["calls"]] == [
        ("answer", "ok", 40)
    ]


async def test_each_call_records_its_latency_for_the_metrics(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    rid = await admit(db, await make_session(db), "Slow model?")
    server.script("answer", Step.text("yes", usage=Usage(5, 1)).with_delay(before_s=0.3))
    ran = await run_one(db, model_settings, provider, rid)
    [call] = ran.row.usage["calls"]
    assert 300 <= call["latency_ms"] < 5000


async def test_truncated_answer_succeeds_with_truncated_and_stop_reason(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    rid = await admit(db, await make_session(db), "Explain everything")
    server.script("answer", Step.truncated("A long answer that was cut", usage=Usage(50, 256)))
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.outcome.status == "succeeded"
    assert ran.row.truncated is True and ran.row.stop_reason == "length"
    assert ran.row.answer == "A long answer that was cut"


async def test_answer_tool_call_fails_with_answer_tool_call(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    rid = await admit(db, await make_session(db), "q")
    server.script("answer", Step.tool_call("grep", usage=Usage(40, 3)))
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.status == "failed"
    assert ran.row.error is not None and ran.row.error["code"] == "answer_tool_call"
    assert ran.row.error["detail"]["tool"] == "grep"
    assert ran.types()[-2:] == ["status", "error"]
    assert ran.row.usage["calls"][0]["status"] == "ok"


async def test_missing_snapshot_fails_before_any_call(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    rid = await admit(db, await make_session(db), "q", snapshot_id="nope")
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "snapshot_missing"
    assert ran.row.error["detail"] == {"snapshot_id": "nope"}
    assert server.requests() == []


async def test_rate_limit_retried_twice_then_rate_limited_with_every_call_recorded(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    rid = await admit(db, await make_session(db), "q")
    server.script("answer", *(Step.rate_limited(retry_after="0") for _ in range(3)))
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "rate_limited"
    assert ran.row.error["detail"] == {"status": 429, "attempts": 3}
    assert [(c["status"], c["reported"]) for c in ran.row.usage["calls"]] == [("failed", False)] * 3
    assert len(server.requests("answer")) == 3


async def test_whole_request_deadline_fails_with_timeout_and_stage(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    settings = model_settings.model_copy(update={"request_timeout_s": 1.0})
    rid = await admit(db, await make_session(db), "q")
    server.script("answer", Step.hang(text="partial "))
    started = time.monotonic()
    ran = await run_one(db, settings, provider, rid)
    assert time.monotonic() - started < 3.0
    assert ran.row.error is not None and ran.row.error["code"] == "timeout"
    assert ran.row.error["detail"] == {"timeout_s": 1.0, "stage": "answering"}
    assert ran.row.usage["calls"][-1]["status"] == "failed"
    # What streamed before the deadline was delivered, then the error ends the stream.
    assert "".join(d["text"] for d in ran.of("delta")) == "partial "
    assert ran.types()[-1] == "error"


async def test_deltas_are_coalesced_to_at_most_about_20_per_second(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    text = "".join(f"w{i} " for i in range(200))
    rid = await admit(db, await make_session(db), "q")
    server.script("answer", Step.text(text, chunks=200, usage=Usage(10, 200)).with_delay(between_s=0.004))
    started = time.monotonic()
    ran = await run_one(db, model_settings, provider, rid)
    elapsed = time.monotonic() - started
    deltas = ran.of("delta")
    assert "".join(d["text"] for d in deltas) == text == ran.row.answer
    assert 2 <= len(deltas) <= elapsed * 20 + 2
    stamps = [e.id for e in ran.events if e.type == "delta"]
    assert stamps == sorted(stamps)


async def test_provider_error_mid_stream_is_not_retried(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    rid = await admit(db, await make_session(db), "q")
    server.script("answer", Step.error_after_partial("half an ans", usage=Usage(30, 2)))
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "provider_error"
    assert len(server.requests("answer")) == 1
    assert [
        {k: v for k, v in c.items() if k not in ("latency_ms", "call_id")} for c in ran.row.usage["calls"]
    ] == [
        {
            "purpose": "answer",
            "model": "scripted-model",
            "status": "failed",
            "reported": True,
            "input_tokens": 30,
            "output_tokens": 2,
            "reasoning_tokens": 0,
            "cached_tokens": 0,
        }
    ]
    # The record names the model its calls used, failed or not — not null for a failure.
    assert ran.row.model == "scripted-model"


async def test_model_unavailable(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    rid = await admit(db, await make_session(db), "q")
    server.script("answer", Step.model_not_found())
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "model_unavailable"
    assert ran.row.error["detail"]["status"] == 404


async def test_a_window_that_cannot_hold_the_output_cap_fails_before_any_call(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    # SPEC §5: input budget = window − output cap − margin; 1024 − 8192 − 128 < 0 leaves no room for
    # any prompt, so the request fails at once instead of sending max_tokens 8192 to a 1024 window.
    sid = await make_session(db)
    rid = await admit(db, sid, "q", options={"context_window": 1024})
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "context_overflow"
    assert ran.row.error["detail"] == {
        "window": 1024,
        "max_output_tokens": model_settings.max_output_tokens,
        "safety_margin": 128,
        "input_budget": 1024 - model_settings.max_output_tokens - 128,
    }
    assert "1024-token window" in ran.row.error["message"]
    assert server.requests() == []
    # With a cap the window can hold it is answered.
    rid = await admit(db, sid, "q", options={"context_window": 1024, "max_output_tokens": 256})
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.status == "succeeded"


async def test_a_small_window_whose_newest_message_outgrows_the_recent_part_is_refused_in_words(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    # 1024 − 256 − 128 leaves 640 tokens: no room for a recent part beside a summary, and the two
    # messages are too little to summarise. Masking on (the default) refuses as masking off does, and
    # the request goes on verbatim (the model's own overflow, if any, is the answer path's to handle).
    sid = await make_session(db)
    messages = [{"role": "user", "content": "x" * 1500}, {"role": "assistant", "content": "y" * 1500}]
    await add_snapshot(db, sid, "small", {"messages": messages})
    options = {"context_window": 1024, "max_output_tokens": 256}
    rid = await admit(db, sid, "q", snapshot_id="small", options=options)
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.status == "succeeded", ran.row.error
    [refused] = [p for p in ran.of("progress") if p["what"] == "compaction_refused"]
    assert refused["reason"] == "too_little_to_summarize"
    assert "in 2 old messages" in refused["explanation"]
    assert len(server.requests("answer")) == 1
