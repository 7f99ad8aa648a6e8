"""Replay window, rolling Q&A summary, context compaction with its cache, overflow recovery."""

from __future__ import annotations

import json
import re

import pytest

from service.budget import estimate_text
from service.config import Settings
from service.providers.base import Provider
from service.store import memory
from service.store.db import Database
from tests.factories import add_history, add_snapshot, admit, make_session
from tests.pipeline.conftest import run_one
from tests.scripted_provider import ScriptedServer, Step, Usage

_ORDINAL = re.compile(r"Side question #(\d+)")


def _ordinals(body: object) -> list[int]:
    return sorted({int(m) for m in _ORDINAL.findall(json.dumps(body, ensure_ascii=False))})


@pytest.mark.parametrize(
    ("earlier", "replayed", "folded_calls"),
    [(19, 19, 0), (20, 20, 0), (21, 20, 1), (50, 20, 2)],
)
async def test_replay_window_of_19_20_21_50_groups(
    db: Database,
    model_settings: Settings,
    provider: Provider,
    server: ScriptedServer,
    earlier: int,
    replayed: int,
    folded_calls: int,
) -> None:
    sid = await make_session(db, f"replay-{earlier}")
    await add_history(db, sid, [(f"question {i}?", f"answer {i}.") for i in range(1, earlier + 1)])
    rid = await admit(db, sid, "and now?")

    ran = await run_one(db, model_settings, provider, rid)

    assert ran.outcome.status == "succeeded"
    info = ran.row.context_info
    first = earlier - replayed + 1
    assert info["replayed_groups"] == replayed
    assert info["replayed_ordinals"] == [first, earlier]
    # What the model received: exactly the replayed groups verbatim, in the answer's last turn.
    answer_body = server.requests("answer")[0].body
    assert _ordinals(answer_body["messages"][-1]) == list(range(first, earlier + 1))
    assert (
        "question 1?" in json.dumps(answer_body)
        if first == 1
        else "question 1?" not in json.dumps(answer_body)
    )
    # The older groups went into the rolling summary, in batches of at most 20, in ordinal order.
    summaries = server.requests("qa_summary")
    assert len(summaries) == folded_calls
    folded = [_ordinals(r.body) for r in summaries]
    assert [o for batch in folded for o in batch] == list(range(1, first))
    assert all(len(batch) <= 20 for batch in folded)
    qa = info["qa_summary"]
    if folded_calls:
        assert qa == {
            "used": True,
            "first_ordinal": 1,
            "covered_through_ordinal": first - 1,
            "updated": True,
            "calls": folded_calls,
            "made_by": "request",
            "waited_ms": 0,
        }
        assert info["summary_calls"] == folded_calls
        assert "Summary of earlier side questions" in json.dumps(answer_body)
        async with db.sessions() as session:
            saved = (await memory.load_memory(session, sid))["qa_summary"]
        assert saved["covered_through_ordinal"] == first - 1 and saved["first_ordinal"] == 1
    else:
        assert qa["used"] is False and qa["calls"] == 0
    progress = [p for p in ran.of("progress") if p.get("what") == "replay"]
    assert progress[0]["replayed_groups"] == replayed and progress[0]["folded_groups"] == first - 1


