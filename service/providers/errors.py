"""Turn a provider's error response into one of our typed errors.

Every adapter funnels its failures through :func:`classify_http_error` (an HTTP error status with its
body and headers) or :func:`classify_stream_error` (an error object that arrived *inside* a 200 stream).
The rules, in order, with the real bodies they were written against kept as test fixtures under
``tests/fixtures/provider_errors/`` and summarised in ``docs/providers.md``:

1. **Model unavailable** — HTTP 404, or the code ``model_not_found`` (any status), or a 400 whose message
   says the model does not exist.
2. **Quota exhausted** — ``insufficient_quota`` (OpenAI sends it as a 429): rate limited, never retried.
3. **Rate limited** — 429, 529, Anthropic ``rate_limit_error`` / ``overloaded_error``, OpenAI/Groq
   ``rate_limit_exceeded`` / type ``tokens``, or a 413 that speaks of tokens per minute. These win over
   everything below: "Request too large … tokens per min … reduce" is a *rate* limit, not an overflow.
4. **Context overflow** — only in 400 / 413 / 422 responses, stream errors, and llama.cpp's own 500
   wording, and only when the message matches one of the known overflow phrasings. When the message
   carries the numbers (window, requested output), an output cap that alone fills the window is a
   parameter error: shrinking the prompt could never help, so it is not reported as an overflow.
5. **Parameter caps** — ``max_tokens`` too large and friends: a plain provider error.
6. **Timeout** — 408.
7. Everything else: :class:`ProviderError` with the status and the provider's own message.
"""

from __future__ import annotations

import email.utils
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.providers.base import (
    CallUsage,
    ContextOverflow,
    ModelUnavailable,
    ProviderError,
    ProviderTimeout,
    RateLimited,
)

# A provider message is kept for the request's error detail; a whole HTML error page is not useful.
_MAX_MESSAGE_CHARS = 2000

# Statuses in which a context overflow is reported by the servers we know. 422 is TGI's validation status.
_OVERFLOW_STATUSES = frozenset({400, 413, 422})

# Known overflow phrasings, each with the provider it was taken from (see docs/providers.md).
_OVERFLOW_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"context_length_exceeded",  # OpenAI, Groq, DeepSeek (error.code)
        r"maximum context length is \d+",  # OpenAI, vLLM, DeepSeek, OpenRouter, SGLang
        r"exceeds the context window",  # OpenAI (newer wording)
        r"prompt is too long",  # Anthropic
        r"exceed context limit",  # Anthropic (input + max_tokens)
        r"exceed_context_size_error",  # llama.cpp server (error.type)
        r"exceeds the available context size",  # llama.cpp server
        r"context size has been exceeded",  # llama.cpp server (500 / in-stream)
        r"prompt too long; exceeded (?:max )?context length",  # Ollama
        r"input length exceeds the context length",  # Ollama
        r"`inputs` tokens \+ `max_new_tokens` must be <=",  # TGI
        r"`inputs` must have less than \d+ tokens",  # TGI
        r"too large for model with \d+ maximum context length",  # Mistral
        r"reduce the length of the messages",  # Groq, OpenAI legacy
        r"is longer than the model'?s context length",  # Together
        r"exceeds the maximum number of tokens allowed",  # Gemini (OpenAI-compatible endpoint)
        r"maximum prompt length is \d+",  # xAI
        r"greater than the context length",  # LM Studio
        r"request_too_large",  # Anthropic 413 (request bytes)
        r"request entity too large|payload too large",  # proxies' 413
    )
)

# Output-cap parameter errors: the requested output alone is refused; shrinking the prompt cannot help.
_PARAMETER_CAP_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"max_tokens is too large",  # OpenAI
        r"max_tokens: \d+ > \d+, which is the maximum allowed",  # Anthropic
        r"max_(?:completion_)?tokens must be less than or equal to",  # Groq
        r"(?<!\+ )`max_new_tokens` must be <= \d+",  # TGI (the cap alone, not inputs + max_new_tokens)
        r"max_(?:completion_)?tokens.{0,40}(?:above maximum value|exceeds the maximum)",  # OpenAI-compatible
    )
)
_PARAMETER_CAP_PARAMS = frozenset(
    {"max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens"}
)

