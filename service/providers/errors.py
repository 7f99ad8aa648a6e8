"""Turn a provider's error response into one of our typed errors, by what the body **says**, whatever
the HTTP status (gateways re-wrap upstream errors under their own) and whatever form it arrives in
(:mod:`service.providers.error_body`). The rules, first match wins, and their reasons are in
docs/providers.md ("Error classification"); the real bodies they were written against are test fixtures
under ``tests/fixtures/provider_errors/``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import httpx2

from service.providers.base import (
    CallUsage,
    ContextOverflow,
    ModelUnavailable,
    ProviderError,
    ProviderTimeout,
    RateLimited,
    reported_count,
)
from service.providers.error_body import ErrorInfo, parse_body
from service.providers.retry_after import parse_retry_after

# A provider message is kept for the request's error detail; a whole HTML error page is not useful.
_MAX_MESSAGE_CHARS = 2000


def _compile(*patterns: str, flags: int = 0) -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(p, re.IGNORECASE | flags) for p in patterns)


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
# arithmetic decides between an overflow and a parameter cap. Groups: window, output, input, tool. The
# wordings, with an example each, are in docs/providers.md (rule 4).
_WINDOW_AND_OUTPUT = _compile(
    # OpenAI legacy / vLLM / DeepSeek
    r"maximum context length is (?P<window>\d+) tokens.{0,80}?(?P<input>\d+) in the messages, "
    r"(?P<output>\d+) in the completion",
    # OpenAI completions legacy
    r"maximum context length is (?P<window>\d+) tokens.{0,80}?(?P<input>\d+) in your prompt[;,] "
    r"(?P<output>\d+) for the completion",
    # vLLM ≥ 0.8
    r"is too large: (?P<output>\d+)\. This model's maximum context length is (?P<window>\d+) tokens"
    r"(?: and your request has (?P<input>\d+) input tokens)?",
    # vLLM (newer)
    r"maximum context length is (?P<window>\d+) tokens\. However, you requested (?P<output>\d+) "
    r"output tokens(?: and your prompt contains at least (?P<input>\d+) input tokens)?",
    # vLLM ≥ 0.10
    r"You passed (?P<input>\d+) input tokens and requested (?P<output>\d+) output tokens\. "
    r"However, the model'?s context length is only (?P<window>\d+) tokens",
    # SGLang
    r"maximum context length of (?P<window>\d+) tokens\. You requested a total of \d+ tokens: "
    r"(?P<input>\d+) tokens from the input messages and (?P<output>\d+) tokens for the completion",
    # OpenRouter
    r"maximum context length is (?P<window>\d+) tokens\. However, you requested about \d+ tokens "
    r"\((?P<input>\d+) of text input(?:, (?P<tool>\d+) of tool input)?, (?P<output>\d+) in the output",
    r"exceed context limit: (?P<input>\d+) \+ (?P<output>\d+) > (?P<window>\d+)",  # Anthropic
    # TGI
    r"must be <= (?P<window>\d+)\. Given: (?P<input>\d+) `inputs` tokens and "
    r"(?P<output>\d+) `max_new_tokens`",
    flags=re.DOTALL,
)

# Where an overflow message states the prompt's token count (group ``p``) and / or the window (group
# ``l``). Tried in order; the first hit for each number wins.
_COUNTS = _compile(
    r"prompt is too long: (?P<p>\d+) tokens > (?P<l>\d+) maximum",  # Anthropic
    r"request \((?P<p>\d+) tokens\) exceeds the available context size \((?P<l>\d+)",  # llama.cpp
    r"The input \((?P<p>\d+) tokens\) is longer than the model'?s context length \((?P<l>\d+)",  # SGLang
    r"The decoder prompt \(length (?P<p>\d+)\) is longer than the maximum model length of (?P<l>\d+)",
    # Mistral (the draft tokens: its newer wording)
    r"Prompt contains (?P<p>\d+) tokens(?: and \d+ draft tokens)?, too large for model with (?P<l>\d+)",
    r"input token count is (?P<p>\d+) but (?:the )?model only supports up to (?P<l>\d+)",  # Vertex
    r"maximum prompt length is (?P<l>\d+) but the request contains (?P<p>\d+) tokens",  # xAI
    r"exceeded model token limit: (?P<l>\d+)",  # Moonshot: "requested" adds the output
    r"input token count \((?P<p>\d+)\) exceeds the maximum number of tokens allowed \((?P<l>\d+)",  # Gemini
    r"maximum number of tokens allowed \((?P<l>\d+)",  # Gemini 2.5 (no count)
    r"The prompt is too long: (?P<p>\d+), model maximum context length: (?P<l>\d+)",
    r"configured limit of (?P<l>\d+) tokens\. Your messages resulted in (?P<p>\d+) tokens",
    r"`inputs` must have less than (?P<l>\d+) tokens\. Given: (?P<p>\d+)",  # TGI
    r"your request has (?P<p>\d+) input tokens",  # vLLM
    r"You passed (?P<p>\d+) input tokens",  # vLLM ≥ 0.10
    r"your prompt contains at least (?P<p>\d+) input tokens",  # vLLM (newer)
    r"messages resulted in (?P<p>\d+) tokens",  # OpenAI, Azure
    r"(?P<p>\d+) tokens from the input messages",  # SGLang
    r"about \d+ tokens \((?P<p>\d+) of text input\)",  # OpenRouter (text only)
    r"(?P<p>\d+) in the messages",  # OpenAI legacy, DeepSeek, vLLM
    r"(?P<p>\d+) in your prompt",  # OpenAI completions legacy
    r"exceed context limit: (?P<p>\d+) \+ \d+ > (?P<l>\d+)",  # Anthropic
    r"Given: (?P<p>\d+) `inputs` tokens",  # TGI
    r"maximum context length is (?P<l>\d+)",  # OpenAI, vLLM, DeepSeek, OpenRouter
    r"maximum context length of (?P<l>\d+)",  # SGLang
    r"context length is only (?P<l>\d+)",  # vLLM ≥ 0.10
    r"context length of only (?P<l>\d+)",  # LM Studio
    r"`inputs` tokens \+ `max_new_tokens` must be <= (?P<l>\d+)",  # TGI
    r"exceeds the available context size \((?P<l>\d+)",  # llama.cpp
    r"tokens in the prompt cannot exceed (?P<l>\d+) - received (?P<p>\d+)",  # Cohere
    r"\(prompt and prediction\) cannot exceed (?P<l>\d+)",  # Cohere (input + output)
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


def classify_error(
    status: int | None,
    body: Any,
    headers: Mapping[str, str] | None = None,
    *,
    usage: CallUsage | None = None,
    now: float | None = None,
) -> ProviderError:
    """Classify one failed provider response: ``status`` is None when the error came inside a streamed
    (HTTP 200) reply; ``body`` is the parsed JSON body, its raw text, or a stream's error object.
    ``usage`` (reported before failing) is attached to the returned error. ``now`` (epoch seconds, else
    the wall clock) dates an HTTP-date ``Retry-After``."""
    info = parse_body(body)
    effective = status if status is not None and status >= 400 else info.status_hint
    message = _describe(effective, info)

    if _is_model_missing(effective, info):
        return ModelUnavailable(message, status=effective, usage=usage)

    if _is_quota_exhausted(effective, info):
        return RateLimited(message, status=effective, usage=usage, quota_exhausted=True)

    if _is_rate_limit(effective, info):
        wait = parse_retry_after(headers, message=info.searchable, now=now)
        return RateLimited(message, status=effective, usage=usage, retry_after_s=wait)

    verdict = _overflow_verdict(effective, info)
    if verdict == "overflow":
        prompt_tokens, context_limit = overflow_counts(info.searchable, info.fields)
        filled = _output_filling_window(info.searchable)
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
    if effective == 404 and verdict is None:
        # Not a model (rule 1) nor an output cap ("parameter"): the endpoint itself is not there.
        message += (
            " (HTTP 404 naming no model: is SIDEQUEST_BASE_URL right? The openai provider wants it "
            "with /v1, the anthropic provider without)"
        )
    # A 408 is the provider's own timeout, not the side request's deadline: a provider error with
    # the provider's words, so nobody reads "did not finish within its deadline" after 0.2 s.
    return ProviderError(message, status=effective, usage=usage)


STALLED = "the stream stalled past the call's timeout"


def stream_broke(exc: httpx2.HTTPError | ValueError, usage: CallUsage | None) -> ProviderError:
    """A running stream that failed beneath the SDK's own errors: its transport (the anthropic SDK lets
    those through; the openai one wraps them today, whatever its next version does), or a chunk that is
    not JSON (SGLang's ``\\'``, an error as text): an overflow there must reach the overflow retry like
    any other; the rest is about invalid data."""
    if isinstance(exc, httpx2.TimeoutException):
        return ProviderTimeout(STALLED, usage=usage)
    if isinstance(exc, httpx2.HTTPError):
        return ProviderError(f"the stream broke: {type(exc).__name__}: {exc}", usage=usage)
    if isinstance(exc, json.JSONDecodeError):
        error = classify_error(None, exc.doc, usage=usage)
        if type(error) is not ProviderError:
            return error
    return ProviderError(f"the stream sent invalid data: {exc}", usage=usage)


def sdk_error(exc: Any, usage: CallUsage | None = None) -> ProviderError:
    """An SDK's plain ``APIError`` (openai's or anthropic's: no status), classified by its body, or by its
    own message when it kept none."""
    return classify_error(None, exc.body if exc.body is not None else exc.message, usage=usage)


def overflow_counts(text: str, fields: Mapping[str, Any] | None = None) -> tuple[int | None, int | None]:
    """``(prompt_tokens, context_limit)`` as an overflow message (or the error's own fields) states
    them, None where it does not (docs/providers.md, "The prompt's real token count")."""
    # llama.cpp puts both numbers in the error object itself.
    prompt = _positive((fields or {}).get("n_prompt_tokens"))
    limit = _positive((fields or {}).get("n_ctx"))
    for pattern in _COUNTS:
        if prompt is not None and limit is not None:
            break
        match = pattern.search(text)
        if match:  # (_positive gives None or a count > 0, so ``or`` keeps a number already found)
            prompt = prompt or _positive(match.groupdict().get("p"))
            limit = limit or _positive(match.groupdict().get("l"))
    if prompt is None:
        # OpenRouter splits the prompt into text and tool input.
        match = _window_and_output(text)
        if match and "tool" in match.re.groupindex and match.group("input"):
            prompt = int(match.group("input")) + int(match.group("tool") or 0)
    return prompt, limit


def _positive(value: Any) -> int | None:
    return max(reported_count(value), 0) or None


def _describe(status: int | None, info: ErrorInfo) -> str:
    """The provider's own message, trimmed; a stand-in when it sent none."""
    message = info.message.strip() or info.text.strip()
    if not message:
        message = f"HTTP {status}" if status is not None else "provider error"
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "…"
    return message


def _is_model_missing(status: int | None, info: ErrorInfo) -> bool:
    if info.code in _MODEL_MISSING_CODES:
        return True
    if status == 404:
        # "The model `x` does not exist", "model: sonnet4", "models/gemini-1.0-pro is not found": a
        # model; "Not Found", {"detail": "Not Found"}, "404 page not found": a route that is not there.
        return bool(_NAMES_A_MODEL.search(info.searchable))
    if status in (429, 529):
        return False  # a rate limit may name its model ("Rate limit reached for model …")
    # Servers answer an unknown model with 400 too (OpenRouter, Together, LiteLLM's proxy, LM Studio),
    # and gateways re-wrap it in a 500: only trust the wording when it is about the model.
    if _MODEL_UNSERVABLE.search(info.message):
        return True
    return (status is None or status < 500) and bool(_MODEL_MISSING.search(info.message))


def _is_quota_exhausted(status: int | None, info: ErrorInfo) -> bool:
    # 402 Payment Required: DeepSeek's "Insufficient Balance", OpenRouter's "requires more credits".
    if "insufficient_quota" in (info.type, info.code) or status == 402 or _QUOTA.search(info.message):
        return True
    return (
        bool(_OPENAI_QUOTA_WORDING.search(info.message))
        and "RESOURCE_EXHAUSTED" not in info.text
        and not _GEMINI_RATE_LIMIT_DOCS.search(info.message)
    )


def _is_rate_limit(status: int | None, info: ErrorInfo) -> bool:
    if status in (429, 529) or info.code == "rate_limit_exceeded":
        return True
    if info.type in _RATE_LIMIT_TYPES or info.type == "RESOURCE_EXHAUSTED":  # Gemini's status
        return True
    # A 413 that talks about tokens per minute is Groq's TPM limit, not a too-long prompt; an error
    # inside a stream has no status, so its wording is all there is.
    return status in (413, None) and bool(_RATE_LIMIT_WORDING.search(info.message))


def _window_and_output(text: str) -> re.Match[str] | None:
    return next(filter(None, (pattern.search(text) for pattern in _WINDOW_AND_OUTPUT)), None)


def _output_filling_window(text: str) -> tuple[int, int] | None:
    """``(window, output)`` when the message names both and the output alone fills the window."""
    match = _window_and_output(text)
    if match is None:
        return None
    window, output = int(match.group("window")), int(match.group("output"))
    return (window, output) if output >= window else None


def _overflow_verdict(status: int | None, info: ErrorInfo) -> str | None:
    """``"overflow"``, ``"parameter"`` (an output-cap error) or None (neither)."""
    text = info.searchable
    if _window_and_output(text):
        # Input and requested output together exceed the window: an overflow (SPEC §7), also when
        # the output alone fills it (then no shrinking helps, and the message says why).
        return "overflow"
    if info.param in _PARAMETER_CAP_PARAMS or any(p.search(text) for p in _PARAMETER_CAP_PATTERNS):
        return "parameter"
    if info.code == "string_above_max_length":
        # OpenAI's byte cap on one field: an overflow only when the field is the messages.
        return "overflow" if (info.param or "").startswith("messages") else None
    if any(p.search(text) for p in _OVERFLOW_PATTERNS):
        return "overflow"
    if status == 413 and any(p.search(text) for p in _OVERFLOW_413_PATTERNS):
        return "overflow"
    return None