async def test_rolling_summary_is_updated_not_rewritten_on_the_next_request(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await add_history(db, sid, [(f"q{i}", f"a{i}") for i in range(1, 22)])
    first = await admit(db, sid, "first")
    assert (await run_one(db, model_settings, provider, first)).outcome.status == "succeeded"
    # 21 earlier + the first request's own answer = 22 succeeded; the next fold covers only #2.
    second = await admit(db, sid, "second")
    ran = await run_one(db, model_settings, provider, second)
    assert ran.row.context_info["replayed_ordinals"] == [3, 22]
    update = server.requests("qa_summary")[-1].body
    assert _ordinals(update) == [2]
    assert "Ship the scripted feature." in json.dumps(update)  # the previous summary is the base


def _big_snapshot(messages: int, bytes_each: int) -> dict[str, object]:
    out: list[dict[str, object]] = []
    for i in range(messages):
        role = "user" if i % 2 == 0 else "assistant"
        out.append({"role": role, "content": f"message {i}: " + ("lorem ipsum " * (bytes_each // 12))})
    return {"taken_at": "2026-11-29T09:00:00Z", "system": "main system", "messages": out}


async def test_compaction_runs_only_when_over_budget_and_then_hits_its_cache(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    # ~40 messages × ~1000 tokens against a 32000-token window: the whole request cannot fit.
    await add_snapshot(db, sid, "big", _big_snapshot(40, 3000))
    options = {"context_window": 32000, "max_output_tokens": 1024}
    first = await admit(db, sid, "what is the state?", snapshot_id="big", options=options)

    ran = await run_one(db, model_settings, provider, first)

    assert ran.outcome.status == "succeeded", ran.row.error
    assert ran.stages() == ["preparing", "organizing_history", "compacting_context", "answering"]
    ctx = ran.row.context_info["context_summary"]
    assert ctx["used"] is True and ctx["cache"] == "miss" and ctx["calls"] >= 1
    # Each event's `at` is when it happened, though stage events are written in batches: the stage
    # timeline of the inspector reads them, so a batch must not share one timestamp.
    running = {
        e.data["stage"]: e.data["at"]
        for e in ran.events
        if e.type == "status" and e.data["status"] == "running"
    }
    assert running["preparing"] < running["organizing_history"] < running["compacting_context"]
    ats = [e.data["at"] for e in ran.events]
    assert ats == sorted(ats)
    assert ctx["summarized_messages"] + ctx["kept_messages"] == 40
    assert ran.row.context_info["estimate"]["total"] <= ran.row.context_info["input_budget"]
    sent = server.requests("answer")[0].body["messages"]
    assert "message 0:" not in json.dumps(sent)  # the old part went into the summary
    assert "message 39:" in json.dumps(sent)  # the recent part is kept verbatim
    calls_after_first = len(server.requests("context_summary"))

    second = await admit(db, sid, "and the risks?", snapshot_id="big", options=options)
    again = await run_one(db, model_settings, provider, second)
    assert again.row.context_info["context_summary"]["cache"] == "hit"
    assert again.row.context_info["context_summary"]["calls"] == 0
    assert len(server.requests("context_summary")) == calls_after_first


async def test_a_small_window_keeps_a_shorter_verbatim_tail_so_the_request_fits(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    # A 12000-token window with a 4000-token cap leaves an input budget of ~7400, below the
    # 8000-token recent tail; the whole snapshot (~7800 tokens) fits that tail, so a tail of its full
    # size would compact nothing and send the request over budget. SPEC §6.2 keeps "up to" 8000
    # tokens: the tail is held to what the budget leaves.
    sid = await make_session(db)
    await add_snapshot(db, sid, "mid", _big_snapshot(64, 360))
    options = {"context_window": 12000, "max_output_tokens": 4000}
    rid = await admit(db, sid, "what is the state?", snapshot_id="mid", options=options)

    ran = await run_one(db, model_settings, provider, rid)

    assert ran.outcome.status == "succeeded", ran.row.error
    info = ran.row.context_info
    assert "compacting_context" in ran.stages()
    ctx = info["context_summary"]
    assert ctx["used"] is True and ctx["summarized_messages"] > 0
    assert ctx["summarized_messages"] + ctx["kept_messages"] == 64
    assert info["estimate"]["total"] <= info["input_budget"]
    assert "message 63:" in json.dumps(server.requests("answer")[0].body["messages"])


async def test_small_requests_never_compact(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await add_snapshot(db, sid, "small", _big_snapshot(6, 300))
    rid = await admit(db, sid, "q", snapshot_id="small")
    ran = await run_one(db, model_settings, provider, rid)
    assert "compacting_context" not in ran.stages()
    assert server.requests("context_summary") == []


async def test_overflow_recovery_folds_the_replay_and_retries_once(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await add_history(db, sid, [(f"q{i}", f"a{i} " * 50) for i in range(1, 6)])
    rid = await admit(db, sid, "q")
    server.script("answer", Step.overflow(), Step.text("Fits now.", usage=Usage(100, 3)))

    ran = await run_one(db, model_settings, provider, rid)

    assert ran.outcome.status == "succeeded" and ran.row.answer == "Fits now."
    info = ran.row.context_info
    assert info["overflow_retries"] == 1 and info["replayed_groups"] == 0
    assert info["qa_summary"]["covered_through_ordinal"] == 5
    answers = server.requests("answer")
    assert len(answers) == 2
    assert _ordinals(answers[0].body["messages"][-1]) == [1, 2, 3, 4, 5]
    assert _ordinals(answers[1].body["messages"][-1]) == []
    assert [c["status"] for c in ran.row.usage["calls"] if c["purpose"] == "answer"] == ["failed", "ok"]
    assert any(p.get("what") == "overflow_retry" for p in ran.of("progress"))


async def test_overflow_with_nothing_to_shrink_stops_at_once(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    rid = await admit(db, await make_session(db), "q")
    server.script("answer", Step.overflow())
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "context_overflow"
    assert len(server.requests("answer")) == 1
    assert ran.row.context_info["overflow_retries"] == 0


async def test_an_overflow_whose_window_the_output_cap_alone_fills_is_not_retried(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    """A 4096-token local model, no window configured (200 000 assumed), the 8192 output cap: the
    overflow says so, no smaller prompt can fit, so no summary call is spent on a retry — the request
    fails context_overflow at once, saying what to change."""
    sid = await make_session(db)
    await add_history(db, sid, [(f"q{i}", f"a{i} " * 50) for i in range(1, 6)])  # a replay to fold
    rid = await admit(db, sid, "q")
    body = {
        "object": "error",
        "message": "This model's maximum context length is 4096 tokens. However, you requested 8292 "
        "tokens (100 in the messages, 8192 in the completion). Please reduce the length of the messages "
        "or completion.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    server.script("answer", Step.overflow(body))
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "context_overflow"
    assert "fills the model's 4096-token window" in ran.row.error["message"]
    assert len(server.requests("answer")) == 1 and not server.requests("qa_summary")
    assert ran.row.context_info["overflow_retries"] == 0


async def test_overflow_after_streamed_text_is_not_retried(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    from tests.scripted_provider import STREAM_OVERFLOW_ERROR

    sid = await make_session(db)
    await add_history(db, sid, [("q1", "a1")])
    rid = await admit(db, sid, "q")
    server.script("answer", Step.error_after_partial("some text", error=STREAM_OVERFLOW_ERROR))
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "context_overflow"
    assert len(server.requests("answer")) == 1
    assert server.requests("qa_summary") == []


async def test_overflow_after_a_streamed_tool_call_is_not_retried(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    """SPEC 7: retried only while no text *or tool call* has streamed: a tool call's deltas, then an
    in-stream overflow, ends the request instead of a second call answering it."""
    from tests.scripted_provider import STREAM_OVERFLOW_ERROR

    sid = await make_session(db)
    await add_history(db, sid, [(f"q{i}", f"a{i} " * 50) for i in range(1, 6)])  # a replay to shrink
    rid = await admit(db, sid, "q")
    tool = Step.tool_call("grep").tool
    server.script("answer", Step(tool=tool, stream_error=STREAM_OVERFLOW_ERROR), Step.text("never"))
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "context_overflow"
    assert len(server.requests("answer")) == 1


async def test_a_second_overflow_fails(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await add_history(db, sid, [("q1", "a1 " * 400)])
    rid = await admit(db, sid, "q")
    server.script("answer", Step.overflow(), Step.overflow())
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "context_overflow"
    assert len(server.requests("answer")) == 2
    assert ran.row.context_info["overflow_retries"] == 1


async def test_summary_failure_fails_the_request_with_its_code(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await add_history(db, sid, [(f"q{i}", f"a{i}") for i in range(1, 22)])
    rid = await admit(db, sid, "q")
    server.script("qa_summary", Step.invalid_summary(), Step.invalid_summary())
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "summary_invalid"
    assert ran.types()[-2:] == ["status", "error"] and ran.events[-2].data["stage"] == "organizing_history"
    assert server.requests("answer") == []
    assert [c["purpose"] for c in ran.row.usage["calls"]] == ["qa_summary", "qa_summary"]
    # The failed summary's own count agrees with summary_calls.
    assert ran.row.context_info["qa_summary"]["calls"] == ran.row.context_info["summary_calls"] == 2
    async with db.sessions() as session:
        assert (await memory.load_memory(session, sid))["qa_summary"] is None


async def test_a_failed_compaction_counts_its_calls_in_its_record(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await add_snapshot(db, sid, "big", _big_snapshot(40, 3000))
    options = {"context_window": 32000, "max_output_tokens": 1024}
    rid = await admit(db, sid, "what is the state?", snapshot_id="big", options=options)
    server.set_default("context_summary", Step.invalid_summary())
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "summary_invalid"
    made = len(server.requests("context_summary"))
    assert made >= 2
    assert ran.row.context_info["context_summary"]["calls"] == ran.row.context_info["summary_calls"] == made


async def test_summary_call_cap_fails_before_spending_calls(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    settings = model_settings.model_copy(update={"max_summary_calls": 1})
    sid = await make_session(db)
    await add_history(db, sid, [(f"q{i}", f"a{i}") for i in range(1, 51)])
    rid = await admit(db, sid, "q")
    ran = await run_one(db, settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "summary_call_cap"
    assert server.requests() == []


async def test_overflow_stops_when_shrinking_would_not_make_the_prompt_smaller(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    # One tiny replayed pair: its summary would be longer than the pair itself.
    sid = await make_session(db)
    await add_history(db, sid, [("q1", "a1")])
    rid = await admit(db, sid, "q")
    server.script("answer", Step.overflow())
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "context_overflow"
    assert len(server.requests("answer")) == 1
    assert ran.row.context_info["overflow_retries"] == 0


async def test_overflow_recovery_compacts_harder_and_usage_events_are_cumulative(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await add_snapshot(db, sid, "big", _big_snapshot(40, 3000))
    options = {"context_window": 32000, "max_output_tokens": 1024}
    rid = await admit(db, sid, "q", snapshot_id="big", options=options)
    server.script("answer", Step.overflow(), Step.text("Fits after compacting harder.", usage=Usage(100, 5)))

    ran = await run_one(db, model_settings, provider, rid)

    assert ran.outcome.status == "succeeded", ran.row.error
    info = ran.row.context_info
    assert info["overflow_retries"] == 1
    first, second = (r.body["messages"] for r in server.requests("answer"))
    assert len(json.dumps(second)) < len(json.dumps(first))
    kept_first = set(re.findall(r"message (\d+):", json.dumps(first)))
    kept_second = set(re.findall(r"message (\d+):", json.dumps(second)))
    assert kept_second < kept_first  # harder: fewer recent messages kept verbatim
    assert info["context_summary"]["kept_messages"] == len(kept_second)
    assert info["context_summary"]["calls"] == len(server.requests("context_summary"))
    # One usage event per provider call, each carrying the cumulative usage object so far.
    usage_events = [u["usage"] for u in ran.of("usage")]
    assert [len(u["calls"]) for u in usage_events] == list(range(1, len(ran.row.usage["calls"]) + 1))
    assert usage_events[-1] == ran.row.usage
    totals = [u["input_tokens"] for u in usage_events]
    assert totals == sorted(totals)


async def test_an_overflow_stating_a_smaller_window_sizes_the_retry_and_its_summaries_for_it(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    """No window configured (200 000 assumed) and a 32k model: its overflow states the window. The
    retry's summary calls and the retry itself are sized for 32 768: sized for the assumed window, a
    summary call of 158 KB would go out, which a real 32k server refuses."""
    sid = await make_session(db)
    await add_snapshot(db, sid, "big", _big_snapshot(61, 3000))
    rid = await admit(db, sid, "q", snapshot_id="big")
    stated = {
        "error": {
            "message": "This model's maximum context length is 32768 tokens. However, your messages "
            "resulted in 70000 tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    server.script("answer", Step.overflow(stated), Step.text("Fits the stated window.", usage=Usage(100, 5)))

    ran = await run_one(db, model_settings, provider, rid)

    assert ran.outcome.status == "succeeded", ran.row.error
    assert ran.row.context_info["overflow_retries"] == 1
    summaries = server.requests("context_summary")
    assert summaries
    for call in summaries:  # each summary call, prompt and output cap, fits the stated window
        assert estimate_text(json.dumps(call.body["messages"])) + call.body["max_tokens"] < 32768
    retry = server.requests("answer")[-1].body
    assert estimate_text(json.dumps(retry["messages"])) + retry["max_tokens"] < 32768


async def test_an_8k_window_still_folds_older_qa_with_smaller_summary_caps(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    """With context_window 8000 a fixed 8192-token summary output could not be reserved, and every
    question after the replay window filled would fail context_overflow with no call made. The caps
    shrink to fit such a window (service.budget.chunk.summary_output_caps)."""
    sid = await make_session(db, "small-window")
    await add_history(db, sid, [(f"question {i}?", f"answer {i}: " + "detail " * 128) for i in range(1, 8)])
    rid = await admit(db, sid, "and now?", options={"context_window": 8000, "max_output_tokens": 1024})

    ran = await run_one(db, model_settings, provider, rid)

    assert ran.outcome.status == "succeeded", ran.row.error
    info = ran.row.context_info
    assert info["window"] == 8000 and info["qa_summary"]["used"] and info["qa_summary"]["calls"] >= 1
    for call in server.requests("qa_summary"):
        cap = call.body.get("max_tokens") or call.body.get("max_completion_tokens")
        assert cap is not None and cap < 8000 // 2, cap  # what the window leaves, halved at most


@pytest.mark.parametrize(
    ("finish", "words"), [("content_filter", "content filter"), ("stop", "empty answer")]
)
async def test_an_answer_with_no_text_says_why_it_failed(
    db: Database,
    model_settings: Settings,
    provider: Provider,
    server: ScriptedServer,
    finish: str,
    words: str,
) -> None:
    """A reply with no text fails as provider_error; a content filter's stop says so, with its stop
    reason rather than calling a filtered reply an "empty answer"."""
    sid = await make_session(db)
    rid = await admit(db, sid, "q")
    server.script("answer", Step.text("", finish=finish))
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.row.error is not None and ran.row.error["code"] == "provider_error"
    assert words in ran.row.error["message"] and ran.row.error["detail"]["stop_reason"] == finish
