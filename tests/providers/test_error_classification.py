"""Every real provider error body we keep as a fixture is classified as its fixture says."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Any

import pytest

from service.providers.base import (
    ContextOverflow,
    ModelUnavailable,
    ProviderError,
    ProviderTimeout,
    RateLimited,
)
from service.providers.errors import classify_error, overflow_counts
from service.providers.retry_after import parse_retry_after
from tests.providers import error_table

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "provider_errors"
FIXTURE_FILES = sorted(FIXTURES.glob("*.json"))
COUNT_KEYS = ("prompt_tokens", "context_limit")

CLASSES: dict[str, type[ProviderError]] = {
    "context_overflow": ContextOverflow,
    "model_unavailable": ModelUnavailable,
    "rate_limited": RateLimited,
    "timeout": ProviderTimeout,
    "provider_error": ProviderError,
}


# Overflow phrasings seen from real servers: (message, prompt tokens it states, window it states).
OVERFLOW_PHRASINGS: list[tuple[str, int | None, int | None]] = [
    (
        "'max_tokens' or 'max_completion_tokens' is too large: 4096. This model's maximum context "
        "length is 8192 tokens and your request has 5000 input tokens (4096 > 8192 - 5000).",
        5000,
        8192,
    ),
    (
        "The decoder prompt (length 9000) is longer than the maximum model length of 8192. Make sure "
        "that `max_model_len` is no smaller than the number of text tokens.",
        9000,
        8192,
    ),
    (
        "You passed 31745 input tokens and requested 1024 output tokens. However, the model's context "
        "length is only 32768 tokens, resulting in a maximum input length of 31744 tokens.",
        31745,
        32768,
    ),
    ("The input (85050 tokens) is longer than the model's context length (32768 tokens).", 85050, 32768),
    ("Requested token count exceeds the model's maximum context length of 131072 tokens.", None, 131072),
    (
        "Trying to keep the first 6547 tokens when context the overflows. However, the model is loaded "
        "with context length of only 4096 tokens, which is not enough.",
        None,
        4096,
    ),
    (
        "litellm.ContextWindowExceededError: litellm.BadRequestError: ContextWindowExceededError: "
        "OpenAIException - This model's maximum context length is 4096 tokens. However, your request "
        "has 5120 input tokens.",
        5120,
        4096,
    ),
]
# Model-not-found wordings, whatever the status (None: inside a stream).
MODEL_NOT_FOUND_PHRASINGS: list[tuple[int | None, str]] = [
    (400, "anthropic/claude-sonnet-4-6 is not a valid model ID"),
    (400, "Unable to access non-serverless model Qwen/Qwen3-32B. Please visit https://api.together.ai"),
    (500, "Unable to access non-serverless model Qwen/Qwen3-32B."),  # re-wrapped by a gateway
    (400, "/chat/completions: Invalid model name passed in model=gpt-x. Call `/v1/models` to view"),
    (422, "The model `llama-9` does not exist."),
    (None, "model 'qwen3' not found"),
]


def _load(path: Path) -> dict[str, Any]:
    fixture: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return fixture


def _classify(fixture: dict[str, Any]) -> ProviderError:
    now = None
    if "classified_at" in fixture:
        now = datetime.datetime.fromisoformat(fixture["classified_at"].replace("Z", "+00:00")).timestamp()
    if fixture["in_stream"]:
        return classify_error(None, fixture["body"])
    return classify_error(fixture["status"], fixture["body"], fixture["headers"], now=now)


def test_fixtures_exist_and_name_their_source() -> None:
    assert len(FIXTURE_FILES) >= 80
    for path in FIXTURE_FILES:
        fixture = _load(path)
        assert fixture["source"].startswith("https://"), path.name
        assert fixture["expected"]["error"] in CLASSES, path.name


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=[p.stem for p in FIXTURE_FILES])
def test_real_error_body_is_classified_as_recorded(path: Path) -> None:
    fixture = _load(path)
    expected = fixture["expected"]
    error = _classify(fixture)
    # Exact class: a ContextOverflow is also a ProviderError, so isinstance would prove nothing.
    assert type(error) is CLASSES[expected["error"]], f"{path.name}: got {type(error).__name__}: {error}"
    assert error.message, path.name
    if not fixture["in_stream"] and fixture["status"] is not None:
        assert error.status == fixture["status"]
    if "retry_after_s" in expected:
        assert isinstance(error, RateLimited)
        assert error.retry_after_s == pytest.approx(expected["retry_after_s"])
    if "quota_exhausted" in expected:
        assert isinstance(error, RateLimited)
        assert error.quota_exhausted is expected["quota_exhausted"]
    if isinstance(error, ContextOverflow):
        # Exactly the counts the body states (absent from the fixture = the body does not state it).
        assert (error.prompt_tokens, error.context_limit) == (
            expected.get("prompt_tokens"),
            expected.get("context_limit"),
        ), path.name
    else:
        assert not any(key in expected for key in COUNT_KEYS), path.name


def test_the_docs_table_is_generated_from_the_fixtures() -> None:
    """docs/providers.md shows exactly the fixtures and their classification (regenerate with
    ``python -m tests.providers.error_table --write``)."""
    documented = error_table.documented_table(error_table.DOC.read_text(encoding="utf-8"))
    assert documented == error_table.render_table()
    missing = [p.stem for p in FIXTURE_FILES if f"[`{p.stem}`]" not in documented]
    assert missing == []


def _servers_with(kind: str, **expected: Any) -> set[str]:
    servers = set()
    for path in FIXTURE_FILES:
        fixture = _load(path)
        wanted = fixture["expected"]
        if wanted["error"] == kind and all(wanted.get(k) == v for k, v in expected.items()):
            servers.add(error_table.server_of(fixture))
    return servers


def test_every_server_spec_names_has_an_overflow_fixture() -> None:
    assert set(error_table.SPEC_SERVERS) - _servers_with("context_overflow") == set()


def test_rate_limit_quota_and_model_unavailable_bodies_are_collected_across_servers() -> None:
    assert {
        "OpenAI",
        "Anthropic",
        "Groq",
        "LiteLLM proxy",
        "OpenRouter",
        "Mistral",
        "Azure OpenAI",
        "Amazon Bedrock",
        "Gemini",
    } <= _servers_with("rate_limited", quota_exhausted=False) | _servers_with("rate_limited")
    assert {"OpenAI", "OpenRouter", "DeepSeek"} <= _servers_with("rate_limited", quota_exhausted=True)
    assert {
        "OpenAI",
        "Anthropic",
        "vLLM",
        "Ollama",
        "LiteLLM proxy",
        "OpenRouter",
        "Together AI",
        "Azure OpenAI",
        "Gemini",
    } <= _servers_with("model_unavailable")
    # Parameter-cap look-alikes (a max_tokens refused with no word of the window) stay provider errors.
    assert {"OpenAI", "Anthropic", "Groq", "Hugging Face TGI"} <= _servers_with("provider_error")


@pytest.mark.parametrize(
    "name",
    [
        "openai_completion_alone_fills_window",
        "openrouter_output_fills_window_in_body",
        "vllm_completion_alone_too_large",
        "vllm_max_tokens_too_large",
    ],
)
def test_input_and_output_together_over_the_window_is_an_overflow_even_when_the_output_fills_it(
    name: str,
) -> None:
    """SPEC §7: "an error that says the input and the requested output together exceed the context
    length *is* an overflow, even when it names max_tokens". When the output cap alone fills the
    window no shrinking helps: the message says which setting to change (a 4096-token local model
    with the default 8192 output cap is the common case, and is not a plain provider_error)."""
    error = _classify(_load(FIXTURES / f"{name}.json"))
    assert type(error) is ContextOverflow
    # An input that overflows beside an output that leaves room: shrinking helps, retried as usual.
    room = _classify(_load(FIXTURES / "anthropic_input_plus_max_tokens.json"))
    assert isinstance(room, ContextOverflow) and not room.output_fills_window
    assert (
        error.output_fills_window
        and "fills the model's" in error.message
        and "set context_window" in error.message
    )


def test_the_issue_phrasings_are_overflows_with_their_counts() -> None:
    """Every phrasing in OVERFLOW_PHRASINGS, each through the classifier with a 400."""
    for message, prompt, limit in OVERFLOW_PHRASINGS:
        error = classify_error(400, {"error": {"message": message}}, {})
        assert type(error) is ContextOverflow, message
        assert (error.prompt_tokens, error.context_limit) == (prompt, limit), message


def test_model_not_found_variants_are_model_unavailable_whatever_the_status() -> None:
    for status, message in MODEL_NOT_FOUND_PHRASINGS:
        error = classify_error(status, {"error": {"message": message}}, {})
        assert type(error) is ModelUnavailable, (status, message)


def test_an_outage_that_names_the_model_is_not_a_missing_model() -> None:
    error = classify_error(503, {"error": {"message": "The model server is not available right now"}}, {})
    assert type(error) is ProviderError


def test_a_rate_limit_that_names_its_model_is_still_a_rate_limit() -> None:
    body = {"error": {"message": "Rate limit reached for model `x` … model not found in cache", "code": None}}
    assert type(classify_error(429, body, {})) is RateLimited


def test_overflow_counts_come_from_the_error_fields_when_the_message_has_none() -> None:
    assert overflow_counts(
        "the request exceeds the available context size", {"n_prompt_tokens": 9, "n_ctx": 8}
    ) == (
        9,
        8,
    )
    assert overflow_counts("prompt too long; exceeded max context length by 4 tokens") == (None, None)
    assert overflow_counts("This model's maximum context length is 0 tokens") == (None, None)


def test_overflow_inside_a_stream_is_still_an_overflow_without_a_status() -> None:
    error = classify_error(None, {"error": {"message": "prompt is too long: 5 tokens > 4 maximum"}})
    assert type(error) is ContextOverflow
    assert error.status is None


def test_unrecognised_stream_error_is_a_plain_provider_error() -> None:
    error = classify_error(None, "upstream went away")
    assert type(error) is ProviderError
    assert error.message == "upstream went away"


def test_usage_reported_before_the_failure_is_kept_on_the_error() -> None:
    from service.providers.base import CallUsage

    usage = CallUsage(input_tokens=10, output_tokens=2, reported=True)
    error = classify_error(500, {"error": {"message": "boom"}}, {}, usage=usage)
    assert error.usage == usage


def test_an_ordinary_400_is_not_an_overflow() -> None:
    error = classify_error(400, {"error": {"message": "Invalid value for 'tool_choice'."}}, {})
    assert type(error) is ProviderError
    assert error.status == 400


def test_overflow_wording_in_a_gateway_5xx_is_an_overflow_but_a_plain_5xx_is_not() -> None:
    # SPEC §7: an overflow is an overflow whatever the status, a gateway's 500/502 included.
    error = classify_error(
        502, {"error": {"message": "upstream said: prompt is too long: 9 tokens > 8 maximum"}}, {}
    )
    assert type(error) is ContextOverflow
    assert (error.status, error.prompt_tokens, error.context_limit) == (502, 9, 8)
    assert type(classify_error(500, {"error": {"message": "Internal Server Error"}}, {})) is ProviderError
    # A bare "Payload Too Large" means a body-size limit only with the status that says so.
    assert type(classify_error(500, "Payload Too Large", {})) is ProviderError


def test_a_providers_408_is_its_own_error_not_the_side_requests_deadline() -> None:
    """SPEC 8's timeout is the side request's deadline (detail timeout_s, stage); a 408 is the
    provider's: provider_error with its status and words, while the request's own deadline has not passed."""
    error = classify_error(408, {"error": {"message": "Request timed out."}}, {})
    assert type(error) is ProviderError and (error.status, error.message) == (408, "Request timed out.")


@pytest.mark.parametrize(
    "body", [{"detail": "Not Found"}, "404 page not found", {"error": {"message": "no route"}}]
)
def test_a_404_that_names_no_model_is_a_wrong_endpoint_not_a_missing_model(body: object) -> None:
    """SPEC 7 counts a 404 *on the model* as model_unavailable; a route that is not there (a base URL
    with or without its /v1) is a provider error that says where to look."""
    error = classify_error(404, body, {})
    assert type(error) is ProviderError and error.status == 404
    assert "SIDEQUEST_BASE_URL" in error.message
    named = classify_error(404, {"error": {"message": "model 'x' not found"}}, {})
    assert type(named) is ModelUnavailable


def test_413_without_rate_wording_is_an_overflow_but_with_it_a_rate_limit() -> None:
    assert type(classify_error(413, "Payload Too Large", {})) is ContextOverflow
    tpm = {"error": {"message": "Request too large on tokens per minute (TPM): Limit 6000, Requested 9000"}}
    assert type(classify_error(413, tpm, {})) is RateLimited


@pytest.mark.parametrize(
    ("headers", "message", "expected"),
    [
        ({"Retry-After": "12"}, None, 12.0),
        ({"retry-after": "0.5"}, None, 0.5),
        ({"retry-after-ms": "250"}, None, 0.25),
        ({"retry-after-ms": "250", "retry-after": "9"}, None, 0.25),
        ({"retry-after": "Wed, 21 Oct 2026 07:28:10 GMT"}, None, 10.0),
        ({"retry-after": "Wed, 21 Oct 2026 07:27:00 GMT"}, None, 0.0),  # already passed
        ({"retry-after": "soon"}, None, None),
        ({"llm_provider-retry-after": "3"}, "Please try again in 600ms.", 3.0),  # LiteLLM's proxy
        ({"llm_provider-retry-after": "3", "retry-after": "5"}, None, 5.0),
        ({}, "Please try again in 6s.", 6.0),
        ({}, "Please try again in 820ms.", 0.82),
        ({}, "Rate limit reached for requests. Please try again in 1m30s.", 90.0),  # minutes too, not 1 s
        ({}, "Please try again in 2m0.5s.", 120.5),
        ({}, "Please try again in 1h2m.", 3720.0),
        ({}, "Please retry after 2 minutes.", 120.0),
        ({}, "Please retry after 9 seconds. Please go here: https://aka.ms/oai/quotaincrease", 9.0),
        ({}, "Please retry in 20.04466179s.", 20.04466179),
        ({}, '{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "26s"}', 26.0),
        ({}, "{'@type': 'type.googleapis.com/google.rpc.RetryInfo', 'retryDelay': '26s'}", 26.0),
        ({}, "no hint", None),
        (None, None, None),
        # OpenAI's reset headers, last (a default 1 s wait would hit the limit again): the limit the
        # message names, else the later reset.
        (
            {"x-ratelimit-reset-requests": "4s", "x-ratelimit-reset-tokens": "6m0s"},
            "Rate limit reached for requests",
            4.0,
        ),
        (
            {"x-ratelimit-reset-requests": "4s", "x-ratelimit-reset-tokens": "6m0s"},
            "on tokens per min (TPM)",
            360.0,
        ),
        ({"x-ratelimit-reset-requests": "4s", "x-ratelimit-reset-tokens": "20ms"}, "Too many requests", 4.0),
        ({"x-ratelimit-reset-requests": "1s", "x-ratelimit-reset-tokens": "20ms"}, "no hint", 1.0),
        ({"x-ratelimit-reset-tokens": "20ms", "retry-after": "2"}, None, 2.0),
        ({"x-ratelimit-reset-requests": "soon"}, None, None),
    ],
)
def test_retry_after_is_parsed_from_seconds_dates_milliseconds_and_messages(
    headers: dict[str, str] | None, message: str | None, expected: float | None
) -> None:
    now = datetime.datetime(2026, 10, 21, 7, 28, 0, tzinfo=datetime.UTC).timestamp()
    result = parse_retry_after(headers, message=message, now=now)
    if expected is None:
        assert result is None
    else:
        assert result == pytest.approx(expected)


def test_an_http_date_is_gmt_whatever_its_zone_says_and_whatever_the_machines_zone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # RFC 9110 dates are always GMT; "-0000" (RFC 2822's "zone unknown") parses without a zone.
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        now = datetime.datetime(2026, 10, 21, 7, 28, 0, tzinfo=datetime.UTC).timestamp()
        for date in ("Wed, 21 Oct 2026 07:28:10 GMT", "Wed, 21 Oct 2026 07:28:10 -0000"):
            assert parse_retry_after({"retry-after": date}, now=now) == pytest.approx(10.0)
    finally:
        monkeypatch.undo()
        time.tzset()
