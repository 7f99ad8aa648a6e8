"""The one error protocol (docs/architecture.md, "Errors: one protocol"): every refusal and failure
of ours carries ``code``, ``status``, ``message`` and ``detail``. An error that can only end a side
request still names the HTTP status it would have (502, 504 …), so the mapping never guesses.
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
