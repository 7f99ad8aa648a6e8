"""Every recognised error phrasing is found whatever form its body arrives in.

The fixture table (``tests/fixtures/provider_errors``, tabled in docs/providers.md) pins each real body
as its server sent it. Servers and gateways also send the same words as plain text, as JSON inside a JSON
string, as JSON that does not parse (SGLang's ``\\'`` escapes; a body cut short) and as an error inside
a 200 stream; an overflow missed in any of them skips the overflow retry (SPEC §7), so every fixture is
classified again in each form, with the same class and the same numbers (SPEC §5.1).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from service.providers.base import ContextOverflow, ModelUnavailable, ProviderError, RateLimited
from service.providers.errors import classify_error
from tests.providers.test_error_classification import (
    CLASSES,
    MODEL_NOT_FOUND_PHRASINGS,
    OVERFLOW_PHRASINGS,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "provider_errors"
FIXTURE_FILES = sorted(FIXTURES.glob("*.json"))


def _load(path: Path) -> dict[str, Any]:
    fixture: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return fixture


def _inline_fixtures() -> dict[str, dict[str, Any]]:
    """The phrasings test_error_classification pins inline, as fixtures of the same shape."""
    cases: dict[str, dict[str, Any]] = {}
    for index, (message, prompt, limit) in enumerate(OVERFLOW_PHRASINGS):
        expected: dict[str, Any] = {"error": "context_overflow"}
        expected.update({k: v for k, v in (("prompt_tokens", prompt), ("context_limit", limit)) if v})
        cases[f"issue_overflow_{index}"] = {
            "status": 400,
            "in_stream": False,
            "headers": {},
            "body": {"error": {"message": message}},
            "expected": expected,
        }
    for index, (status, message) in enumerate(MODEL_NOT_FOUND_PHRASINGS):
        cases[f"model_not_found_{index}"] = {
            "status": status,
            "in_stream": status is None,
            "headers": {},
            "body": {"error": {"message": message}},
            "expected": {"error": "model_unavailable"},
        }
    return cases


CASES: dict[str, dict[str, Any]] = {p.stem: _load(p) for p in FIXTURE_FILES} | _inline_fixtures()


def _words(body: Any) -> str:
    """The error's words as the server wrote them (its message, or the whole text)."""
    inner = body[0] if isinstance(body, list) and len(body) == 1 else body
    if isinstance(inner, str):
        return inner
    error = inner.get("error", inner)
    if isinstance(error, str):
        return error
    words = error.get("message") or error.get("detail") or inner.get("detail")
    return words if isinstance(words, str) else json.dumps(body)


def _inner_error(body: Any) -> Any:
    """What the SDK hands over for an in-stream ``{"error": …}`` chunk: the error itself."""
    inner = body[0] if isinstance(body, list) and len(body) == 1 else body
    return inner.get("error", inner) if isinstance(inner, dict) else inner


def _backslash_quotes(text: str) -> str:
    """``'`` escaped as ``\\'``, as Python string code builds it (SGLang): no longer JSON."""
    return text.replace("'", "\\'")


def _cut_short(text: str) -> str:
    """The body with its closing brackets lost (a proxy's length cap, a dropped connection)."""
    return text.rstrip("}]") if text.lstrip().startswith(("{", "[")) else text[:-1]


# How a body reaches the classifier with its HTTP status: (body, status) -> what the adapter passes.
HTTP_FORMS: dict[str, Callable[[Any, int | None], Any]] = {
    "json": lambda body, status: body,  # parsed, as the anthropic SDK hands it over
    "json_text": lambda body, status: json.dumps(body),  # the response text the openai adapter reads
    "plain_text": lambda body, status: _words(body),
    "printed_by_a_gateway": lambda body, status: f"Error code: {status} - {body!r}",  # str(SDK error)
    "json_in_a_string": lambda body, status: json.dumps(json.dumps(body)),
    "backslash_quote_escapes": lambda body, status: _backslash_quotes(json.dumps(body)),
    "cut_short": lambda body, status: _cut_short(json.dumps(body)),
    "broken_json_in_a_string": lambda body, status: json.dumps(_backslash_quotes(json.dumps(body))),
}
# How it reaches the classifier from inside a 200 stream (no status): what the adapter passes.
STREAM_FORMS: dict[str, Callable[[Any], Any]] = {
    "stream_error_object": _inner_error,  # data: {"error": {...}}
    "stream_error_json_string": lambda body: json.dumps(body),  # data: {"error": "<the body as JSON>"}
    # data: {"error": ...} that does not parse: the adapter classifies the chunk's text.
    "stream_chunk_not_json": lambda body: _backslash_quotes(json.dumps({"error": _inner_error(body)})),
    "stream_chunk_plain_text": _words,  # data: <the words>
}

# Where a form cannot carry what the classification rests on, what it must come to instead (and why).
_BY_STATUS_ONLY = ("provider_error", None, None)
EXCEPTIONS: dict[tuple[str, str], tuple[tuple[str, int | None, int | None], str]] = {
    **{
        ("anthropic_model_not_found", form): (
            _BY_STATUS_ONLY,
            "'model: sonnet4' names a missing model only beside its 404",
        )
        for form in STREAM_FORMS
    },
    **{
        ("proxy_413_html", form): (
            _BY_STATUS_ONLY,
            "'Request Entity Too Large' is a too-long request only as a 413",
        )
        for form in STREAM_FORMS
    },
    ("anthropic_request_too_large", "stream_chunk_plain_text"): (
        _BY_STATUS_ONLY,
        "'exceeds the maximum allowed number of bytes' is an overflow only with its 413 or its type",
    ),
    ("llamacpp_overflow_in_stream", "plain_text"): (
        ("context_overflow", None, None),
        "its counts are the fields n_prompt_tokens / n_ctx, not words",
    ),
    ("llamacpp_overflow_in_stream", "stream_chunk_plain_text"): (
        ("context_overflow", None, None),
        "its counts are the fields n_prompt_tokens / n_ctx, not words",
    ),
}


