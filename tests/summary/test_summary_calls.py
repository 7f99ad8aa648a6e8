"""The summary call policy over real HTTP: the one retry, immediate failures, the call cap, the deadline.

Every test drives the real OpenAI SDK adapter and ``run_call`` against the scripted server and counts
what the server actually received.
"""

from __future__ import annotations

import json
import time

import pytest

from service.budget import FIRST_OUTPUT_TOKENS, RETRY_OUTPUT_TOKENS, estimate_text
from service.providers.base import ProviderError, ProviderTimeout
from service.summary.document import BODY_TOKEN_LIMIT, SummaryDocument, render_body
from service.summary.errors import (
    SummaryCallCap,
    SummaryEmpty,
    SummaryError,
    SummaryInvalid,
    SummaryToolCall,
    SummaryTooLong,
    SummaryTruncated,
)
from tests.scripted_provider import Step, Usage
from tests.summary.conftest import RunnerFactory
from tests.summary.helpers import (
    MemoryRecorder,
    RespondingServer,
    material_of,
    output_cap_of,
    previous_of,
    prompt_of,
    summary_json,
)

MATERIAL = "### Side question #1\nQ: Which port does staging use?\nA: 5433.\n"
GOOD = summary_json(objective="Track the staging setup", decisions=["staging DB port is 5433"])
# Four 2000-byte decisions: every string within 2 KiB, the body ~2700 tokens, over the 2200 limit.
TOO_LONG = summary_json(decisions=["d" * 2000] * 4)


def _too_long_tokens() -> int:
    return estimate_text(render_body(SummaryDocument.from_json(json.loads(TOO_LONG))))


FIRST_FAILURES = {
    "empty": Step.empty(usage=Usage(50, 0)),
    "thinking_only": Step.reasoning_only("Let me think about what matters here…", usage=Usage(50, 40)),
    "truncated": Step.truncated('{"objective": "Track the stag', usage=Usage(50, 2048)),
    "invalid": Step.invalid_summary(usage=Usage(50, 20)),
    "too_long": Step.text(TOO_LONG, usage=Usage(50, 2800)),
}


@pytest.mark.parametrize("trigger", sorted(FIRST_FAILURES))
async def test_each_retry_trigger_gets_one_retry_from_the_same_material_with_the_larger_cap(
    trigger: str, server: RespondingServer, make_runner: RunnerFactory, recorder: MemoryRecorder
) -> None:
    server.script("qa_summary", FIRST_FAILURES[trigger], Step.text(GOOD, chunks=3, usage=Usage(60, 30)))
    runner = make_runner()
    document = await runner.summarize("qa", [MATERIAL], None)
    assert document.decisions == ("staging DB port is 5433",)

    first, retry = server.requests("qa_summary")
    assert output_cap_of(first) == FIRST_OUTPUT_TOKENS
    assert output_cap_of(retry) == RETRY_OUTPUT_TOKENS
    assert material_of(retry) == material_of(first) == MATERIAL
    assert "under 600 tokens" in prompt_of(retry) and "under 600 tokens" not in prompt_of(first)
    assert retry.body["messages"][0] == first.body["messages"][0]  # same system prompt
    assert "tools" not in retry.body
    assert runner.budget.calls_made == 2
    assert [c.status for c in recorder.calls] == ["ok", "ok"]
    assert [c.purpose for c in recorder.calls] == ["qa_summary", "qa_summary"]
    assert all(r.request_id == runner.request_id for r in server.requests())


SECOND_FAILURES: dict[str, tuple[Step, type[SummaryError], dict[str, object]]] = {
    "empty": (Step.empty(), SummaryEmpty, {"thinking_only": False}),
    "thinking_only": (Step.reasoning_only("hmm"), SummaryEmpty, {"thinking_only": True}),
    "truncated": (
        Step.truncated('{"objective": "x", "state'),
        SummaryTruncated,
        {"max_output_tokens": RETRY_OUTPUT_TOKENS, "stop_reason": "length"},
    ),
    "invalid": (Step.invalid_summary(), SummaryInvalid, {}),
    "too_long": (Step.text(TOO_LONG), SummaryTooLong, {"body_tokens": -1, "limit": BODY_TOKEN_LIMIT}),
}


@pytest.mark.parametrize("trigger", sorted(SECOND_FAILURES))
async def test_a_second_failure_fails_with_the_matching_code_and_detail(
    trigger: str, server: RespondingServer, make_runner: RunnerFactory
) -> None:
    step, error_type, detail = SECOND_FAILURES[trigger]
    server.script("context_summary", step, step)
    runner = make_runner()
    with pytest.raises(error_type) as caught:
        await runner.summarize("context", [MATERIAL], None)
    assert len(server.requests("context_summary")) == 2  # exactly one retry, never a loop
    error = caught.value
    expected = dict(detail)
    if trigger == "too_long":
        expected["body_tokens"] = _too_long_tokens()
        assert _too_long_tokens() > BODY_TOKEN_LIMIT
    if trigger == "invalid":
        assert "not one JSON object" in error.detail["reason"]
    else:
        assert error.detail == expected
    assert error.to_error()["code"] == f"summary_{trigger.replace('thinking_only', 'empty')}"


