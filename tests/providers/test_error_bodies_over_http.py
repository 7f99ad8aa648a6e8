"""Error bodies that are not clean JSON, over real HTTP through the real SDKs and adapters.

test_error_body_forms feeds the classifier each body form directly; these check that the SDKs really
deliver such bodies to it: a text body with an error status, one labelled JSON that does not parse,
and an in-stream chunk that is text or broken JSON (which the openai SDK cannot decode at all).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from service.providers.anthropic_provider import AnthropicProvider
from service.providers.base import ContextOverflow, ProviderError, RateLimited
from service.providers.openai_compat import OpenAIProvider
from tests.providers.helpers import collect, make_call
from tests.scripted_provider import ScriptedServer, Step, Usage

# What SGLang sends: JSON but for its \' escape, which makes it invalid JSON.
SGLANG_OVERFLOW_TEXT = (
    '{"object":"error","message":"The input (61709 tokens) is longer than the model\\\'s context length '
    '(40960 tokens).","type":"BadRequestError","param":null,"code":400}'
)
SGLANG_MESSAGE = "The input (61709 tokens) is longer than the model's context length (40960 tokens)."


@pytest.fixture(scope="module")
async def openai_provider(module_server: ScriptedServer) -> AsyncIterator[OpenAIProvider]:
    adapter = OpenAIProvider(module_server.base_url, "test-key", "scripted-model")
    yield adapter
    await adapter.aclose()


@pytest.fixture(scope="module")
async def anthropic_provider(module_server: ScriptedServer) -> AsyncIterator[AnthropicProvider]:
    adapter = AnthropicProvider(module_server.root_url, "test-key", "claude-scripted")
    yield adapter
    await adapter.aclose()


def test_the_sglang_body_is_not_json() -> None:
    with pytest.raises(ValueError):
        json.loads(SGLANG_OVERFLOW_TEXT)


@pytest.mark.parametrize("content_type", [None, "application/json"])
async def test_sglangs_text_overflow_body_is_a_context_overflow_with_its_counts(
    server: ScriptedServer, openai_provider: OpenAIProvider, content_type: str | None
) -> None:
    headers = {"content-type": content_type} if content_type else None
    server.script("answer", Step.http_error(400, SGLANG_OVERFLOW_TEXT, headers=headers))

    with pytest.raises(ContextOverflow) as caught:
        await collect(openai_provider, make_call())

    error = caught.value
    assert (error.status, error.prompt_tokens, error.context_limit) == (400, 61709, 40960)
    assert error.message == SGLANG_MESSAGE


@pytest.mark.parametrize(
    "data",
    [
        # A chunk that does not parse: the SDK raises JSONDecodeError, not its APIError.
        json.dumps({"error": {"message": SGLANG_MESSAGE, "code": 400}}).replace("'", "\\'"),
        # The error as a JSON string inside the chunk's JSON.
        json.dumps({"error": json.dumps({"object": "error", "message": SGLANG_MESSAGE, "code": 400})}),
        # Plain words.
        SGLANG_MESSAGE,
    ],
    ids=["broken_json", "json_in_a_string", "plain_text"],
)
async def test_an_overflow_inside_the_stream_in_any_form_is_a_context_overflow(
    server: ScriptedServer, openai_provider: OpenAIProvider, data: str
) -> None:
    server.script("answer", Step.text_error_in_stream(data))

    with pytest.raises(ContextOverflow) as caught:
        await collect(openai_provider, make_call())

    assert (caught.value.prompt_tokens, caught.value.context_limit) == (61709, 40960)
    assert caught.value.message == SGLANG_MESSAGE


async def test_an_unrecognised_chunk_that_is_not_json_stays_a_provider_error_with_its_usage(
    server: ScriptedServer, openai_provider: OpenAIProvider
) -> None:
    server.script(
        "answer", Step(stream_error_text="this is { not json", usage=Usage(70, 0), usage_first=True)
    )

    with pytest.raises(ProviderError) as caught:
        await collect(openai_provider, make_call())

    assert type(caught.value) is ProviderError
    assert caught.value.message.startswith("the stream sent invalid data")
    assert caught.value.usage is not None and caught.value.usage.input_tokens == 70


async def test_a_rate_limit_body_cut_short_is_still_a_rate_limit_with_its_wait(
    server: ScriptedServer, openai_provider: OpenAIProvider
) -> None:
    body = '{"error": {"message": "Rate limit reached on tokens per min (TPM). Please try again in 2s.", "ty'
    server.script("answer", Step.http_error(413, body, headers={"content-type": "application/json"}))

    with pytest.raises(RateLimited) as caught:
        await collect(openai_provider, make_call())

    assert caught.value.retry_after_s == pytest.approx(2.0)


async def test_the_anthropic_adapter_reads_a_body_cut_short_too(
    server: ScriptedServer, anthropic_provider: AnthropicProvider
) -> None:
    body = (
        '{"type":"error","error":{"type":"invalid_request_error",'
        '"message":"prompt is too long: 213462 tokens > 200000 maximum"'
    )
    server.script("answer", Step.http_error(400, body, headers={"content-type": "application/json"}))

    with pytest.raises(ContextOverflow) as caught:
        await collect(anthropic_provider, make_call(model="claude-scripted"))

    assert (caught.value.prompt_tokens, caught.value.context_limit) == (213462, 200000)
    assert caught.value.message == "prompt is too long: 213462 tokens > 200000 maximum"


async def test_the_anthropic_adapter_reads_an_in_stream_error_that_is_not_json(
    server: ScriptedServer, anthropic_provider: AnthropicProvider
) -> None:
    data = '{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"'
    server.script("answer", Step.text_error_in_stream(data))

    with pytest.raises(RateLimited):
        await collect(anthropic_provider, make_call(model="claude-scripted"))
