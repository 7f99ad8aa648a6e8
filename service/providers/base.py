"""The one small interface every model provider adapter implements (docs/providers.md, "The stream").

Messages travel in one canonical, Anthropic-style shape (the snapshot's own, after normalisation); each
adapter converts to its wire format, streams :data:`ProviderEvent` values and raises one of the typed
errors below. It never retries by itself (the calling policy decides) and never invents usage.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Purpose = Literal["answer", "qa_summary", "context_summary"]


@dataclass(frozen=True)
class CallUsage:
    """Token usage of one provider call, exactly as the provider reported it (``input_tokens``
    includes ``cached_tokens``); ``reported`` False: it sent none, and the zeros are never estimates."""

    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    reported: bool = False


@dataclass(frozen=True)
class ProviderCall:
    """One model call: everything an adapter needs, nothing it must look up."""

    model: str
    messages: list[dict[str, Any]]
    max_output_tokens: int
    purpose: Purpose
    request_id: str
    system: str | None = None
    # ``system`` as the snapshot's own text blocks (NormalizedSnapshot.system_blocks), for an adapter
    # that takes blocks; empty when it came as a string (or is Sidequest's own prompt).
    system_blocks: tuple[dict[str, Any], ...] = ()
    tools: list[dict[str, Any]] = field(default_factory=list)
    # Seconds left before the side request's deadline; the adapter uses it as its HTTP timeout.
    timeout_s: float = 120.0
    # Set for a background summary job's call (SPEC §6.6): sent as X-Sidequest-Job-Id *instead of*
    # the request id header (``request_id`` is then the job id too, for logs).
    job_id: str | None = None

    def headers(self) -> dict[str, str]:
        """The Sidequest headers every provider call carries (SPEC §7, §6.6)."""
        if self.job_id is not None:
            return {"X-Sidequest-Purpose": self.purpose, "X-Sidequest-Job-Id": self.job_id}
        return {"X-Sidequest-Purpose": self.purpose, "X-Sidequest-Request-Id": self.request_id}


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Thinking / reasoning text, kept apart from the answer body."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """The model tried to call a tool (never allowed for side answers and summaries)."""

    name: str
    id: str | None = None


@dataclass(frozen=True)
class UsageReport:
    """Usage reported so far in this call (cumulative: the last report is the call's usage)."""

    usage: CallUsage


@dataclass(frozen=True)
class Finish:
    """The end of a reply: ``stop_reason`` normalised (stop/length/tool_calls/content_filter)."""

    stop_reason: str
    raw_stop_reason: str | None = None


ProviderEvent = TextDelta | ReasoningDelta | ToolCall | UsageReport | Finish


# The errors are dataclasses for their keyword fields; eq=False keeps an exception's identity (and hash).
@dataclass(eq=False, kw_only=True)
class ProviderError(Exception):
    """A provider call failed: ``status`` its HTTP status if any, ``usage`` what it reported before
    failing, ``after_output`` whether text or a tool call had streamed before. Not a
    :class:`~service.errors.SidequestError`, whose ``status`` is the one *we* would answer with
    (docs/architecture.md); it speaks the rest: ``code``, :meth:`to_error`."""

    code = "provider_error"
    message: str = field(kw_only=False)
    status: int | None = None
    usage: CallUsage | None = None
    after_output: bool = False

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def reported_prompt_tokens(self) -> int | None:
        """The prompt tokens the provider reported before it failed, else None: SPEC §5.1 makes every
        call whose usage reports them a calibration sample, a failed one too."""
        usage = self.usage
        return usage.input_tokens if usage is not None and usage.reported and usage.input_tokens > 0 else None

    def to_error(self) -> dict[str, Any]:
        """SPEC §8's error object of a side request this failure ended (detail: status, message)."""
        return {
            "code": self.code,
            "message": self.message,
            "detail": {"status": self.status, "message": self.message},
        }


@dataclass(eq=False, kw_only=True)
class ContextOverflow(ProviderError):
    """The prompt does not fit the model's context window. ``prompt_tokens`` / ``context_limit``: its real
    count and the window, when the body states them (a calibration sample, and what the overflow retry
    shrinks to: SPEC §5.1); ``output_fills_window``: the requested output alone fills the window, so no
    smaller prompt fits."""

    code = "context_overflow"
    prompt_tokens: int | None = None
    context_limit: int | None = None
    output_fills_window: bool = False


class ModelUnavailable(ProviderError):
    """The model does not exist or is not served (whatever the HTTP status)."""

    code = "model_unavailable"


@dataclass(eq=False, kw_only=True)
class RateLimited(ProviderError):
    """429 / 529 / a 413 that is a token-rate limit; ``quota_exhausted`` must not be retried.
    ``attempts``: calls made before giving up (set by the calling policy; SPEC §3's error detail)."""

    code = "rate_limited"
    retry_after_s: float | None = None
    quota_exhausted: bool = False
    attempts: int = 1

    def to_error(self) -> dict[str, Any]:
        """SPEC §3's ``rate_limited`` object: why it gave up, the status and how many calls it made."""
        why = (
            "the provider's quota is exhausted" if self.quota_exhausted else "the provider kept rate limiting"
        )
        return {
            "code": self.code,
            "message": f"{why}: {self.message}",
            "detail": {"status": self.status, "attempts": int(self.attempts)},
        }


class ProviderTimeout(ProviderError):
    """The call did not finish within its timeout (a side request reports it as its deadline
    passing: ``service.pipeline.failures.error_object``)."""

    code = "timeout"


def finished(raw: str | None, reasons: Mapping[str, str], usage: CallUsage | None) -> Finish:
    """The reply's end, ``raw`` as SPEC §3 names it by ``reasons`` (any other value passes through);
    a stream that ended without a stop reason broke off."""
    if raw is None:
        raise ProviderError("the stream ended before the model finished", usage=usage)
    return Finish(stop_reason=reasons.get(raw, raw), raw_stop_reason=raw)


def sdk_api_key(api_key: str | None, base_url: str | None) -> str | None:
    """``api_key``; for a server of one's own (``base_url`` set: no key needed, but the SDKs insist on
    one) a placeholder, never a real credential; else None (the SDK reads its own environment variable)."""
    if api_key is None and base_url is not None:
        return "sidequest-no-api-key"
    return api_key


def reported_count(value: Any) -> int:
    """A usage count as a provider reported it; 0 when it sent none, or not a number."""
    try:
        return int(value) if value is not None else 0
    except (TypeError, ValueError):
        return 0


class Provider(Protocol):
    default_model: str

    def stream(self, call: ProviderCall) -> AsyncGenerator[ProviderEvent, None]:
        """Stream one call's events; raise a :class:`ProviderError` subclass on failure."""

    async def aclose(self) -> None:
        """Release HTTP clients."""
