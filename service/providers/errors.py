"""Turn a provider's error response into one of our typed errors.

Every adapter funnels its failures through :func:`classify_http_error` (an HTTP error status with its
body and headers) or :func:`classify_stream_error` (an error object that arrived *inside* a 200 stream).
Classification goes by what the body **says**, whatever the HTTP status: gateways (LiteLLM's proxy,
OpenRouter, nginx) re-wrap upstream errors under 400, 413, 422, 500 or 503 — and whatever form the body
arrives in: parsed JSON, its text, plain text, JSON inside a JSON string (or inside the message of a
gateway's own JSON), JSON that does not parse (SGLang's ``\\'`` escapes, a body cut short: the fields are
read from the text, its escapes undone), or an error inside the stream. The rules, in order, with
the real bodies they were written against kept as test fixtures under ``tests/fixtures/provider_errors/``
and tabled in ``docs/providers.md``:

1. **Model unavailable** — HTTP 404 whose body names a model or a deployment (a 404 that does not
   is a wrong endpoint — most often a base URL with or without its ``/v1`` — and a provider error
   that says so), a model-not-found code (``model_not_found``, Together's
   ``model_not_available``, Azure's ``DeploymentNotFound``), or a message that says the model does not
   exist or cannot be served to this key ("not a valid model ID", "Unable to access non-serverless
   model", "Invalid model name passed in model=", "The API deployment for this resource does not
   exist"), whatever the status.
2. **Quota exhausted** — ``insufficient_quota``, HTTP 402, "Insufficient Balance" / "requires more
   credits", or OpenAI's "You exceeded your current quota" once a gateway has dropped its code (but not
   Gemini's per-minute ``RESOURCE_EXHAUSTED`` in the same words): rate limited, never retried (waiting
   does not refill a balance).
3. **Rate limited** — 429, 529, Anthropic ``rate_limit_error`` / ``overloaded_error``, OpenAI/Groq
   ``rate_limit_exceeded`` / type ``tokens``, LiteLLM's ``throttling_error``, Mistral's
   ``rate_limited``, Gemini's ``RESOURCE_EXHAUSTED``, or a 413 (or status-less stream error) that speaks
   of tokens per minute or throttling. These win over everything below: "Request too large … tokens per
   min … reduce" is a *rate* limit, not an overflow.
4. **Context overflow** — a message in one of the known overflow phrasings, in any status (a 500 from a
   gateway that quotes "prompt is too long" is an overflow too); the bare "Payload Too Large" family
   only in a 413. A message that says the prompt and the requested output together exceed the
   window *is* an overflow (SPEC §7), even when it names ``max_tokens`` (vLLM's "'max_tokens' … is
   too large: 4096. This model's maximum context length is 8192 tokens and your request has 5000
   input tokens"), and even when the output alone fills the window — then no shrinking can help,
   and the message adds which setting to change.
   Where the body states the prompt's token count or the window, they are parsed into
   :attr:`ContextOverflow.prompt_tokens` / :attr:`ContextOverflow.context_limit` (SPEC §5.1).
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
    RateLimited,
)

# A provider message is kept for the request's error detail; a whole HTML error page is not useful.
_MAX_MESSAGE_CHARS = 2000


def _compile(*patterns: str) -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(p, re.IGNORECASE) for p in patterns)


# Known overflow phrasings, each with the server it was taken from (see docs/providers.md). Trusted in
# any status: they name the context window, so no gateway re-wrapping makes them mean something else.
_OVERFLOW_PATTERNS = _compile(
    r"context_length_exceeded",  # OpenAI, Groq, Azure (error.code)
    r"maximum context length is \d+",  # OpenAI, vLLM, DeepSeek, OpenRouter
    r"exceeds the context window",  # OpenAI (newer wording)
    r"prompt is too long",  # Anthropic, Bedrock (Claude), Fireworks
    r"exceed context limit",  # Anthropic (input + max_tokens)
    r"exceed_context_size_error",  # llama.cpp server (error.type)
    r"exceeds the available context size",  # llama.cpp server
    r"context size has been exceeded",  # llama.cpp server (500 / in-stream)
    r"prompt too long; exceeded (?:max )?context length",  # Ollama
    r"input length exceeds the context length",  # Ollama
    r"`inputs` tokens \+ `max_new_tokens` must be <=",  # TGI, Together (TGI-style validation)
    r"`inputs` must have less than \d+ tokens",  # TGI
    r"too large for model with \d+ maximum context length",  # Mistral
    r"reduce the length of the messages",  # Groq, OpenAI legacy
    r"is longer than the model'?s context length",  # SGLang, Together
    r"exceeds the model'?s maximum context length",  # SGLang (input + completion)
    r"is longer than the maximum model length",  # vLLM input processor
    r"model'?s context length is only \d+ tokens",  # vLLM ≥ 0.10 ("You passed N input tokens …")
    r"exceeds the maximum number of tokens allowed",  # Gemini / Vertex AI
    r"input token count is \d+ but (?:the )?model only supports up to \d+",  # Vertex AI
    r"exceeded model token limit: \d+",  # Moonshot (Kimi)
    r"input is too long for requested model",  # Bedrock
    r"input tokens exceed the configured limit",  # Azure OpenAI / OpenAI (Responses)
    r"maximum prompt length is \d+",  # xAI
    r"greater than the context length",  # LM Studio
    r"when context the overflows|when context overflows",  # LM Studio ("Trying to keep the first N …")
    r"ContextWindowExceededError",  # LiteLLM (SDK and proxy)
    r"request_too_large",  # Anthropic 413 (request bytes)
    r"total number of tokens (?:in the prompt|\(prompt and prediction\)) cannot exceed \d+",  # Cohere
)
# A proxy's body-size refusal says nothing about tokens: trusted only with the status that means it.
_OVERFLOW_413_PATTERNS = _compile(
    r"request entity too large|payload too large",
    r"exceeds the maximum allowed number of bytes",  # Anthropic's request_too_large, its type lost
)

# Output-cap parameter errors: the requested output alone is refused; shrinking the prompt cannot help.
_PARAMETER_CAP_PATTERNS = _compile(
    r"max_tokens is too large",  # OpenAI
    r"max_tokens: \d+ > \d+, which is the maximum allowed",  # Anthropic
    r"max_(?:completion_)?tokens must be less than or equal to",  # Groq
    r"(?<!\+ )`max_new_tokens` must be <= \d+",  # TGI (the cap alone, not inputs + max_new_tokens)
    r"max_(?:completion_)?tokens.{0,40}(?:above maximum value|exceeds the maximum)",  # OpenAI-compatible
)
_PARAMETER_CAP_PARAMS = frozenset(
    {"max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens"}
)

# Messages that carry both the window and the requested output (and usually the prompt): the
# arithmetic decides between an overflow and a parameter cap. Groups: window, output, input, tool.
_WINDOW_AND_OUTPUT: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p, re.IGNORECASE | re.DOTALL)
    for p in (
        # OpenAI legacy / vLLM / DeepSeek: "… is 4097 tokens. However, you requested 4120 tokens
        # (3120 in the messages, 1000 in the completion)".
        r"maximum context length is (?P<window>\d+) tokens.{0,80}?(?P<input>\d+) in the messages, "
        r"(?P<output>\d+) in the completion",
        # OpenAI completions legacy: "(3975 in your prompt; 256 for the completion)".
        r"maximum context length is (?P<window>\d+) tokens.{0,80}?(?P<input>\d+) in your prompt[;,] "
        r"(?P<output>\d+) for the completion",
        # vLLM ≥ 0.8: "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum
        # context length is 4096 tokens and your request has 2778 input tokens".
        r"is too large: (?P<output>\d+)\. This model's maximum context length is (?P<window>\d+) tokens"
        r"(?: and your request has (?P<input>\d+) input tokens)?",
        # vLLM (newer): "… maximum context length is 262144 tokens. However, you requested 64000 output
        # tokens and your prompt contains at least 198145 input tokens".
        r"maximum context length is (?P<window>\d+) tokens\. However, you requested (?P<output>\d+) "
        r"output tokens(?: and your prompt contains at least (?P<input>\d+) input tokens)?",
        # vLLM ≥ 0.10: "You passed 31745 input tokens and requested 1024 output tokens. However, the
        # model's context length is only 32768 tokens".
        r"You passed (?P<input>\d+) input tokens and requested (?P<output>\d+) output tokens\. "
        r"However, the model'?s context length is only (?P<window>\d+) tokens",
        # SGLang: "Requested token count exceeds the model's maximum context length of 4096 tokens. You
        # requested a total of 4200 tokens: 3200 tokens from the input messages and 1000 tokens for the
        # completion."
        r"maximum context length of (?P<window>\d+) tokens\. You requested a total of \d+ tokens: "
        r"(?P<input>\d+) tokens from the input messages and (?P<output>\d+) tokens for the completion",
        # OpenRouter: "This endpoint's maximum context length is 65536 tokens. However, you requested
        # about 92208 tokens (60833 of text input, 10042 of tool input, 21333 in the output)".
        r"maximum context length is (?P<window>\d+) tokens\. However, you requested about \d+ tokens "
        r"\((?P<input>\d+) of text input(?:, (?P<tool>\d+) of tool input)?, (?P<output>\d+) in the output",
        # Anthropic: "input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000".
        r"exceed context limit: (?P<input>\d+) \+ (?P<output>\d+) > (?P<window>\d+)",
        # TGI: "`inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens and
        # 200 `max_new_tokens`".
        r"must be <= (?P<window>\d+)\. Given: (?P<input>\d+) `inputs` tokens and "
        r"(?P<output>\d+) `max_new_tokens`",
    )
)

# Where an overflow message states the prompt's token count and / or the window: (pattern, group of
# the prompt or None, group of the window or None). Tried in order; the first hit for each number wins.
_COUNTS: tuple[tuple[re.Pattern[str], str | None, str | None], ...] = tuple(
    (re.compile(p, re.IGNORECASE), prompt, limit)
    for p, prompt, limit in (
        (r"prompt is too long: (?P<p>\d+) tokens > (?P<l>\d+) maximum", "p", "l"),  # Anthropic
        (r"request \((?P<p>\d+) tokens\) exceeds the available context size \((?P<l>\d+)", "p", "l"),
        (
            r"The input \((?P<p>\d+) tokens\) is longer than the model'?s context length \((?P<l>\d+)",
            "p",
            "l",
        ),
        (
            r"The decoder prompt \(length (?P<p>\d+)\) is longer than the maximum model length of (?P<l>\d+)",
            "p",
            "l",
        ),
        (
            r"Prompt contains (?P<p>\d+) tokens(?: and \d+ draft tokens)?, "
            r"too large for model with (?P<l>\d+)",
            "p",
            "l",
        ),  # Mistral (the draft tokens: its newer wording)
        (
            r"input token count is (?P<p>\d+) but (?:the )?model only supports up to (?P<l>\d+)",
            "p",
            "l",
        ),  # Vertex
        (r"maximum prompt length is (?P<l>\d+) but the request contains (?P<p>\d+) tokens", "p", "l"),  # xAI
        (r"exceeded model token limit: (?P<l>\d+)", None, "l"),  # Moonshot: "requested" adds the output
        (
            r"input token count \((?P<p>\d+)\) exceeds the maximum number of tokens allowed \((?P<l>\d+)",
            "p",
            "l",
        ),  # Gemini
        (r"maximum number of tokens allowed \((?P<l>\d+)", None, "l"),  # Gemini 2.5 (no count)
        (r"The prompt is too long: (?P<p>\d+), model maximum context length: (?P<l>\d+)", "p", "l"),
        (r"configured limit of (?P<l>\d+) tokens\. Your messages resulted in (?P<p>\d+) tokens", "p", "l"),
        (r"`inputs` must have less than (?P<l>\d+) tokens\. Given: (?P<p>\d+)", "p", "l"),  # TGI
        (r"your request has (?P<p>\d+) input tokens", "p", None),  # vLLM
        (r"You passed (?P<p>\d+) input tokens", "p", None),  # vLLM ≥ 0.10
        (r"your prompt contains at least (?P<p>\d+) input tokens", "p", None),  # vLLM (newer)
        (r"messages resulted in (?P<p>\d+) tokens", "p", None),  # OpenAI, Azure
        (r"(?P<p>\d+) tokens from the input messages", "p", None),  # SGLang
        (r"about \d+ tokens \((?P<p>\d+) of text input\)", "p", None),  # OpenRouter (text only)
        (r"(?P<p>\d+) in the messages", "p", None),  # OpenAI legacy, DeepSeek, vLLM
        (r"(?P<p>\d+) in your prompt", "p", None),  # OpenAI completions legacy
        (r"exceed context limit: (?P<p>\d+) \+ \d+ > (?P<l>\d+)", "p", "l"),  # Anthropic
        (r"Given: (?P<p>\d+) `inputs` tokens", "p", None),  # TGI
        (r"maximum context length is (?P<l>\d+)", None, "l"),  # OpenAI, vLLM, DeepSeek, OpenRouter
        (r"maximum context length of (?P<l>\d+)", None, "l"),  # SGLang
        (r"context length is only (?P<l>\d+)", None, "l"),  # vLLM ≥ 0.10
        (r"context length of only (?P<l>\d+)", None, "l"),  # LM Studio
        (r"`inputs` tokens \+ `max_new_tokens` must be <= (?P<l>\d+)", None, "l"),  # TGI
        (r"exceeds the available context size \((?P<l>\d+)", None, "l"),  # llama.cpp
        (r"tokens in the prompt cannot exceed (?P<l>\d+) - received (?P<p>\d+)", "p", "l"),  # Cohere
        (r"\(prompt and prediction\) cannot exceed (?P<l>\d+)", None, "l"),  # Cohere (input + output)
    )
)

# "The model … does not exist" and friends: trusted in a 4xx or a stream error, where the server speaks of
# the request's own model (a 5xx "model server is not available" is an outage, not a missing model).
_MODEL_MISSING = re.compile(
    r"\bmodel\b[^\n]{0,120}?\b(?:not found|does not exist|not exist|is not available|unknown model)"
    r"|\bunknown model\b|\bno such model\b|\binvalid model\b"
    r"|\bmodels/\S+ is not found",  # Gemini, when its 404 status is lost
    re.IGNORECASE,
)
# Wordings that only ever mean "this model cannot be served to this key": trusted in any status, since
# gateways re-wrap them.
_MODEL_UNSERVABLE = re.compile(
    r"is not a valid model id"  # OpenRouter
    r"|unable to access non-serverless model"  # Together
    r"|dedicated endpoint for \S+ is not running"  # Together
    r"|invalid model name passed in model="  # LiteLLM proxy
    r"|the api deployment for this resource does not exist",  # Azure OpenAI (DeploymentNotFound)
    re.IGNORECASE,
)
_NAMES_A_MODEL = re.compile(r"\bmodels?\b|deployment", re.IGNORECASE)
_MODEL_MISSING_CODES = frozenset(
    {"model_not_found", "model_not_available", "DeploymentNotFound", "dedicated_endpoint_not_running"}
)
_QUOTA = re.compile(
    r"insufficient[_ ]balance|insufficient[_ ]quota|requires more credits|credit balance is too low",
    re.IGNORECASE,
)
# OpenAI's insufficient_quota message, which survives when a gateway (LiteLLM) drops the code. Gemini says
# the same words for a per-minute quota, with RESOURCE_EXHAUSTED and a retry delay: that one is a rate limit.
_OPENAI_QUOTA_WORDING = re.compile(
    r"exceeded your current quota, please check your plan and billing details", re.IGNORECASE
)
# Gemini's message links its rate-limit docs, which still tell it apart when only the words arrive.
_GEMINI_RATE_LIMIT_DOCS = re.compile(r"ai\.google\.dev/\S*rate-limits", re.IGNORECASE)
_RATE_LIMIT_TYPES = frozenset(
    {"rate_limit_error", "overloaded_error", "tokens", "requests", "throttling_error", "rate_limited"}
)
_RATE_LIMIT_WORDING = re.compile(
    r"tokens per min|\(TPM\)|per-minute rate limit|rate[ _-]?limit|ThrottlingException"
    r"|too many (?:requests|tokens), please wait|RESOURCE[_ ]EXHAUSTED"
    r"|^overloaded\.?$",  # Anthropic's overloaded_error, in a stream that lost its type
    re.IGNORECASE,
)
# One part of a wait: "250ms", "6.5s", "60 seconds", "2 minutes", and OpenAI's compound "1m30s" / "1h2m".
_WAIT_UNIT = r"(ms|milliseconds?|seconds?|secs?|s|minutes?|mins?|m|hours?|h)(?![a-z])"
_WAIT_PART = re.compile(rf"(\d+(?:\.\d+)?)\s*{_WAIT_UNIT}", re.IGNORECASE)
_TRY_AGAIN_IN = re.compile(
    rf"(?:try again|retry) (?:in|after) ((?:\d+(?:\.\d+)?\s*{_WAIT_UNIT}\s*)+)", re.IGNORECASE
)


def _unit_seconds(unit: str) -> float:
    unit = unit.lower()
    if unit == "ms" or unit.startswith("milli"):
        return 0.001
    return {"s": 1.0, "m": 60.0, "h": 3600.0}[unit[0]]


def _wait_seconds(text: str) -> float:
    """``1m30s`` → 90.0: the sum of the wait's parts."""
    return sum(float(number) * _unit_seconds(unit) for number, unit in _WAIT_PART.findall(text))