KIND_OF = {cls: kind for kind, cls in CLASSES.items()}


def _classified_at(case: dict[str, Any]) -> float | None:
    """The clock an HTTP-date ``Retry-After`` of the fixture is read against."""
    stamp = case.get("classified_at")
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


def _outcome(error: ProviderError) -> tuple[str, int | None, int | None]:
    # Exact class: a ContextOverflow is also a ProviderError, so isinstance would prove nothing.
    if isinstance(error, ContextOverflow):
        return (KIND_OF[type(error)], error.prompt_tokens, error.context_limit)
    return (KIND_OF[type(error)], None, None)


def _expected(case: dict[str, Any]) -> tuple[str, int | None, int | None]:
    expected = case["expected"]
    return (expected["error"], expected.get("prompt_tokens"), expected.get("context_limit"))


# Where a form loses the wait a rate limit states (its HTTP forms keep the headers).
WAIT_LOST: dict[tuple[str, str], str] = {
    (
        "gemini_resource_exhausted_retry_delay",
        "plain_text",
    ): "its retryDelay is in the details, not the words",
}


def _check(name: str, form: str, case: dict[str, Any], error: ProviderError) -> None:
    wanted, why = EXCEPTIONS.get((name, form), (_expected(case), "as the fixture says"))
    assert _outcome(error) == wanted, f"{name} as {form} ({why}): {error.message}"
    if isinstance(error, RateLimited) and "quota_exhausted" in case["expected"]:
        assert error.quota_exhausted is case["expected"]["quota_exhausted"], (name, form)
    if form in HTTP_FORMS and "retry_after_s" in case["expected"] and (name, form) not in WAIT_LOST:
        assert isinstance(error, RateLimited), (name, form)
        assert error.retry_after_s == pytest.approx(case["expected"]["retry_after_s"]), (name, form)
    # The message is the server's words with the escapes undone, never the escaped text.
    assert error.message and "\\'" not in error.message and '\\"' not in error.message, error.message


@pytest.mark.parametrize("form", list(HTTP_FORMS))
@pytest.mark.parametrize("name", list(CASES))
def test_a_phrasing_is_classified_alike_in_every_body_form(name: str, form: str) -> None:
    case = CASES[name]
    body = HTTP_FORMS[form](case["body"], case["status"])
    if case["in_stream"]:
        error = classify_error(None, body)
    else:
        error = classify_error(case["status"], body, case["headers"], now=_classified_at(case))
        assert error.status == case["status"]
    _check(name, form, case, error)


@pytest.mark.parametrize("form", list(STREAM_FORMS))
@pytest.mark.parametrize("name", list(CASES))
def test_a_phrasing_inside_the_stream_is_classified_alike_in_every_form(name: str, form: str) -> None:
    case = CASES[name]
    _check(name, form, case, classify_error(None, STREAM_FORMS[form](case["body"])))


def test_every_exception_is_a_real_case_and_form() -> None:
    forms = set(HTTP_FORMS) | set(STREAM_FORMS)
    for listed in (EXCEPTIONS, WAIT_LOST):
        assert {(name, form) for name, form in listed if name in CASES and form in forms} == set(listed)


def test_sglangs_overflow_with_backslash_quote_escapes_is_an_overflow_with_its_counts() -> None:
    """The body SGLang sends: text that is JSON but for its ``\\'``."""
    body = (
        '{"object":"error","message":"The input (61709 tokens) is longer than the model\\\'s context '
        'length (40960 tokens).","type":"BadRequestError","param":null,"code":400}'
    )
    with pytest.raises(ValueError):
        json.loads(body)
    error = classify_error(400, body, {})
    assert type(error) is ContextOverflow
    assert (error.prompt_tokens, error.context_limit) == (61709, 40960)
    assert error.message.startswith("The input (61709 tokens) is longer than the model's context length")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # An escaped backslash before a quote is a backslash, not a ``\'``.
        ('{"error": {"message": "path C:\\\\\'s end"}}', "path C:\\'s end"),
        # A surrogate pair becomes its character; a lone surrogate cannot be stored and is replaced.
        ('{"error": {"message": "hi \\ud83d\\ude00 and \\ud83d', "hi \U0001f600 and \ufffd"),
        # A dict as a gateway printed it, in prose: the prose is the server's words too.
        (
            "Error code: 500 - {'error': {'message': 'model\\'s gone'}}",
            "Error code: 500 - {'error': {'message': 'model's gone'}}",
        ),
    ],
)
def test_the_message_of_a_body_that_does_not_parse_is_its_words_unescaped(body: str, message: str) -> None:
    assert classify_error(500, body, {}).message == message


def test_prose_around_a_printed_dict_still_decides_and_its_fields_still_count() -> None:
    body = "litellm.NotFoundError: Invalid model name passed in model=gpt-x - {'error': {'message': 'no'}}"
    assert type(classify_error(400, body, {})) is ModelUnavailable
    quota = "Error code: 429 - {'error': {'message': 'Quota exceeded.', 'type': 'insufficient_quota'}}"
    error = classify_error(429, quota, {})
    assert isinstance(error, RateLimited) and error.quota_exhausted


def test_a_body_nested_without_end_is_read_as_text() -> None:
    body: Any = {"error": {"message": "prompt is too long: 9 tokens > 8 maximum"}}
    for _ in range(12):
        body = json.dumps(body)
    error = classify_error(400, body, {})
    assert isinstance(error, ProviderError)  # bounded: no recursion error, whatever it concludes
