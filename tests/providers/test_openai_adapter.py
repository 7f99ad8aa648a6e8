"""The OpenAI-compatible adapter, through the real ``openai`` SDK, against the scripted server over HTTP."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from service.providers.base import (
    CallUsage,
    ContextOverflow,
    ModelUnavailable,
    ProviderError,
    ProviderTimeout,
    RateLimited,
)
from service.providers.openai_compat import OpenAIProvider, to_openai_messages
from tests.net import free_port
from tests.providers.helpers import collect, make_call
from tests.scripted_provider import VALID_SUMMARY, ScriptedServer, Step, Usage

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "provider_errors"


def fixture_body(name: str) -> Any:
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))["body"]


def fixture_expected(name: str) -> dict[str, Any]:
    expected: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))["expected"]
    return expected


@pytest.fixture(scope="module")
async def provider(module_server: ScriptedServer) -> AsyncIterator[OpenAIProvider]:
    adapter = OpenAIProvider(module_server.base_url, "test-key", "scripted-model")
    yield adapter
    await adapter.aclose()


async def test_text_streams_in_deltas_with_usage_and_stop(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    usage = Usage(1200, 40, cached_tokens=1000, reasoning_tokens=12)
    server.script("answer", Step.text("The answer is four.", chunks=4, usage=usage))

    got = await collect(provider, make_call())

    assert got.text == "The answer is four."
    assert len(got.text_deltas) == 4
    assert got.usages == [
        CallUsage(input_tokens=1200, output_tokens=40, reasoning_tokens=12, cached_tokens=1000, reported=True)
    ]
    assert got.finish.stop_reason == "stop"
    assert got.finish.raw_stop_reason == "stop"


async def test_every_call_carries_purpose_request_id_and_stream_options(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    await collect(provider, make_call(purpose="qa_summary", request_id="req-123", timeout_s=7.5))

    (request,) = server.requests()
    assert request.path == "/v1/chat/completions"
    assert request.headers["x-sidequest-purpose"] == "qa_summary"
    assert request.headers["x-sidequest-request-id"] == "req-123"
    assert request.headers["authorization"] == "Bearer test-key"
    # The SDK's own retries are off, and our timeout is what it waits for.
    assert request.headers["x-stainless-retry-count"] == "0"
    assert float(request.headers["x-stainless-read-timeout"]) == pytest.approx(7.5)
    assert request.body["stream"] is True
    assert request.body["stream_options"] == {"include_usage": True}
    assert request.body["max_tokens"] == 512
    assert request.body["model"] == "scripted-model"


async def test_reasoning_content_is_kept_apart_from_the_body(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", Step.text("Four.", reasoning="2+2 is four", chunks=3))

    got = await collect(provider, make_call())

    assert got.reasoning == "2+2 is four"
    assert got.text == "Four."


async def test_ollama_style_reasoning_field_is_reasoning_too(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    step = dataclasses.replace(Step.text("Four.", reasoning="thinking…"), reasoning_field="reasoning")
    server.script("answer", step)

    got = await collect(provider, make_call())

    assert (got.reasoning, got.text) == ("thinking…", "Four.")


async def test_reasoning_only_reply_has_no_body(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("qa_summary", Step.reasoning_only("I should summarise…", chunks=2))

    got = await collect(provider, make_call(purpose="qa_summary"))

    assert got.text == ""
    assert got.reasoning == "I should summarise…"
    assert got.finish.stop_reason == "stop"


async def test_truncated_reply_finishes_with_length(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("answer", Step.truncated("Once upon a", chunks=2, usage=Usage(10, 512)))

    got = await collect(provider, make_call())

    assert got.text == "Once upon a"
    assert (got.finish.stop_reason, got.finish.raw_stop_reason) == ("length", "length")


async def test_tool_call_is_reported_once_and_finishes_with_tool_calls(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", Step.tool_call("grep", arguments='{"pattern": "TODO"}'))

    got = await collect(provider, make_call())

    assert [(c.name, c.id) for c in got.tool_calls] == [("grep", "call_scripted_1")]
    assert got.finish.stop_reason == "tool_calls"


async def test_a_refusal_streams_as_the_answers_text(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    """OpenAI streams a refusal apart from content (``delta.refusal``): it is what the model answered
    (dropping it would fail the request as an empty answer)."""
    server.script("answer", Step(reasoning="I can't help with that.", reasoning_field="refusal"))

    got = await collect(provider, make_call())

    assert got.text == "I can't help with that." and got.reasoning == ""


async def test_content_filter_finish_is_normalised(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("answer", Step.text("I can't", finish="content_filter"))

    got = await collect(provider, make_call())

    assert got.finish.stop_reason == "content_filter"


async def test_unknown_finish_reason_passes_through(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("answer", Step.text("hm", finish="eos_token"))

    got = await collect(provider, make_call())

    assert (got.finish.stop_reason, got.finish.raw_stop_reason) == ("eos_token", "eos_token")


async def test_empty_reply_without_usage_reports_no_usage(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", Step.empty())

    got = await collect(provider, make_call())

    assert got.text == ""
    assert got.usages == []
    assert got.finish.stop_reason == "stop"


async def test_summary_replies_arrive_verbatim(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("context_summary", Step.valid_summary(), Step.invalid_summary())

    valid = await collect(provider, make_call(purpose="context_summary"))
    invalid = await collect(provider, make_call(purpose="context_summary"))

    assert json.loads(valid.text) == VALID_SUMMARY
    assert invalid.text.startswith("Sure! Here is the summary")


@pytest.mark.parametrize(
    ("fixture", "status"),
    [
        ("openai_context_length_exceeded", 400),
        ("vllm_messages_too_long", 400),
        ("llamacpp_exceed_context_size", 400),
        ("ollama_prompt_too_long", 400),
        ("mistral_prompt_too_large", 400),
        ("groq_context_length", 400),
        ("deepseek_context_length", 400),
        ("tgi_inputs_plus_max_new_tokens", 422),
        ("vllm_max_tokens_plus_input_overflow", 400),
        ("vllm_you_passed_input_tokens", 400),
        ("vllm_decoder_prompt_via_xinference_500", 500),
        ("sglang_input_longer_than_context", 400),
        ("sglang_requested_token_count", 400),
        ("lmstudio_keep_first_tokens", 400),
        ("litellm_proxy_context_window_exceeded", 400),
        ("openrouter_context_length_text_and_tools", 400),
        ("together_inputs_plus_max_new_tokens", 400),
        ("fireworks_prompt_too_long", 400),
        ("azure_input_tokens_exceed_configured_limit", 400),
    ],
)
async def test_overflow_before_output_is_a_context_overflow(
    server: ScriptedServer, provider: OpenAIProvider, fixture: str, status: int
) -> None:
    server.script("answer", Step.overflow(fixture_body(fixture), status=status))

    with pytest.raises(ContextOverflow) as caught:
        await collect(provider, make_call())

    assert caught.value.status == status
    assert caught.value.usage is None
    # The counts the body states survive the SDK and the adapter (SPEC §5.1).
    expected = fixture_expected(fixture)
    assert (caught.value.prompt_tokens, caught.value.context_limit) == (
        expected.get("prompt_tokens"),
        expected.get("context_limit"),
    )


@pytest.mark.parametrize(
    ("fixture", "status", "expected"),
    [
        ("groq_tpm_413", 413, RateLimited),
        ("openai_max_tokens_too_large", 400, ProviderError),
        ("openai_invalid_temperature", 400, ProviderError),
        ("openrouter_requires_more_credits_402", 402, RateLimited),
        ("together_non_serverless_model", 400, ModelUnavailable),
        ("openrouter_invalid_model_id", 400, ModelUnavailable),
        ("litellm_proxy_invalid_model_name", 400, ModelUnavailable),
    ],
)
async def test_overflow_look_alikes_are_not_overflows(
    server: ScriptedServer,
    provider: OpenAIProvider,
    fixture: str,
    status: int,
    expected: type[ProviderError],
) -> None:
    server.script("answer", Step.http_error(status, fixture_body(fixture)))

    with pytest.raises(ProviderError) as caught:
        await collect(provider, make_call())

    assert type(caught.value) is expected


async def test_overflow_inside_the_stream_is_a_context_overflow(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", Step.overflow_in_stream())

    with pytest.raises(ContextOverflow) as caught:
        await collect(provider, make_call())

    assert caught.value.status == 400  # vLLM puts the status in error.code
    assert (caught.value.prompt_tokens, caught.value.context_limit) == (5120, 4096)


async def test_llama_cpp_overflow_sent_after_a_200_is_a_context_overflow(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", Step.overflow_in_stream(fixture_body("llamacpp_overflow_in_stream")))

    with pytest.raises(ContextOverflow) as caught:
        await collect(provider, make_call())

    assert (caught.value.prompt_tokens, caught.value.context_limit) == (4476, 4096)  # n_prompt_tokens, n_ctx


async def test_broken_stream_after_partial_output_keeps_the_usage_seen(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", Step.error_after_partial("Half an ans", chunks=2, usage=Usage(900, 3)))
    seen: list[str] = []

    with pytest.raises(ProviderError) as caught:
        async for event in provider.stream(make_call()):
            seen.append(type(event).__name__)

    assert type(caught.value) is ProviderError
    assert "TextDelta" in seen
    assert caught.value.usage == CallUsage(input_tokens=900, output_tokens=3, reported=True)


async def test_server_error_inside_the_stream_after_output_is_a_provider_error(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    from tests.scripted_provider import STREAM_SERVER_ERROR

    server.script("answer", Step.error_after_partial("Partial", error=STREAM_SERVER_ERROR))

    with pytest.raises(ProviderError) as caught:
        await collect(provider, make_call())

    assert type(caught.value) is ProviderError
    assert caught.value.status == 500
    assert "Engine died" in caught.value.message


async def test_delays_between_chunks_are_honoured(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("answer", Step.text("abc", chunks=3).with_delay(between_s=0.05))

    started = time.monotonic()
    got = await collect(provider, make_call())

    assert got.text == "abc"
    assert time.monotonic() - started >= 0.15


async def test_hang_before_any_output_times_out(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("answer", Step.hang())

    started = time.monotonic()
    with pytest.raises(ProviderTimeout):
        await collect(provider, make_call(timeout_s=0.3))

    assert time.monotonic() - started < 5


async def test_hang_after_partial_output_times_out(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("answer", Step.hang(text="Part"))
    seen: list[str] = []

    with pytest.raises(ProviderTimeout):
        async for event in provider.stream(make_call(timeout_s=0.3)):
            seen.append(type(event).__name__)

    assert "TextDelta" in seen


async def test_rate_limit_carries_retry_after(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("answer", Step.rate_limited(retry_after="3"), Step.rate_limited(retry_after_ms="250"))

    with pytest.raises(RateLimited) as first:
        await collect(provider, make_call())
    with pytest.raises(RateLimited) as second:
        await collect(provider, make_call())

    assert (first.value.status, first.value.retry_after_s, first.value.quota_exhausted) == (429, 3.0, False)
    assert second.value.retry_after_s == 0.25


async def test_exhausted_quota_is_flagged(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("answer", Step.quota_exhausted())

    with pytest.raises(RateLimited) as caught:
        await collect(provider, make_call())

    assert caught.value.quota_exhausted is True


async def test_server_error_is_a_provider_error_with_status_and_message(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    server.script("answer", Step.server_error(503))

    with pytest.raises(ProviderError) as caught:
        await collect(provider, make_call())

    assert type(caught.value) is ProviderError
    assert caught.value.status == 503
    assert "The server had an error" in caught.value.message


async def test_unknown_model_is_model_unavailable(server: ScriptedServer, provider: OpenAIProvider) -> None:
    server.script("answer", Step.model_not_found("gpt-9"))

    with pytest.raises(ModelUnavailable) as caught:
        await collect(provider, make_call(model="gpt-9"))

    assert caught.value.status == 404
    assert "gpt-9" in caught.value.message


async def test_unreachable_server_is_a_provider_error() -> None:
    port = free_port()
    adapter = OpenAIProvider(f"http://127.0.0.1:{port}/v1", "k", "m")
    try:
        with pytest.raises(ProviderError) as caught:
            await collect(adapter, make_call())
    finally:
        await adapter.aclose()
    assert type(caught.value) is ProviderError
    assert caught.value.status is None


async def test_canonical_messages_and_tools_are_sent_in_openai_shape(
    server: ScriptedServer, provider: OpenAIProvider
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Find the TODOs"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "private", "signature": "x"},
                {"type": "text", "text": "Searching."},
                {"type": "tool_use", "id": "t1", "name": "grep", "input": {"pattern": "TODO"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "a.py:3 TODO"}],
                },
                {"type": "text", "text": "Side question: how many?"},
            ],
        },
    ]
    tools = [{"name": "grep", "description": "search", "input_schema": {"type": "object", "properties": {}}}]

    await collect(provider, make_call(messages=messages, tools=tools, system="Be brief."))

    body = server.requests()[0].body
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Find the TODOs"},
        {
            "role": "assistant",
            "content": "Searching.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "grep", "arguments": '{"pattern": "TODO"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "a.py:3 TODO"},
        {"role": "user", "content": "Side question: how many?"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "grep",
                "parameters": {"type": "object", "properties": {}},
                "description": "search",
            },
        }
    ]
    assert body["tool_choice"] == "none"


async def test_no_tools_means_no_tool_choice(server: ScriptedServer, provider: OpenAIProvider) -> None:
    await collect(provider, make_call())

    body = server.requests()[0].body
    assert "tools" not in body and "tool_choice" not in body


def test_assistant_turn_with_only_tool_calls_has_null_content() -> None:
    converted = to_openai_messages(
        [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "ls", "input": {}}]}], None
    )
    assert converted[0]["content"] is None
    assert converted[0]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_openai_itself_gets_max_completion_tokens_and_other_servers_max_tokens() -> None:
    call = make_call(max_output_tokens=300)
    official = OpenAIProvider("https://api.openai.com/v1", "k")
    local = OpenAIProvider("http://localhost:11434/v1", None)
    assert official.build_request(call)["max_completion_tokens"] == 300
    assert "max_tokens" not in official.build_request(call)
    assert local.build_request(call)["max_tokens"] == 300
    assert official.default_model == "gpt-4o-mini"
