"""Window, output cap, safety margin and input budget (SPEC §3 output cap, §5 window)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# Why each number is what it is: docs/budget.md "The numbers".
DEFAULT_WINDOW: Final = 200_000  # when nothing names a window
SAFETY_MARGIN_PERCENT: Final = 5
SAFETY_MARGIN_MIN: Final = 128
SAFETY_MARGIN_MAX: Final = 8192


def positive_setting(value: object) -> int | None:
    """A window or cap from JSON (options, session settings, a snapshot's own fields): a positive int, not
    a bool — an integral float like ``4096.0`` counts, as in JSON; else None (the API refuses those: 422)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def resolve_output_cap(
    request_cap: int | None, config_cap: int, main_cap: int | None, *, session_cap: int | None = None
) -> int:
    """Side answer output cap: ``min(request_cap or session_cap or config_cap, main_cap)`` (SPEC §11.2),
    ``main_cap`` being the main session's own; a non-positive value counts as not given."""
    cap = next((given for given in (request_cap, session_cap) if given is not None and given > 0), config_cap)
    return min(cap, main_cap) if main_cap is not None and main_cap > 0 else cap


def resolve_window(
    request_window: int | None,
    snapshot_window: int | None,
    config_window: int | None,
    *,
    session_window: int | None = None,
) -> int:
    """Model window: request → session settings → snapshot → ``SIDEQUEST_CONTEXT_WINDOW`` → 200000."""
    given = (request_window, session_window, snapshot_window, config_window)
    return next((window for window in given if window is not None and window > 0), DEFAULT_WINDOW)


def safety_margin(window: int) -> int:
    """``clamp(ceil(5 % of window), 128, 8192)``, rounded up: the margin absorbs under-estimates."""
    five_percent = -(-window * SAFETY_MARGIN_PERCENT // 100)
    return min(SAFETY_MARGIN_MAX, max(SAFETY_MARGIN_MIN, five_percent))


@dataclass(frozen=True)
class WindowPlan:
    """The numbers of one request's window (SPEC ``context_info`` fields of the same names)."""

    window: int
    max_output_tokens: int
    safety_margin: int
    input_budget: int


def plan_window(window: int, max_output_tokens: int) -> WindowPlan:
    """Input budget = window − output cap − safety margin. Never raises: a budget ≤ 0 shows downstream
    (``critical`` pressure, an overflow) rather than as an exception here."""
    margin = safety_margin(window)
    return WindowPlan(window, max_output_tokens, margin, window - max_output_tokens - margin)