# Messages that carry both the window and the requested output: (pattern, window group, output group).
_WINDOW_AND_OUTPUT: tuple[tuple[re.Pattern[str], str, str], ...] = tuple(
    (re.compile(p, re.IGNORECASE | re.DOTALL), "window", "output")
    for p in (
        # OpenAI legacy / vLLM / DeepSeek: "… is 4097 tokens. However, you requested 4120 tokens
        # (3120 in the messages, 1000 in the completion)".
        r"maximum context length is (?P<window>\d+) tokens.*?(?P<input>\d+) in the messages, "
        r"(?P<output>\d+) in the completion",
        # OpenAI completions legacy: "(3975 in your prompt; 256 for the completion)".
        r"maximum context length is (?P<window>\d+) tokens.*?(?P<input>\d+) in your prompt; "
        r"(?P<output>\d+) for the completion",
        # vLLM ≥ 0.8: "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum
        # context length is 4096 tokens and your request has 2778 input tokens".
        r"is too large: (?P<output>\d+)\. This model's maximum context length is (?P<window>\d+) tokens",
        # vLLM (newer): "… maximum context length is 262144 tokens. However, you requested 64000 output
        # tokens and your prompt contains at least 198145 input tokens".
        r"maximum context length is (?P<window>\d+) tokens\. However, you requested (?P<output>\d+) output",
        # Anthropic: "input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000".
        r"exceed context limit: (?P<input>\d+) \+ (?P<output>\d+) > (?P<window>\d+)",
        # TGI: "`inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens and
        # 200 `max_new_tokens`".
        r"must be <= (?P<window>\d+)\. Given: (?P<input>\d+) `inputs` tokens and "
        r"(?P<output>\d+) `max_new_tokens`",
    )
)

_MODEL_MISSING = re.compile(
    r"\bmodel\b[^\n]{0,120}?\b(?:not found|does not exist|not exist|is not available|unknown model)"
    r"|\bunknown model\b|\bno such model\b|\binvalid model\b",
    re.IGNORECASE,
)
_TOKENS_PER_MINUTE = re.compile(
    r"tokens per min|\(TPM\)|per-minute rate limit|rate[ _-]?limit", re.IGNORECASE
)
_TRY_AGAIN_IN = re.compile(r"try again in (\d+(?:\.\d+)?)\s*(ms|s)\b", re.IGNORECASE)


@dataclass(frozen=True)
class _ErrorInfo:
    """The parts of an error body that classification looks at."""

    message: str
    type: str | None
    code: str | None
    param: str | None
    status_hint: int | None  # an HTTP-like status some servers put in error.code (vLLM, llama.cpp)
    text: str  # everything searchable, for phrase matching


def classify_http_error(
    status: int | None,
    body: Any,
    headers: Mapping[str, str] | None = None,
    *,
    usage: CallUsage | None = None,
    now: float | None = None,
) -> ProviderError:
    """Classify one failed provider response (see the module docstring for the rules).

    ``status`` is the HTTP status (None when the error came inside a stream), ``body`` the parsed JSON
    body or its raw text, ``headers`` the response headers (for ``Retry-After``). ``usage`` is usage the
    provider reported before failing, attached to the returned error. ``now`` (epoch seconds) is only
    needed to turn an HTTP-date ``Retry-After`` into seconds; it defaults to the wall clock.
    """
    info = _parse_body(body)
    effective = status if status is not None and status >= 400 else info.status_hint
    message = _describe(effective, info)

    if _is_model_missing(effective, info):
        return ModelUnavailable(message, status=effective, usage=usage)

    if "insufficient_quota" in (info.type, info.code):
        return RateLimited(
            message,
            status=effective,
            usage=usage,
            retry_after_s=None,
            quota_exhausted=True,
        )

    if _is_rate_limit(effective, info):
        return RateLimited(
            message,
            status=effective,
            usage=usage,
            retry_after_s=parse_retry_after(headers, message=info.message, now=now),
        )

    overflow_possible = (
        effective is None
        or effective in _OVERFLOW_STATUSES
        # llama.cpp answers 500 "Context size has been exceeded." when the window fills mid-request.
        or (effective >= 500 and "context size has been exceeded" in info.text.lower())
    )
    if overflow_possible:
        verdict = _overflow_verdict(info)
        if verdict == "overflow":
            return ContextOverflow(message, status=effective, usage=usage)
        if verdict == "parameter":
            return ProviderError(message, status=effective, usage=usage)

    if effective == 408:
        return ProviderTimeout(message, status=effective, usage=usage)
    return ProviderError(message, status=effective, usage=usage)


def classify_stream_error(error: Any, *, usage: CallUsage | None = None) -> ProviderError:
    """Classify an error object that arrived inside a streamed (HTTP 200) reply.

    ``error`` is what the server sent: an ``{"error": {...}}`` chunk, the bare inner error object, or
    text. An overflow reported this way is still a :class:`ContextOverflow`; anything unrecognised is a
    :class:`ProviderError` without a status.
    """
    return classify_http_error(None, error, None, usage=usage)


