"""Mapping every way a side request can fail to SPEC §8 ``error`` objects (one place)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.providers.base import (
    ContextOverflow,
    ModelUnavailable,
    ProviderError,
    ProviderTimeout,
    RateLimited,
)
from service.summary.errors import SummaryError


@dataclass
class PipelineFailure(Exception):
    """A failure the pipeline decided on itself (snapshot missing, tool call, overflow that cannot shrink)."""

    code: str
    message: str
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)


class RequestLost(Exception):
    """The request is no longer this worker's (cancelled, cleared or taken over): stop, write nothing."""


def error_object(exc: BaseException, *, stage: str | None, timeout_s: float) -> dict[str, Any]:
    """The ``{"code", "message", "detail"}`` for ``exc`` (SPEC §3 detail shapes)."""
    if isinstance(exc, PipelineFailure):
        return {"code": exc.code, "message": exc.message, "detail": dict(exc.detail)}
    if isinstance(exc, SummaryError):
        return exc.to_error()
    if isinstance(exc, ProviderTimeout | TimeoutError):
        return {
            "code": "timeout",
            "message": f"the side request did not finish within its {timeout_s:g}s deadline",
            "detail": {"timeout_s": timeout_s, "stage": stage},
        }
    if isinstance(exc, RateLimited):
        attempts = int(getattr(exc, "attempts", 1))
        why = (
            "the provider's quota is exhausted" if exc.quota_exhausted else "the provider kept rate limiting"
        )
        return {
            "code": "rate_limited",
            "message": f"{why}: {exc.message}",
            "detail": {"status": exc.status, "attempts": attempts},
        }
    if isinstance(exc, ModelUnavailable):
        return {
            "code": "model_unavailable",
            "message": exc.message,
            "detail": {"status": exc.status, "message": exc.message},
        }
    if isinstance(exc, ContextOverflow):
        return {
            "code": "context_overflow",
            "message": exc.message,
            "detail": {"status": exc.status, "message": exc.message},
        }
    if isinstance(exc, ProviderError):
        return {
            "code": "provider_error",
            "message": exc.message,
            "detail": {"status": exc.status, "message": exc.message},
        }
    # A bug of ours, not the provider's: say so rather than blame the model.
    return {
        "code": "internal_error",
        "message": f"{type(exc).__name__}: {exc}",
        "detail": {"stage": stage},
    }