# Gemini / Vertex put the wait in a google.rpc.RetryInfo detail: "retryDelay": "26s" (in Python's
# quotes when a gateway printed the body).
_RETRY_DELAY = re.compile(r"[\"']retryDelay[\"']\s*:\s*[\"'](\d+(?:\.\d+)?)s[\"']")


# A body is unwrapped (JSON inside a JSON string inside …) at most this often: real gateways nest once
# or twice, and a bound keeps a hostile body from recursing without end.
_MAX_NESTING = 4
_NOT_JSON = object()
# ``\'`` is no JSON escape, yet bodies built by Python string code carry it (SGLang): undone only after
# an even run of backslashes, so an escaped backslash before a quote keeps its meaning.
_BACKSLASH_QUOTE = re.compile(r"(?<!\\)((?:\\\\)*)\\'")
_JSON_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|[\"'\\/bfnrt])")
_ESCAPED = {'"': '"', "'": "'", "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
# Where a body that does not parse opens its error object: its fields are read from there, so an outer
# ``"type": "error"`` (Anthropic) does not stand for the error's own type.
_ERROR_OBJECT = re.compile(r"[\"']error[\"']\s*:\s*\{")
# One ``"key": value`` of a body that does not parse, in JSON's quotes or Python's (a gateway that
# printed the upstream dict); a string cut short runs to the end of the text.
_FIELD = re.compile(
    r"[\"'](?P<key>[A-Za-z_][\w-]*)[\"']\s*:\s*"
    r"(?:\"(?P<dq>(?:[^\"\\]|\\.)*)\"?|'(?P<sq>(?:[^'\\]|\\.)*)'?|(?P<num>-?\d+)\b"
    r"|(?:true|false|null|True|False|None)\b)"
)


@dataclass(frozen=True)
class _ErrorInfo:
    """The parts of an error body that classification looks at."""

    message: str
    type: str | None
    code: str | None
    param: str | None
    status_hint: int | None  # an HTTP-like status some servers put in error.code (vLLM, llama.cpp)
    text: str  # everything searchable, for phrase matching
    fields: Mapping[str, Any]  # the inner error object's own fields (llama.cpp's n_prompt_tokens)


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

    if _is_quota_exhausted(effective, info):
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
            retry_after_s=parse_retry_after(headers, message=info.message + "\n" + info.text, now=now),
        )

    verdict = _overflow_verdict(effective, info)
    if verdict == "overflow":
        prompt_tokens, context_limit = overflow_counts(info.message + "\n" + info.text, info.fields)
        filled = _output_filling_window(info.message + "\n" + info.text)
        if filled is not None:
            message += (
                f" (the requested output alone, {filled[1]} tokens, fills the model's {filled[0]}-token "
                "window: set context_window to the model's window, in the request, the session's "
                "settings or SIDEQUEST_CONTEXT_WINDOW, or a smaller max_output_tokens)"
            )
        return ContextOverflow(
            message,
            status=effective,
            usage=usage,
            prompt_tokens=prompt_tokens,
            context_limit=context_limit,
            output_fills_window=filled is not None,
        )
    if verdict == "parameter":
        return ProviderError(message, status=effective, usage=usage)

    if effective == 404:
        # Not a model (rule 1): the endpoint itself is not there.
        message += (
            " (HTTP 404 naming no model: is SIDEQUEST_BASE_URL right? The openai provider wants it "
            "with /v1, the anthropic provider without)"
        )
    # A 408 is the provider's own timeout, not the side request's deadline: a provider error with
    # the provider's words, so nobody reads "did not finish within its deadline" after 0.2 s.
    return ProviderError(message, status=effective, usage=usage)


