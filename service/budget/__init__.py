"""The pure budget kernel (SPEC §5 and the planning half of §6).

Standard library only: no I/O, no clock, no database, no model. Every function takes plain values
and returns plain values; see docs/budget.md for the numbers and why they are what they are.
"""

# The names the other layers import from the package; "import X as X" marks a re-export (PEP 484).
from service.budget.chunk import FIRST_OUTPUT_TOKENS as FIRST_OUTPUT_TOKENS
from service.budget.chunk import MIN_CHUNK_CAPACITY as MIN_CHUNK_CAPACITY
from service.budget.chunk import RETRY_OUTPUT_TOKENS as RETRY_OUTPUT_TOKENS
from service.budget.chunk import chunk_pieces as chunk_pieces
from service.budget.chunk import summary_capacity as summary_capacity
from service.budget.chunk import summary_output_caps as summary_output_caps
from service.budget.cut import RECENT_BUDGET_TOKENS as RECENT_BUDGET_TOKENS
from service.budget.cut import CutPlan as CutPlan
from service.budget.cut import CutRefusal as CutRefusal
from service.budget.cut import plan_cut as plan_cut
from service.budget.cut import recent_budget_within as recent_budget_within
from service.budget.estimate import Calibration as Calibration
from service.budget.estimate import envelope_tokens as envelope_tokens
from service.budget.estimate import estimate_block as estimate_block
from service.budget.estimate import estimate_message as estimate_message
from service.budget.estimate import estimate_messages as estimate_messages
from service.budget.estimate import estimate_system as estimate_system
from service.budget.estimate import estimate_text as estimate_text
from service.budget.estimate import estimate_tools as estimate_tools
from service.budget.estimate import overflow_target as overflow_target
from service.budget.messages import MessageGroup as MessageGroup
from service.budget.messages import group_messages as group_messages
from service.budget.messages import normalize_snapshot as normalize_snapshot
from service.budget.messages import pending_tool_ids as pending_tool_ids
from service.budget.messages import tool_result_text as tool_result_text
from service.budget.meter import SegmentEstimate as SegmentEstimate
from service.budget.meter import pressure as pressure
from service.budget.meter import prompt_drift as prompt_drift
from service.budget.replay import HISTORY_BATCH_SIZE as HISTORY_BATCH_SIZE
from service.budget.replay import QAItem as QAItem
from service.budget.replay import ReplayPlan as ReplayPlan
from service.budget.replay import select_replay as select_replay
from service.budget.window import WindowPlan as WindowPlan
from service.budget.window import plan_window as plan_window
from service.budget.window import positive_setting as positive_setting
from service.budget.window import resolve_output_cap as resolve_output_cap
from service.budget.window import resolve_window as resolve_window
from service.budget.window import safety_margin as safety_margin