async def test_a_tool_call_fails_at_once_without_a_retry(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.script("qa_summary", Step.tool_call("grep", arguments='{"pattern": "x"}'))
    runner = make_runner()
    with pytest.raises(SummaryToolCall) as caught:
        await runner.summarize("qa", [MATERIAL], None)
    assert caught.value.detail == {"tool_name": "grep"}
    assert len(server.requests("qa_summary")) == 1


async def test_a_provider_error_propagates_unchanged_without_a_retry(
    server: RespondingServer, make_runner: RunnerFactory, recorder: MemoryRecorder
) -> None:
    server.script("qa_summary", Step.server_error(500))
    runner = make_runner()
    with pytest.raises(ProviderError) as caught:
        await runner.summarize("qa", [MATERIAL], None)
    assert not isinstance(caught.value, SummaryError)
    assert caught.value.status == 500 and caught.value.code == "provider_error"
    assert len(server.requests("qa_summary")) == 1
    assert [c.status for c in recorder.calls] == ["failed"]


async def test_the_thirteenth_call_is_never_made(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    # Seven chunks, each needing its one retry: 7 ≤ 12 passes the plan check, but 14 attempts would be
    # needed. The 13th attempt (chunk 7's first) is refused before it is sent.
    server.set_default("qa_summary", Step.invalid_summary())
    server.script("qa_summary", *[s for _ in range(6) for s in (Step.invalid_summary(), Step.text(GOOD))])
    runner = make_runner(max_calls=12)
    chunks = [f"### Side question #{i}\nQ: q{i}\nA: a{i}\n" for i in range(1, 8)]
    with pytest.raises(SummaryCallCap) as caught:
        await runner.summarize("qa", chunks, None)
    assert len(server.requests("qa_summary")) == 12
    assert caught.value.detail == {"calls_made": 12, "calls_needed": 1, "max_calls": 12}
    assert runner.budget.calls_made == 12


async def test_a_plan_needing_more_calls_than_remain_fails_before_any_call(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    runner = make_runner(max_calls=12)
    with pytest.raises(SummaryCallCap) as caught:
        await runner.summarize("context", [f"chunk {i}" for i in range(13)], None)
    assert caught.value.detail["calls_needed"] == 13 and caught.value.detail["calls_made"] == 0
    assert server.requests() == []


async def test_rate_limit_retries_count_toward_the_cap(
    server: RespondingServer, make_runner: RunnerFactory, recorder: MemoryRecorder
) -> None:
    server.script("qa_summary", Step.rate_limited(retry_after="0"), Step.text(GOOD))
    runner = make_runner(max_calls=2)
    await runner.summarize("qa", [MATERIAL], None)
    assert runner.budget.calls_made == 2
    assert [c.status for c in recorder.calls] == ["failed", "ok"]

    # With one call allowed, the rate-limit retry is the refused second call.
    server.script("qa_summary", Step.rate_limited(retry_after="0"), Step.text(GOOD))
    before = len(server.requests())
    runner = make_runner(max_calls=1)
    with pytest.raises(SummaryCallCap):
        await runner.summarize("qa", [MATERIAL], None)
    assert len(server.requests()) == before + 1


async def test_a_hanging_summary_call_ends_at_the_request_deadline(
    server: RespondingServer, make_runner: RunnerFactory, recorder: MemoryRecorder
) -> None:
    server.script("context_summary", Step.hang())
    runner = make_runner(timeout_s=0.6)
    started = time.monotonic()
    with pytest.raises(ProviderTimeout) as caught:
        await runner.summarize("context", [MATERIAL], None)
    assert 0.4 < time.monotonic() - started < 5
    assert caught.value.code == "timeout"
    assert len(server.requests("context_summary")) == 1
    assert [c.status for c in recorder.calls] == ["failed"]


async def test_the_retry_never_starts_after_the_deadline(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.script("qa_summary", Step.invalid_summary().with_delay(before_s=0.5), Step.text(GOOD))
    runner = make_runner(timeout_s=0.4)
    with pytest.raises(ProviderTimeout):
        await runner.summarize("qa", [MATERIAL], None)
    assert len(server.requests("qa_summary")) == 1


async def test_a_failed_chunk_stops_the_chain_and_its_retry_starts_from_the_last_valid_summary(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.script(
        "context_summary",
        Step.text(summary_json(state="after chunk 1")),
        Step.invalid_summary(),
        Step.invalid_summary(),
    )
    runner = make_runner()
    with pytest.raises(SummaryInvalid):
        await runner.summarize("context", ["part one", "part two", "part three"], None)
    one, two_first, two_retry = server.requests("context_summary")  # chunk 3 is never sent
    assert previous_of(one) is None
    assert previous_of(two_first) == previous_of(two_retry)
    assert "State: after chunk 1" in (previous_of(two_retry) or "")
    assert "Hope it helps" not in prompt_of(two_retry)  # the invalid reply is never fed back
    assert material_of(two_retry) == "part two"