def classify_stream_error(error: Any, *, usage: CallUsage | None = None) -> ProviderError:
    """Classify an error object that arrived inside a streamed (HTTP 200) reply.

    ``error`` is what the server sent: an ``{"error": {...}}`` chunk, the bare inner error object, or
    text. An overflow reported this way is still a :class:`ContextOverflow` (with the counts its message
    states); anything unrecognised is a :class:`ProviderError` without a status.
    """
    return classify_http_error(None, error, None, usage=usage)


def classify_undecodable_chunk(exc: ValueError, *, usage: CallUsage | None = None) -> ProviderError:
    """Classify a stream chunk the SDK could not decode as JSON.

    A server that breaks its JSON (SGLang's ``\\'``) or sends its error as text inside the stream still
    says what went wrong: an overflow there must reach the overflow retry like any other. A chunk that
    says nothing we recognise is a provider error about the invalid data.
    """
    if isinstance(exc, json.JSONDecodeError):
        error = classify_stream_error(exc.doc, usage=usage)
        if type(error) is not ProviderError:
            return error
    return ProviderError(f"the stream sent invalid data: {exc}", usage=usage)


def overflow_counts(text: str, fields: Mapping[str, Any] | None = None) -> tuple[int | None, int | None]:
    """``(prompt_tokens, context_limit)`` as an overflow message (or the error's own fields) states them.

    Either is None when the body does not say it. Only real counts are taken: Ollama's "exceeded max
    context length by 4 tokens" and LM Studio's "Trying to keep the first N tokens" (a part of the
    prompt) give no prompt count.
    """
    prompt: int | None = None
    limit: int | None = None
    if fields:
        # llama.cpp puts both numbers in the error object itself.
        prompt = _positive(fields.get("n_prompt_tokens"))
        limit = _positive(fields.get("n_ctx"))
    for pattern, prompt_group, limit_group in _COUNTS:
        if prompt is not None and limit is not None:
            break
        match = pattern.search(text)
        if match is None:
            continue
        if prompt is None and prompt_group is not None:
            prompt = _positive(match.group(prompt_group))
        if limit is None and limit_group is not None:
            limit = _positive(match.group(limit_group))
    if prompt is None:
        # OpenRouter splits the prompt into text and tool input.
        for pattern in _WINDOW_AND_OUTPUT:
            match = pattern.search(text)
            if match and "tool" in pattern.groupindex and match.group("input"):
                prompt = int(match.group("input")) + int(match.group("tool") or 0)
                break
    return prompt, limit


