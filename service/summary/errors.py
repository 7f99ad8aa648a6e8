"""One :class:`SummaryError` per way a summary can fail (SPEC §8), so the pipeline reports it without
knowing which one it got. Provider errors are *not* wrapped: their own codes (``provider_error``,
``rate_limited``, ``timeout`` …) are what the caller reports.
"""

from __future__ import annotations

from service.errors import SidequestError


class SummaryError(SidequestError):
    """Base of every summary failure; ``code`` is the SPEC §8 error code."""

    code = "summary_error"
    # A summary failure only ever ends a side request or a background job; were it an HTTP answer,
    # it would be the model's reply we could not use.
    status = 502


class SummaryTruncated(SummaryError):
    """The reply hit its output cap (``length`` / ``max_tokens``) before the JSON was complete."""

    code = "summary_truncated"

    def __init__(self, *, max_output_tokens: int, stop_reason: str) -> None:
        super().__init__(
            f"the summary was cut at its output cap of {max_output_tokens} tokens"
            f" (stop reason {stop_reason})",
            {"max_output_tokens": max_output_tokens, "stop_reason": stop_reason},
        )


class SummaryEmpty(SummaryError):
    """The reply had no body text (nothing at all, or reasoning / thinking only)."""

    code = "summary_empty"

    def __init__(self, *, thinking_only: bool = False) -> None:
        what = "only thinking, no summary text" if thinking_only else "no text"
        super().__init__(f"the summary reply was empty ({what})", {"thinking_only": thinking_only})


class SummaryInvalid(SummaryError):
    """The reply is not exactly one summary document (wrong JSON, keys, types or sizes)."""

    code = "summary_invalid"

    def __init__(self, reason: str) -> None:
        super().__init__(f"the summary reply is not a valid summary document: {reason}", {"reason": reason})
        self.reason = reason


class SummaryToolCall(SummaryError):
    """The model tried to call a tool during a summary call; never retried."""

    code = "summary_tool_call"

    def __init__(self, *, tool_name: str) -> None:
        super().__init__(
            f"the model tried to call the tool {tool_name!r} while summarising; summaries use no tools",
            {"tool_name": tool_name},
        )


class SummaryTooLong(SummaryError):
    """The rendered summary body is estimated above the body limit."""

    code = "summary_too_long"

    def __init__(self, *, body_tokens: int, limit: int) -> None:
        super().__init__(
            f"the summary body is about {body_tokens} tokens, over the limit of {limit}",
            {"body_tokens": body_tokens, "limit": limit},
        )


class SummaryCallCap(SummaryError):
    """The per-request summary call cap is (or would be) exceeded; no call beyond it is ever made."""

    code = "summary_call_cap"

    def __init__(
        self, *, calls_made: int, calls_needed: int, max_calls: int, calls_reserved: int = 0
    ) -> None:
        message = (
            f"summaries need {calls_needed} more call(s) but {calls_made} of the {max_calls} allowed "
            "summary calls of this request are already used"
        )
        detail = {"calls_made": calls_made, "calls_needed": calls_needed, "max_calls": max_calls}
        if calls_reserved:
            # Only when another summary plan of the same request, running at the same time, holds them.
            message += f" and {calls_reserved} more are promised to another summary running beside it"
            detail["calls_reserved"] = calls_reserved
        super().__init__(message, detail)
