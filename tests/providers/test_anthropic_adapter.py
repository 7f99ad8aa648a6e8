"""The Anthropic adapter, through the real ``anthropic`` SDK, against the scripted ``/v1/messages``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest

from service.providers.anthropic_provider import AnthropicProvider
from service.providers.base import (
    CallUsage,
    ContextOverflow,
    ModelUnavailable,
    ProviderError,
    ProviderTimeout,
    RateLimited,
)
from tests.providers.helpers import collect, make_call
from tests.scripted_provider import ANTHROPIC_OVERFLOW_BODY, ScriptedServer, Step, Usage

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "provider_errors"


def fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    return loaded


@pytest.fixture(scope="module")
async def provider(module_server: ScriptedServer) -> AsyncIterator[AnthropicProvider]:
    adapter = AnthropicProvider(module_server.root_url, "test-key", "claude-scripted")
    yield adapter
    await adapter.aclose()


async def test_text_and_thinking_stream_apart_with_cache_aware_usage(
    server: ScriptedServer, provider: AnthropicProvider
) -> None:
    usage = Usage(5000, 42, cached_tokens=4000, cache_creation_tokens=600)
    server.script("answer", Step.text("Four.", reasoning="2+2=4", chunks=2, usage=usage))

    got = await collect(provider, make_call())

    assert got.reasoning == "2+2=4"
    assert got.text == "Four."
    # input_tokens (400) + cache reads (4000) + cache writes (600); cached = the cache reads.
    assert got.usages[-1] == CallUsage(
        input_tokens=5000, output_tokens=42, reasoning_tokens=0, cached_tokens=4000, reported=True
    )
    # The first report (message_start) already knows the input, so a failure later keeps it.
    assert got.usages[0].input_tokens == 5000
    assert (got.finish.stop_reason, got.finish.raw_stop_reason) == ("stop", "end_turn")


async def test_request_carries_headers_system_cap_and_tool_choice_none(
    server: ScriptedServer, provider: AnthropicProvider
) -> None:
    tools = [{"name": "grep", "description": "search", "input_schema": {"type": "object", "properties": {}}}]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Find TODOs"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "grep", "input": {"p": "x"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py:1"}]},
    ]

    await collect(
        provider,
        make_call(
            purpose="context_summary", request_id="rid-9", messages=messages, tools=tools, system="Sys"
        ),
    )

    (request,) = server.requests()
    assert request.path == "/v1/messages"
    assert request.headers["x-sidequest-purpose"] == "context_summary"
    assert request.headers["x-sidequest-request-id"] == "rid-9"
    assert request.headers["x-stainless-retry-count"] == "0"
    assert request.body["system"] == "Sys"
    assert request.body["max_tokens"] == 512
    assert request.body["stream"] is True
    assert request.body["messages"] == messages
    assert request.body["tools"] == tools
    assert request.body["tool_choice"] == {"type": "none"}


async def test_openai_style_tools_are_converted(server: ScriptedServer, provider: AnthropicProvider) -> None:
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]

    await collect(provider, make_call(tools=tools))

    assert server.requests()[0].body["tools"] == [{"name": "ls", "input_schema": {"type": "object"}}]


async def test_server_tools_go_as_the_main_session_sent_them(
    server: ScriptedServer, provider: AnthropicProvider
) -> None:
    """A server tool goes without an input_schema: Anthropic refuses one on a server tool, so the
    adapter must not add it."""
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    custom = {"name": "grep", "description": "search", "input_schema": {"type": "object"}}
    bare = {"type": "custom", "name": "ls"}

    await collect(provider, make_call(tools=[search, custom, bare]))

    assert server.requests()[0].body["tools"] == [
        search,
        custom,
        {"type": "custom", "name": "ls", "input_schema": {"type": "object", "properties": {}}},
    ]


@pytest.mark.parametrize(
    ("finish", "normalised", "raw"),
    [
        ("length", "length", "max_tokens"),
        ("content_filter", "content_filter", "refusal"),
        ("model_context_window_exceeded", "length", "model_context_window_exceeded"),
        ("pause_turn", "pause_turn", "pause_turn"),
    ],
)
async def test_stop_reasons_are_normalised(
    server: ScriptedServer, provider: AnthropicProvider, finish: str, normalised: str, raw: str
) -> None:
    server.script("answer", Step.text("Cut", finish=finish, usage=Usage(10, 512)))

    got = await collect(provider, make_call())

    assert (got.finish.stop_reason, got.finish.raw_stop_reason) == (normalised, raw)


async def test_tool_use_is_a_tool_call(server: ScriptedServer, provider: AnthropicProvider) -> None:
    server.script("answer", Step.tool_call("grep", arguments='{"pattern": "x"}', text="Let me look."))

    got = await collect(provider, make_call())

    assert [(c.name, c.id) for c in got.tool_calls] == [("grep", "call_scripted_1")]
    assert got.text == "Let me look."
    assert (got.finish.stop_reason, got.finish.raw_stop_reason) == ("tool_calls", "tool_use")


async def test_thinking_only_reply_has_no_body(server: ScriptedServer, provider: AnthropicProvider) -> None:
    server.script("qa_summary", Step.reasoning_only("Let me think", usage=Usage(100, 20)))

    got = await collect(provider, make_call(purpose="qa_summary"))

    assert (got.text, got.reasoning) == ("", "Let me think")


async def test_reply_without_usage_reports_none(server: ScriptedServer, provider: AnthropicProvider) -> None:
    server.script("answer", Step.empty())

    got = await collect(provider, make_call())

    assert got.usages == []
    assert got.text == ""
    assert got.finish.stop_reason == "stop"


@pytest.mark.parametrize("name", ["anthropic_prompt_too_long", "anthropic_input_plus_max_tokens"])
async def test_overflow_before_output_is_a_context_overflow(
    server: ScriptedServer, provider: AnthropicProvider, name: str
) -> None:
    server.script("answer", Step.overflow(fixture(name)["body"]))

    with pytest.raises(ContextOverflow) as caught:
        await collect(provider, make_call())

    assert caught.value.status == 400
    expected = fixture(name)["expected"]
    assert (caught.value.prompt_tokens, caught.value.context_limit) == (
        expected["prompt_tokens"],
        expected["context_limit"],
    )


async def test_request_too_large_413_is_an_overflow(
    server: ScriptedServer, provider: AnthropicProvider
) -> None:
    server.script("answer", Step.http_error(413, fixture("anthropic_request_too_large")["body"]))

    with pytest.raises(ContextOverflow):
        await collect(provider, make_call())


async def test_max_tokens_cap_is_a_provider_error(
    server: ScriptedServer, provider: AnthropicProvider
) -> None:
    server.script("answer", Step.http_error(400, fixture("anthropic_max_tokens_cap")["body"]))

    with pytest.raises(ProviderError) as caught:
        await collect(provider, make_call())

    assert type(caught.value) is ProviderError


async def test_overflow_sent_as_a_stream_error_is_a_context_overflow(
    server: ScriptedServer, provider: AnthropicProvider
) -> None:
    server.script("answer", Step.overflow_in_stream(ANTHROPIC_OVERFLOW_BODY, usage=Usage(200_000, 0)))

    with pytest.raises(ContextOverflow) as caught:
        await collect(provider, make_call())

    assert caught.value.status is None
    assert caught.value.usage is not None and caught.value.usage.input_tokens == 200_000
    # "prompt is too long: 213462 tokens > 200000 maximum", read from the stream's error event.
    assert (caught.value.prompt_tokens, caught.value.context_limit) == (213462, 200000)


async def test_rate_limit_and_overload_are_rate_limited(
    server: ScriptedServer, provider: AnthropicProvider
) -> None:
    limited = fixture("anthropic_rate_limit_tokens")
    server.script(
        "answer",
        Step.http_error(429, limited["body"], headers=limited["headers"]),
        Step.http_error(529, fixture("anthropic_overloaded_529")["body"]),
    )

    with pytest.raises(RateLimited) as first:
        await collect(provider, make_call())
    with pytest.raises(RateLimited) as second:
        await collect(provider, make_call())

    assert (first.value.status, first.value.retry_after_s) == (429, 17.0)
    assert second.value.status == 529


async def test_overload_inside_the_stream_after_output_keeps_input_usage(
    server: ScriptedServer, provider: AnthropicProvider
) -> None:
    overloaded = fixture("anthropic_overloaded_in_stream")["body"]
    server.script("answer", Step.error_after_partial("Part of it", error=overloaded, usage=Usage(3000, 7)))
    seen: list[str] = []

    with pytest.raises(RateLimited) as caught:
        async for event in provider.stream(make_call()):
            seen.append(type(event).__name__)

    assert "TextDelta" in seen
    assert caught.value.usage is not None and caught.value.usage.input_tokens == 3000


async def test_broken_stream_is_a_provider_error(server: ScriptedServer, provider: AnthropicProvider) -> None:
    server.script("answer", Step.error_after_partial("Half", usage=Usage(50, 1)))

    with pytest.raises(ProviderError) as caught:
        await collect(provider, make_call())

    assert type(caught.value) is ProviderError
    assert caught.value.usage is not None and caught.value.usage.input_tokens == 50


async def test_hang_times_out(server: ScriptedServer, provider: AnthropicProvider) -> None:
    server.script("answer", Step.hang())

    started = time.monotonic()
    with pytest.raises(ProviderTimeout):
        await collect(provider, make_call(timeout_s=0.3))

    assert time.monotonic() - started < 5


async def test_unknown_model_is_model_unavailable(
    server: ScriptedServer, provider: AnthropicProvider
) -> None:
    server.script("answer", Step.http_error(404, fixture("anthropic_model_not_found")["body"]))

    with pytest.raises(ModelUnavailable):
        await collect(provider, make_call())


async def test_api_error_500_is_a_provider_error(server: ScriptedServer, provider: AnthropicProvider) -> None:
    body = {"type": "error", "error": {"type": "api_error", "message": "Internal server error"}}
    server.script("answer", Step.http_error(500, body))

    with pytest.raises(ProviderError) as caught:
        await collect(provider, make_call())

    assert (type(caught.value), caught.value.status, caught.value.message) == (
        ProviderError,
        500,
        "Internal server error",
    )


async def test_an_sdk_error_before_the_stream_is_classified_like_the_openai_adapters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDK's plain APIError (no status: a body it could not use) is a provider error, not a bug."""
    adapter = AnthropicProvider("http://127.0.0.1:9", "k", "claude-scripted")
    body = {"type": "error", "error": {"type": "api_error", "message": "upstream said no"}}

    async def refuse(**_: Any) -> Any:
        raise anthropic.APIError("upstream said no", httpx2.Request("POST", "http://127.0.0.1:9"), body=body)

    monkeypatch.setattr(adapter._client.messages, "create", refuse)
    try:
        with pytest.raises(ProviderError) as caught:
            await collect(adapter, make_call())
    finally:
        await adapter.aclose()
    assert (type(caught.value), caught.value.status, caught.value.message) == (
        ProviderError,
        None,
        "upstream said no",
    )


async def test_an_sdk_error_without_a_body_says_its_own_message_before_and_inside_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    adapter = AnthropicProvider("http://127.0.0.1:9", "k", "claude-scripted")
    request = httpx2.Request("POST", "http://127.0.0.1:9")

    class Broken:
        def __aiter__(self) -> Broken:
            return self

        async def __anext__(self) -> Any:
            raise anthropic.APIError("the stream said no", request, body=None)

        async def close(self) -> None:
            pass

    async def refuse(**_: Any) -> Any:
        raise anthropic.APIError("upstream said no", request, body=None)

    async def broken(**_: Any) -> Any:
        return Broken()

    messages = []
    try:
        for create in (refuse, broken):
            monkeypatch.setattr(adapter._client.messages, "create", create)
            with pytest.raises(ProviderError) as caught:
                await collect(adapter, make_call())
            assert type(caught.value) is ProviderError
            messages.append(caught.value.message)
    finally:
        await adapter.aclose()
    assert messages == ["upstream said no", "the stream said no"]


def test_default_model_is_documented_default() -> None:
    assert AnthropicProvider(None, "k").default_model == "claude-sonnet-4-5"