def parse_retry_after(
    headers: Mapping[str, str] | None,
    *,
    message: str | None = None,
    now: float | None = None,
) -> float | None:
    """Seconds to wait before retrying, from ``retry-after-ms``, ``retry-after`` (seconds or HTTP date;
    also under LiteLLM's ``llm_provider-`` prefix) or, failing both, a hint in the provider's message:
    "try again in 6s" / "in 250ms", Azure's "Please retry after 60 seconds", Gemini's "Please retry in
    20.04s" or its ``"retryDelay": "26s"``; last, OpenAI's ``x-ratelimit-reset-*`` headers."""
    lowered = {k.lower(): v for k, v in (headers or {}).items()}
    for name in ("retry-after-ms", "retry-after"):
        # LiteLLM's proxy passes the upstream's headers on under an ``llm_provider-`` prefix.
        if name not in lowered and f"llm_provider-{name}" in lowered:
            lowered[name] = lowered[f"llm_provider-{name}"]
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
            return _wait_seconds(match.group(1))
        match = _RETRY_DELAY.search(message)
        if match:
            return float(match.group(1))
    return _reset_header_wait(lowered, message or "")


def _reset_header_wait(headers: Mapping[str, str], message: str) -> float | None:
    """OpenAI's ``x-ratelimit-reset-requests`` / ``-tokens`` ("1s", "6m0s", "20ms"): when the limit
    reset — the one the message names ("… for requests", "… tokens per min"), else the later."""
    waits: dict[str, float] = {}
    for kind in ("requests", "tokens"):
        raw = headers.get(f"x-ratelimit-reset-{kind}")
        if raw is not None and _WAIT_PART.search(raw):
            waits[kind] = _wait_seconds(raw)
    if not waits:
        return None
    lowered = message.lower()
    named = [k for k in waits if k in lowered or (k == "tokens" and "tpm" in lowered)]
    return waits[named[0]] if len(named) == 1 else max(waits.values())