def parse_retry_after(
    headers: Mapping[str, str] | None,
    *,
    message: str | None = None,
    now: float | None = None,
) -> float | None:
    """Seconds to wait before retrying, from ``retry-after-ms``, ``retry-after`` (seconds or HTTP date)
    or, failing both, a "try again in 6s" / "in 250ms" hint in the provider's message."""
    lowered = {k.lower(): v for k, v in (headers or {}).items()}
    raw_ms = lowered.get("retry-after-ms")
    if raw_ms is not None:
        try:
            return max(0.0, float(raw_ms) / 1000.0)
        except ValueError:
            pass
    raw = lowered.get("retry-after")
    if raw is not None:
        raw = raw.strip()
        try:
            return max(0.0, float(raw))
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            when = None
        if when is not None:
            current = time.time() if now is None else now
            return max(0.0, when.timestamp() - current)
    if message:
        match = _TRY_AGAIN_IN.search(message)
        if match:
            value = float(match.group(1))
            return value / 1000.0 if match.group(2).lower() == "ms" else value
    return None


def _parse_body(body: Any) -> _ErrorInfo:
    """Pull message / type / code / param out of the many error envelopes in the wild."""
    if isinstance(body, bytes | bytearray):
        body = body.decode("utf-8", errors="replace")
    if isinstance(body, str):
        stripped = body.strip()
        try:
            body = json.loads(stripped) if stripped else None
        except ValueError:
            return _ErrorInfo(stripped, None, None, None, None, stripped)
    if not isinstance(body, Mapping):
        text = "" if body is None else str(body)
        return _ErrorInfo(text, None, None, None, None, text)

    inner: Any = body.get("error", body)
    if isinstance(inner, str):
        # TGI ({"error": "...", "error_type": "validation"}) and Ollama's native API.
        message = inner
        etype = _text_or_none(body.get("error_type") or body.get("type"))
        code_value: Any = body.get("code")
        param = None
    elif isinstance(inner, Mapping):
        message = _text_or_none(inner.get("message") or inner.get("detail") or inner.get("msg")) or ""
        etype = _text_or_none(inner.get("type"))
        code_value = inner.get("code")
        param = _text_or_none(inner.get("param"))
        if not message and inner is body and isinstance(body.get("detail"), str):
            message = str(body["detail"])
    else:
        message, etype, code_value, param = str(inner), None, None, None

    status_hint: int | None = None
    code: str | None = None
    if isinstance(code_value, int) and not isinstance(code_value, bool):
        code = str(code_value)
        status_hint = code_value if 400 <= code_value <= 599 else None
    elif isinstance(code_value, str) and code_value:
        code = code_value
        if code_value.isdigit() and 400 <= int(code_value) <= 599:
            status_hint = int(code_value)
    try:
        whole = json.dumps(body, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        whole = str(body)
    return _ErrorInfo(message, etype, code, param, status_hint, whole)


def _text_or_none(value: Any) -> str | None:
    if value is None:
        return None
    return str(value)


def _describe(status: int | None, info: _ErrorInfo) -> str:
    """The provider's own message, trimmed; a stand-in when it sent none."""
    message = info.message.strip() or info.text.strip()
    if not message:
        message = f"HTTP {status}" if status is not None else "provider error"
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "…"
    return message


def _is_model_missing(status: int | None, info: _ErrorInfo) -> bool:
    if info.code == "model_not_found" or status == 404:
        return True
    # Some servers answer an unknown model with 400 (LM Studio, some proxies): only trust the wording
    # when it is about the model.
    return status == 400 and bool(_MODEL_MISSING.search(info.message))


def _is_rate_limit(status: int | None, info: _ErrorInfo) -> bool:
    if status in (429, 529):
        return True
    if info.type in ("rate_limit_error", "overloaded_error", "tokens", "requests"):
        return True
    if info.code == "rate_limit_exceeded":
        return True
    # A 413 that talks about tokens per minute is Groq's TPM limit, not a too-long prompt.
    return status == 413 and bool(_TOKENS_PER_MINUTE.search(info.message))


def _overflow_verdict(info: _ErrorInfo) -> str | None:
    """``"overflow"``, ``"parameter"`` (an output-cap error) or None (neither)."""
    text = info.message + "\n" + info.text
    for pattern, window_group, output_group in _WINDOW_AND_OUTPUT:
        match = pattern.search(text)
        if match:
            window = int(match.group(window_group))
            output = int(match.group(output_group))
            # The requested output alone fills the window: no prompt, however short, would fit.
            return "parameter" if output >= window else "overflow"
    if info.param in _PARAMETER_CAP_PARAMS:
        return "parameter"
    if any(p.search(text) for p in _PARAMETER_CAP_PATTERNS):
        return "parameter"
    if info.code == "string_above_max_length":
        # OpenAI's byte cap on one field: an overflow only when the field is the messages.
        return "overflow" if (info.param or "").startswith("messages") else None
    if any(p.search(text) for p in _OVERFLOW_PATTERNS):
        return "overflow"
    return None
