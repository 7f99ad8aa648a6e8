"""Mapping every way a side request can fail to SPEC §8 ``error`` objects (one place)."""

from __future__ import annotations

import time
from typing import Any

from service.errors import SidequestError
from service.providers.base import ProviderError, ProviderTimeout
from service.store.db import is_unavailable
from service.vocabulary import terminal_error, timeout_error


class PipelineFailure(SidequestError):
    """A failure the pipeline decided on itself (snapshot missing, tool call, overflow that cannot shrink)."""

    def __init__(self, code: str, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message, detail, code=code)


class RequestLost(Exception):
    """The request is no longer this worker's (cancelled, cleared or taken over): stop, write nothing."""


def database_gone(exc: BaseException, deadline: float) -> bool:
    """Whether ``exc`` means the database went away (SPEC §9: write nothing; the lease brings the work
    back) rather than that the run failed. A bare ``TimeoutError`` before the run's ``deadline`` (a
    ``time.monotonic()`` value) is the driver's, a statement or checkout stuck on a node going away;
    from the deadline on it is the run's own."""
    return is_unavailable(exc, include_timeouts=time.monotonic() < deadline)


def error_object(
    exc: BaseException, *, stage: str | None, timeout_s: float, what: str = "the side request"
) -> dict[str, Any]:
    """The ``{"code", "message", "detail"}`` for ``exc`` (SPEC §3): every error of ours and every provider
    error says it itself; only a timeout needs the deadline, stage and ``what`` timed out."""
    if isinstance(exc, ProviderTimeout | TimeoutError):
        return timeout_error(what, timeout_s, stage)
    if isinstance(exc, SidequestError | ProviderError):
        return exc.to_error()
    # A bug of ours, not the provider's: say so rather than blame the model.
    return terminal_error("internal_error", f"{type(exc).__name__}: {exc}", {"stage": stage})