def _parse_body(body: Any, depth: int = 0) -> _ErrorInfo:
    """Pull message / type / code / param out of the many error envelopes in the wild.

    One path for every form a body arrives in: parsed JSON, its text, plain text, JSON inside a JSON
    string, and JSON that does not parse (SGLang's ``\\'`` escapes, a body cut short) — then the fields
    are read from the text itself with its escapes undone, so a phrasing is found whatever the form.
    """
    if isinstance(body, bytes | bytearray):
        body = body.decode("utf-8", errors="replace")
    if isinstance(body, str):
        stripped = body.strip()
        if not stripped:
            return _ErrorInfo("", None, None, None, None, "", {})
        parsed = _loads(stripped)
        if parsed is _NOT_JSON or depth >= _MAX_NESTING:
            return _from_text(stripped, depth)
        return _parse_body(parsed, depth + 1)
    if isinstance(body, list) and len(body) == 1:
        body = body[0]  # Gemini's streaming endpoint wraps the error in a one-element array
    if not isinstance(body, Mapping):
        text = "" if body is None else str(body)
        return _ErrorInfo(text, None, None, None, None, text, {})
    try:
        whole = json.dumps(body, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        whole = str(body)
    info = _from_mapping(body, whole)
    # A gateway that re-encodes the upstream body puts it, as JSON text, where its message goes.
    if depth < _MAX_NESTING and info.message.lstrip().startswith(("{", "[")):
        return _merged(_parse_body(info.message, depth + 1), info)
    return info


def _from_mapping(body: Mapping[str, Any], whole: str) -> _ErrorInfo:
    """The error in a JSON object (or in the fields read from a body that does not parse)."""
    inner: Any = body.get("error", body)
    fields: Mapping[str, Any] = {}
    if isinstance(inner, str):
        # TGI ({"error": "...", "error_type": "validation"}), LM Studio and Ollama's native API.
        message = inner
        etype = _text_or_none(body.get("error_type") or body.get("type"))
        code_value: Any = body.get("code")
        param = None
    elif isinstance(inner, Mapping):
        fields = inner
        message = _text_or_none(inner.get("message") or inner.get("detail") or inner.get("msg")) or ""
        etype = _text_or_none(inner.get("type"))
        code_value = inner.get("code")
        param = _text_or_none(inner.get("param"))
        if not message and inner is body and isinstance(body.get("detail"), str):
            message = str(body["detail"])
        # Gemini / Vertex: {"error": {"code": 429, "message": …, "status": "RESOURCE_EXHAUSTED"}}.
        if etype is None and isinstance(inner.get("status"), str):
            etype = str(inner["status"])
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
    return _ErrorInfo(message, etype, code, param, status_hint, whole, fields)


def _merged(nested: _ErrorInfo, outer: _ErrorInfo) -> _ErrorInfo:
    """The upstream error a gateway wrapped, with the gateway's own fields where it says nothing."""
    return _ErrorInfo(
        message=nested.message or outer.message,
        type=nested.type or outer.type,
        code=nested.code or outer.code,
        param=nested.param or outer.param,
        status_hint=nested.status_hint or outer.status_hint,
        text=nested.text + "\n" + outer.text,
        fields=nested.fields or outer.fields,
    )


def _from_text(text: str, depth: int) -> _ErrorInfo:
    """A body that is not JSON: plain words, a dict as Python prints it, or broken JSON."""
    if text.startswith(('"{', '"[')) and depth < _MAX_NESTING:
        # A JSON string that does not parse (cut short, or ``\'`` inside): its content, unescaped.
        return _parse_body(_unescape(text[1:].removesuffix('"')), depth + 1)
    fields: dict[str, Any] = {}
    start = _ERROR_OBJECT.search(text)
    for match in _FIELD.finditer(text, start.end() if start else 0):
        fields.setdefault(match.group("key"), _field_value(match))
    unescaped = _unescape(text)
    if any(isinstance(fields.get(key), str) for key in ("message", "detail", "msg", "error")):
        info = _from_mapping(fields, unescaped)
        # Broken JSON: its message is the error's words. Prose around a printed dict ("litellm.
        # NotFoundError: … {'error': …}") is the server's words too, and stays the message.
        message = info.message if text.startswith(("{", "[")) else unescaped
        return _ErrorInfo(message, info.type, info.code, info.param, info.status_hint, unescaped, info.fields)
    return _ErrorInfo(unescaped, None, None, None, None, unescaped, {})


def _loads(text: str) -> Any:
    """``text`` as JSON, else as JSON once its ``\\'`` escapes are undone, else :data:`_NOT_JSON`."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    repaired = _BACKSLASH_QUOTE.sub(r"\1'", text)
    if repaired != text:
        try:
            return json.loads(repaired)
        except ValueError:
            pass
    return _NOT_JSON


def _field_value(match: re.Match[str]) -> Any:
    if match.group("dq") is not None:
        return _unescape(match.group("dq"))
    if match.group("sq") is not None:
        return _unescape(match.group("sq"))
    if match.group("num") is not None:
        return int(match.group("num"))
    return None  # true / false / null: nothing classification reads


def _unescape(text: str) -> str:
    """JSON's backslash escapes (and ``\\'``) undone; a lone surrogate becomes U+FFFD, so the message
    stays storable text."""
    if "\\" not in text:
        return text
    unescaped = _JSON_ESCAPE.sub(
        lambda m: chr(int(m.group(1)[1:], 16)) if m.group(1)[0] == "u" else _ESCAPED[m.group(1)], text
    )
    return unescaped.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _text_or_none(value: Any) -> str | None:
    if value is None:
        return None
    return str(value)


def _positive(value: Any) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def _describe(status: int | None, info: _ErrorInfo) -> str:
    """The provider's own message, trimmed; a stand-in when it sent none."""
    message = info.message.strip() or info.text.strip()
    if not message:
        message = f"HTTP {status}" if status is not None else "provider error"
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "…"
    return message


