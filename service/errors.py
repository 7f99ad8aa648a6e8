"""The one error protocol: every refusal and failure of ours carries ``code``, ``status``,
``message`` and ``detail``, so one place maps it to HTTP (``service.api.errors``) and one to a failed
request's SPEC §8 error object (``service.pipeline.failures``).

``status`` is the HTTP status the error answers with when it ends an HTTP request; an error that can
only end a side request (a provider failure, say) still names the status it would have (502, 504 …),
so the mapping never guesses. Pure: stdlib only.
"""

from __future__ import annotations

from typing import Any


class SidequestError(Exception):
    """Base of every error with a stable SPEC code."""

    code: str = "internal_error"
    status: int = 500

    def __init__(
        self,
        message: str,
        detail: dict[str, Any] | None = None,
        *,
        code: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.detail: dict[str, Any] = dict(detail or {})
        # HTTP headers the answer carries besides the body (Retry-After, WWW-Authenticate); rare.
        self.headers: dict[str, str] = dict(headers or {})
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def to_error(self) -> dict[str, Any]:
        """SPEC's ``{"code", "message", "detail"}`` object."""
        return {"code": self.code, "message": self.message, "detail": dict(self.detail)}
