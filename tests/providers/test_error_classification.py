"""Every real provider error body we keep as a fixture is classified as its fixture says."""

from __future__ import annotations

import datetime
import json
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
from service.providers.errors import classify_http_error, classify_stream_error, parse_retry_after

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "provider_errors"
FIXTURE_FILES = sorted(FIXTURES.glob("*.json"))

CLASSES: dict[str, type[ProviderError]] = {
    "context_overflow": ContextOverflow,
    "model_unavailable": ModelUnavailable,
    "rate_limited": RateLimited,
    "timeout": ProviderTimeout,
    "provider_error": ProviderError,
}


def _load(path: Path) -> dict[str, Any]:
    fixture: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return fixture


def _classify(fixture: dict[str, Any]) -> ProviderError:
    now = None
    if "classified_at" in fixture:
        now = datetime.datetime.fromisoformat(fixture["classified_at"].replace("Z", "+00:00")).timestamp()
    if fixture["in_stream"]:
        return classify_stream_error(fixture["body"])
    return classify_http_error(fixture["status"], fixture["body"], fixture["headers"], now=now)


def test_fixtures_exist_and_name_their_source() -> None:
    assert len(FIXTURE_FILES) >= 40
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


def test_the_docs_table_lists_every_fixture() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "providers.md").read_text(encoding="utf-8")
    missing = [p.stem for p in FIXTURE_FILES if f"[`{p.stem}`]" not in docs]
    assert missing == []


def test_every_provider_named_in_the_issue_has_an_overflow_fixture() -> None:
    overflow_providers = {
        _load(p)["provider"].split(" (")[0]
        for p in FIXTURE_FILES
        if _load(p)["expected"]["error"] == "context_overflow"
    }
    for provider in (
        "OpenAI",
        "Anthropic",
        "vLLM",
        "llama.cpp server",
        "Ollama",
        "Hugging Face TGI",
        "Mistral",
        "Groq",
    ):
        assert provider in overflow_providers


def test_overflow_inside_a_stream_is_still_an_overflow_without_a_status() -> None:
    error = classify_stream_error({"error": {"message": "prompt is too long: 5 tokens > 4 maximum"}})
    assert type(error) is ContextOverflow
    assert error.status is None


def test_unrecognised_stream_error_is_a_plain_provider_error() -> None:
    error = classify_stream_error("upstream went away")
    assert type(error) is ProviderError
    assert error.message == "upstream went away"


def test_usage_reported_before_the_failure_is_kept_on_the_error() -> None:
    from service.providers.base import CallUsage

    usage = CallUsage(input_tokens=10, output_tokens=2, reported=True)
    error = classify_http_error(500, {"error": {"message": "boom"}}, {}, usage=usage)
    assert error.usage == usage


def test_an_ordinary_400_is_not_an_overflow() -> None:
    error = classify_http_error(400, {"error": {"message": "Invalid value for 'tool_choice'."}}, {})
    assert type(error) is ProviderError
    assert error.status == 400


def test_overflow_wording_in_a_500_is_not_an_overflow_unless_llama_cpp_says_so() -> None:
    # Only llama.cpp's own wording is trusted in a 5xx; a generic server error quoting a prompt is not.
    error = classify_http_error(502, {"error": {"message": "upstream said: prompt is too long"}}, {})
    assert type(error) is ProviderError


def test_request_timeout_status_is_a_timeout() -> None:
    assert type(classify_http_error(408, "Request Timeout", {})) is ProviderTimeout


def test_413_without_rate_wording_is_an_overflow_but_with_it_a_rate_limit() -> None:
    assert type(classify_http_error(413, "Payload Too Large", {})) is ContextOverflow
    tpm = {"error": {"message": "Request too large on tokens per minute (TPM): Limit 6000, Requested 9000"}}
    assert type(classify_http_error(413, tpm, {})) is RateLimited


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
        ({}, "Please try again in 6s.", 6.0),
        ({}, "Please try again in 820ms.", 0.82),
        ({}, "no hint", None),
        (None, None, None),
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