def _is_model_missing(status: int | None, info: _ErrorInfo) -> bool:
    if info.code in _MODEL_MISSING_CODES:
        return True
    if status == 404:
        # "The model `x` does not exist", "model: sonnet4", "models/gemini-1.0-pro is not found": a
        # model; "Not Found", {"detail": "Not Found"}, "404 page not found": a route that is not there.
        return bool(_NAMES_A_MODEL.search(info.message + "\n" + info.text))
    if status in (429, 529):
        return False  # a rate limit may name its model ("Rate limit reached for model …")
    # Servers answer an unknown model with 400 too (OpenRouter, Together, LiteLLM's proxy, LM Studio),
    # and gateways re-wrap it in a 500: only trust the wording when it is about the model.
    if _MODEL_UNSERVABLE.search(info.message):
        return True
    return (status is None or status < 500) and bool(_MODEL_MISSING.search(info.message))


def _is_quota_exhausted(status: int | None, info: _ErrorInfo) -> bool:
    if "insufficient_quota" in (info.type, info.code):
        return True
    # 402 Payment Required: DeepSeek's "Insufficient Balance", OpenRouter's "requires more credits".
    if status == 402 or _QUOTA.search(info.message):
        return True
    return (
        bool(_OPENAI_QUOTA_WORDING.search(info.message))
        and "RESOURCE_EXHAUSTED" not in info.text
        and not _GEMINI_RATE_LIMIT_DOCS.search(info.message)
    )


