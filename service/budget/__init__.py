"""The pure budget kernel (SPEC §5 and the planning half of §6).

Standard library only: no I/O, no clock, no database, no model. Every function takes plain values
and returns plain values; see docs/budget.md for the numbers and why they are what they are.
"""

from service.budget.chunk import (
    FIRST_OUTPUT_TOKENS,
    MIN_CHUNK_CAPACITY,
    RETRY_OUTPUT_TOKENS,
    chunk_pieces,
    summary_capacity,
    summary_output_caps,
)
from service.budget.cut import RECENT_BUDGET_TOKENS, CutPlan, CutRefusal, plan_cut, recent_budget_within
from service.budget.estimate import (
    Calibration,
    envelope_tokens,
    estimate_block,
    estimate_message,
    estimate_messages,
    estimate_system,
    estimate_text,
    estimate_tools,
    overflow_target,
)
from service.budget.messages import (
    MessageGroup,
    group_messages,
    normalize_snapshot,
    pending_tool_ids,
    tool_result_text,
)
from service.budget.meter import SegmentEstimate, pressure, prompt_drift
from service.budget.replay import HISTORY_BATCH_SIZE, QAItem, ReplayPlan, select_replay
from service.budget.window import (
    WindowPlan,
    plan_window,
    positive_setting,
    resolve_output_cap,
    resolve_window,
    safety_margin,
)

__all__ = [
    "FIRST_OUTPUT_TOKENS",
    "HISTORY_BATCH_SIZE",
    "MIN_CHUNK_CAPACITY",
    "RECENT_BUDGET_TOKENS",
    "RETRY_OUTPUT_TOKENS",
    "Calibration",
    "CutPlan",
    "CutRefusal",
    "MessageGroup",
    "QAItem",
    "ReplayPlan",
    "SegmentEstimate",
    "WindowPlan",
    "chunk_pieces",
    "envelope_tokens",
    "estimate_block",
    "estimate_message",
    "estimate_messages",
    "estimate_system",
    "estimate_text",
    "estimate_tools",
    "group_messages",
    "normalize_snapshot",
    "overflow_target",
    "pending_tool_ids",
    "plan_cut",
    "plan_window",
    "positive_setting",
    "pressure",
    "prompt_drift",
    "recent_budget_within",
    "resolve_output_cap",
    "resolve_window",
    "safety_margin",
    "select_replay",
    "summary_capacity",
    "summary_output_caps",
    "tool_result_text",
]
