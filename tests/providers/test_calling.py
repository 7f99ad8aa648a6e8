"""The calling policy (run_call): rate-limit retries, deadlines, cancellation and per-attempt recording,
driven through the real OpenAI adapter against the scripted server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from service.aio import all_or_first_failure
from service.providers.base import CallUsage, ContextOverflow, ProviderError, ProviderTimeout, RateLimited
from service.providers.calling import CallRecord, run_call
from service.providers.openai_compat import OpenAIProvider
from tests.providers.helpers import ListRecorder, make_call
from tests.scripted_provider import ScriptedServer, Step, Usage

NO_HINT_429 = {"error": {"message": "Too many requests", "type": "requests", "code": "rate_limit_exceeded"}}


class FakeTime:
    """A clock that only moves when the policy sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture(scope="module")
async def provider(module_server: ScriptedServer) -> AsyncIterator[OpenAIProvider]:
    adapter = OpenAIProvider(module_server.base_url, "test-key", "scripted-model")
    yield adapter
    await adapter.aclose()


async def test_success_returns_the_reply_and_records_one_ok_call(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script(
        "answer", Step.text("Four.", reasoning="hmm", chunks=3, usage=Usage(100, 5, cached_tokens=60))
    )
    recorder = ListRecorder()
    streamed: list[str] = []

    async def on_text(text: str) -> None:
        streamed.append(text)

    fake = FakeTime()
    result = await run_call(
        provider, make_call(), recorder=recorder, deadline=fake.now + 30, on_text=on_text, clock=fake.clock
    )

    assert (result.text, result.reasoning, result.stop_reason, result.raw_stop_reason) == (
        "Four.",
        "hmm",
        "stop",
        "stop",
    )
    assert result.usage == CallUsage(100, 5, 0, 60, reported=True)
    assert streamed == ["Fo", "ur", "."]
    assert [(c.purpose, c.model, c.status, c.usage) for c in recorder.calls] == [
        ("answer", "scripted-model", "ok", result.usage)
    ]
    # The attempt's timeout is the time left before the deadline.
    assert float(server.requests()[0].headers["x-stainless-read-timeout"]) == pytest.approx(30.0)


async def test_unreported_usage_is_zeros_marked_unreported(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", Step.text("ok"))
    recorder = ListRecorder()

    result = await run_call(provider, make_call(), recorder=recorder, deadline=time.monotonic() + 30)

    assert result.usage == CallUsage(reported=False)
    assert recorder.calls[0].usage == CallUsage(reported=False)


async def test_tool_calls_are_collected_not_retried(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("answer", Step.tool_call("grep"))

    result = await run_call(provider, make_call(), recorder=ListRecorder(), deadline=time.monotonic() + 30)

    assert [c.name for c in result.tool_calls] == ["grep"]
    assert result.stop_reason == "tool_calls"


async def test_rate_limit_waits_retry_after_then_repeats_the_same_request(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("qa_summary", Step.rate_limited(retry_after="7"), Step.valid_summary(usage=Usage(300, 50)))
    recorder = ListRecorder()
    fake = FakeTime()

    await run_call(
        provider,
        make_call(purpose="qa_summary", max_output_tokens=2048),
        recorder=recorder,
        deadline=fake.now + 60,
        clock=fake.clock,
        sleep=fake.sleep,
    )

    assert fake.sleeps == [7.0]
    assert [c.status for c in recorder.calls] == ["failed", "ok"]
    assert recorder.calls[0].usage == CallUsage(reported=False)
    first, second = server.requests(purpose="qa_summary")
    # Same request (same output cap and messages); only the timeout shrank by the wait.
    assert first.body == second.body
    assert first.body["max_tokens"] == 2048
    assert float(second.headers["x-stainless-read-timeout"]) == pytest.approx(53.0)


async def test_without_retry_after_the_waits_are_one_then_two_seconds(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script(
        "answer",
        Step.http_error(429, NO_HINT_429),
        Step.http_error(429, NO_HINT_429),
        Step.text("finally"),
    )
    fake = FakeTime()
    recorder = ListRecorder()

    result = await run_call(
        provider,
        make_call(),
        recorder=recorder,
        deadline=fake.now + 60,
        clock=fake.clock,
        sleep=fake.sleep,
    )

    assert fake.sleeps == [1.0, 2.0]
    assert result.text == "finally"
    assert [c.status for c in recorder.calls] == ["failed", "failed", "ok"]


async def test_still_refused_after_two_retries_raises_with_attempts(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", *[Step.rate_limited(retry_after="1") for _ in range(4)])
    recorder = ListRecorder()
    fake = FakeTime()

    with pytest.raises(RateLimited) as caught:
        await run_call(
            provider,
            make_call(),
            recorder=recorder,
            deadline=fake.now + 60,
            clock=fake.clock,
            sleep=fake.sleep,
        )

    assert caught.value.attempts == 3
    assert fake.sleeps == [1.0, 1.0]
    assert [c.status for c in recorder.calls] == ["failed", "failed", "failed"]
    assert server.pending("answer") == 1  # the fourth step was never asked for


async def test_529_overload_is_retried_like_a_429(server: ScriptedServer, provider: OpenAIProvider) -> None:
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    server.script("answer", Step.http_error(529, overloaded, headers={"retry-after": "2"}), Step.text("ok"))
    fake = FakeTime()

    result = await run_call(
        provider,
        make_call(),
        recorder=ListRecorder(),
        deadline=fake.now + 60,
        clock=fake.clock,
        sleep=fake.sleep,
    )

    assert (result.text, fake.sleeps) == ("ok", [2.0])


async def test_exhausted_quota_is_not_retried(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("answer", Step.quota_exhausted(), Step.text("never"))
    recorder = ListRecorder()
    fake = FakeTime()

    with pytest.raises(RateLimited) as caught:
        await run_call(
            provider,
            make_call(),
            recorder=recorder,
            deadline=fake.now + 60,
            clock=fake.clock,
            sleep=fake.sleep,
        )

    assert caught.value.quota_exhausted and caught.value.attempts == 1
    assert fake.sleeps == []
    assert [c.status for c in recorder.calls] == ["failed"]
    assert server.pending("answer") == 1


async def test_a_wait_that_would_pass_the_deadline_is_not_taken(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", Step.rate_limited(retry_after="10"), Step.text("never"))
    fake = FakeTime()

    with pytest.raises(RateLimited) as caught:
        await run_call(
            provider,
            make_call(),
            recorder=ListRecorder(),
            deadline=fake.now + 5,
            clock=fake.clock,
            sleep=fake.sleep,
        )

    assert caught.value.attempts == 1
    assert fake.sleeps == []


async def test_a_passed_deadline_makes_no_call(server: ScriptedServer, provider: OpenAIProvider) -> None:
    recorder = ListRecorder()
    fake = FakeTime()

    with pytest.raises(ProviderTimeout):
        await run_call(provider, make_call(), recorder=recorder, deadline=fake.now, clock=fake.clock)

    assert server.requests() == []
    assert recorder.calls == []


async def test_the_whole_call_is_bounded_by_the_deadline_even_while_chunks_keep_coming(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    # Each gap (0.15 s) is shorter than the HTTP read timeout, so only the whole-call deadline can stop it.
    slow = Step.text("x" * 20, chunks=20, usage=Usage(10, 20)).with_delay(between_s=0.15)
    server.script("answer", slow)
    recorder = ListRecorder()
    streamed: list[str] = []

    async def on_text(text: str) -> None:
        streamed.append(text)

    started = time.monotonic()
    with pytest.raises(ProviderTimeout):
        await run_call(provider, make_call(), recorder=recorder, deadline=started + 0.6, on_text=on_text)

    assert time.monotonic() - started < 2.0
    assert streamed  # some text had arrived
    assert [c.status for c in recorder.calls] == ["failed"]


async def test_a_hanging_provider_times_out_and_is_recorded(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("context_summary", Step.hang())
    recorder = ListRecorder()

    with pytest.raises(ProviderTimeout):
        await run_call(
            provider, make_call(purpose="context_summary"), recorder=recorder, deadline=time.monotonic() + 0.4
        )

    assert [(c.purpose, c.status, c.usage) for c in recorder.calls] == [
        ("context_summary", "failed", CallUsage(reported=False))
    ]


async def test_cancellation_records_a_cancelled_call_with_the_usage_seen(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    # Usage first, some text, then the provider hangs until we cancel.
    server.script("answer", Step(content="Partial", usage=Usage(700, 2), usage_first=True, hangs=True))
    recorder = ListRecorder()
    got_text = asyncio.Event()

    async def on_text(text: str) -> None:
        got_text.set()

    task = asyncio.create_task(
        run_call(provider, make_call(), recorder=recorder, deadline=time.monotonic() + 30, on_text=on_text)
    )
    await asyncio.wait_for(got_text.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert [(c.status, c.usage) for c in recorder.calls] == [
        ("cancelled", CallUsage(input_tokens=700, output_tokens=2, reported=True))
    ]


async def test_other_errors_are_recorded_once_and_never_retried(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", Step.overflow(), Step.text("never"))
    recorder = ListRecorder()

    with pytest.raises(ContextOverflow):
        await run_call(provider, make_call(), recorder=recorder, deadline=time.monotonic() + 30)

    assert [c.status for c in recorder.calls] == ["failed"]
    assert len(server.requests()) == 1


async def test_a_failure_after_usage_records_that_usage(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", Step.error_after_partial("Half", usage=Usage(400, 1)))
    recorder = ListRecorder()

    with pytest.raises(ProviderError):
        await run_call(provider, make_call(), recorder=recorder, deadline=time.monotonic() + 30)

    assert recorder.calls[0].status == "failed"
    assert recorder.calls[0].usage == CallUsage(input_tokens=400, output_tokens=1, reported=True)


async def test_before_attempt_runs_before_every_attempt_and_can_refuse_one(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("qa_summary", Step.rate_limited(retry_after="1"), Step.valid_summary())
    fake = FakeTime()
    calls = 0

    class CallCapReached(Exception):
        pass

    async def cap_of_one() -> None:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise CallCapReached

    recorder = ListRecorder()
    with pytest.raises(CallCapReached):
        await run_call(
            provider,
            make_call(purpose="qa_summary"),
            recorder=recorder,
            deadline=fake.now + 60,
            before_attempt=cap_of_one,
            clock=fake.clock,
            sleep=fake.sleep,
        )

    assert calls == 2
    assert len(server.requests()) == 1  # the refused attempt never reached the provider
    assert [c.status for c in recorder.calls] == ["failed"]


async def test_a_rate_limit_after_streamed_text_is_not_retried(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    """SPEC 7: a partially streamed reply is never retried — its text reached the client already, and
    a retry would append a second reply to it ("PARTIAL-ONE SECOND")."""
    in_stream = {"error": {"message": "Rate limit reached", "type": "rate_limit_error", "code": 429}}
    server.script("answer", Step.error_after_partial("PARTIAL-ONE ", error=in_stream), Step.text("SECOND"))
    streamed: list[str] = []

    async def on_text(text: str) -> None:
        streamed.append(text)

    recorder = ListRecorder()
    fake = FakeTime()
    with pytest.raises(ProviderError) as refused:
        await run_call(
            provider,
            make_call(purpose="answer"),
            recorder=recorder,
            deadline=fake.now + 60,
            on_text=on_text,
            clock=fake.clock,
            sleep=fake.sleep,
        )
    # Not retried, so not "rate_limited … still refused after up to two waits" (SPEC 8): that would
    # claim waits that never happened; the stream broke, and the error says so.
    assert not isinstance(refused.value, RateLimited) and refused.value.to_error()["code"] == "provider_error"
    assert "broke off after it had begun" in refused.value.message and fake.sleeps == []
    assert "".join(streamed) == "PARTIAL-ONE " and len(server.requests(purpose="answer")) == 1
    assert [c.status for c in recorder.calls] == ["failed"]


class _SlowRecorder(ListRecorder):
    """A recorder whose writes take a moment, as the ledger's do, the first quickest: the cancel the
    first failure sends lands in the others' writes."""

    started = 0

    async def record_call(self, call: CallRecord) -> None:
        self.started += 1
        await asyncio.sleep(0.0 if self.started == 1 else 0.2)
        await super().record_call(call)


async def test_parallel_calls_that_pass_one_deadline_are_each_recorded(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    """The first to time out cancels the others, which were recording their own timeouts: each is
    still recorded, with its usage — the cancellation must not cut a recording short."""
    for _ in range(3):
        server.script("context_summary", Step.hang(text="partial"))
    recorder = _SlowRecorder()
    deadline = time.monotonic() + 0.5
    calls = [
        run_call(provider, make_call(purpose="context_summary"), recorder=recorder, deadline=deadline)
        for _ in range(3)
    ]
    with pytest.raises(ProviderTimeout):
        await all_or_first_failure(calls)
    assert len(recorder.calls) == 3, recorder.calls