def _is_rate_limit(status: int | None, info: _ErrorInfo) -> bool:
    if status in (429, 529):
        return True
    if info.type in _RATE_LIMIT_TYPES or info.type == "RESOURCE_EXHAUSTED":
        return True
    if info.code == "rate_limit_exceeded":
        return True
    # A 413 that talks about tokens per minute is Groq's TPM limit, not a too-long prompt; an error
    # inside a stream has no status, so its wording is all there is.
    return status in (413, None) and bool(_RATE_LIMIT_WORDING.search(info.message))


def _output_filling_window(text: str) -> tuple[int, int] | None:
    """``(window, output)`` when the message names both and the output alone fills the window."""
    for pattern in _WINDOW_AND_OUTPUT:
        match = pattern.search(text)
        if match:
            window, output = int(match.group("window")), int(match.group("output"))
            return (window, output) if output >= window else None
    return None


def _overflow_verdict(status: int | None, info: _ErrorInfo) -> str | None:
    """``"overflow"``, ``"parameter"`` (an output-cap error) or None (neither)."""
    text = info.message + "\n" + info.text
    if any(pattern.search(text) for pattern in _WINDOW_AND_OUTPUT):
        # Input and requested output together exceed the window: an overflow (SPEC §7), also when
        # the output alone fills it (then no shrinking helps, and the message says why).
        return "overflow"
    if info.param in _PARAMETER_CAP_PARAMS:
        return "parameter"
    if any(p.search(text) for p in _PARAMETER_CAP_PATTERNS):
        return "parameter"
    if info.code == "string_above_max_length":
        # OpenAI's byte cap on one field: an overflow only when the field is the messages.
        return "overflow" if (info.param or "").startswith("messages") else None
    if any(p.search(text) for p in _OVERFLOW_PATTERNS):
        return "overflow"
    if status == 413 and any(p.search(text) for p in _OVERFLOW_413_PATTERNS):
        return "overflow"
    return None
