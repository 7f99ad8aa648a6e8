"""Cut planning for compacting the snapshot copy (SPEC §6.2 compacting_context), between message
groups only. When compaction cannot help, :func:`plan_cut` says why with a :class:`CutRefusal` of a
distinct ``reason``, never a bare False: "reporting success while doing nothing is worse than an error".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from service.budget.chunk import FIRST_OUTPUT_TOKENS
from service.budget.messages import MessageGroup

# The newest messages kept verbatim, as whole groups, up to this estimate.
RECENT_BUDGET_TOKENS: Final = 8000
# A summary may come back as long as the first attempt's output cap; summarising less than that
# can make the copy longer instead of shorter, so by default such a cut is refused.
MIN_SUMMARIZED_TOKENS: Final = FIRST_OUTPUT_TOKENS

# Refusal reasons (CutRefusal.reason), each meaning something different to the caller: no messages;
# every group fits the recent budget (shrinking needs a smaller one or another segment); the old
# messages estimate below the minimum (a summary of them would not reliably be smaller).
NOTHING_TO_SUMMARIZE: Final = "nothing_to_summarize"
ALL_FIT_RECENT: Final = "all_fit_recent"
TOO_LITTLE_TO_SUMMARIZE: Final = "too_little_to_summarize"

CUT_REFUSAL_REASONS: Final = frozenset({NOTHING_TO_SUMMARIZE, ALL_FIT_RECENT, TOO_LITTLE_TO_SUMMARIZE})


@dataclass(frozen=True)
class CutPlan:
    """``messages[:summarize_until]`` go into the summary, the rest stays verbatim.
    ``gross_removed_tokens`` is the summarised messages' estimate, before the summary is added back."""

    summarize_until: int
    summarized_groups: int
    kept_groups: int
    kept_messages: int
    gross_removed_tokens: int
    kept_tokens: int

    def net_removed_tokens(self, summary_tokens: int) -> int:
        """Tokens saved once a summary of ``summary_tokens`` replaces the old messages (≤ 0: no help)."""
        return self.gross_removed_tokens - summary_tokens


@dataclass(frozen=True)
class CutRefusal:
    """Compaction cannot help: ``reason`` (one of :data:`CUT_REFUSAL_REASONS`) and why, in words."""

    reason: str
    explanation: str


# Each refusal's words live here, whichever planner (this one or the ladder's) refuses.
NO_MESSAGES: Final = CutRefusal(NOTHING_TO_SUMMARIZE, "the snapshot has no messages to summarise")


def all_fit_recent(messages: int, tokens: int, recent_budget: int) -> CutRefusal:
    """Every one of ``messages`` (``tokens`` in all) fits the recent budget: no old part to summarise."""
    return CutRefusal(
        ALL_FIT_RECENT,
        f"all {messages} messages ({tokens} tokens) fit the recent budget of {recent_budget} tokens:"
        " there are no old messages to summarise",
    )


def too_little_to_summarize(amount: str, messages: int, minimum: int) -> CutRefusal:
    """The old part of ``messages`` estimates below ``minimum`` tokens; ``amount`` says how much, in
    words (``"1200 tokens"``, ``"1200 tokens (masked)"``)."""
    return CutRefusal(
        TOO_LITTLE_TO_SUMMARIZE,
        f"only {amount} in {messages} old messages would be summarised, less than {minimum}:"
        " a summary would not reliably be smaller",
    )


def _check_partition(groups: Sequence[MessageGroup]) -> None:
    """Groups must tile ``messages[0:n]`` in order, as :func:`group_messages` produces them."""
    expected = 0
    for group in groups:
        if group.start != expected or group.end <= group.start:
            raise ValueError("groups must be contiguous, non-empty and start at message 0")
        expected = group.end


def recent_budget_within(room: int) -> int:
    """The verbatim tail a compaction may keep when ``room`` tokens are left for it: SPEC §6.2's *up to*
    8000, held to the room in a small window where 8000 would not fit, never below 0."""
    return max(0, min(RECENT_BUDGET_TOKENS, room))


def recent_start(verbatim: Sequence[int], recent_budget: int) -> int:
    """The first group of the recent part: the newest whole groups whose estimates sum to at most
    ``recent_budget`` (a newest group larger than that leaves the recent part empty)."""
    kept = 0
    start = len(verbatim)
    while start > 0 and kept + verbatim[start - 1] <= recent_budget:
        start -= 1
        kept += verbatim[start]
    return start


def plan_cut(
    groups: Sequence[MessageGroup],
    recent_budget: int = RECENT_BUDGET_TOKENS,
    min_summarized_tokens: int = MIN_SUMMARIZED_TOKENS,
) -> CutPlan | CutRefusal:
    """Plan the cut: keep the newest whole groups whose estimates sum to at most ``recent_budget``
    (:func:`recent_start`), summarise the rest. Overflow recovery compacts harder by passing a
    smaller ``recent_budget`` (0 keeps nothing) or ``min_summarized_tokens=0``."""
    _check_partition(groups)
    if not groups:
        return NO_MESSAGES
    summarized = recent_start([group.tokens for group in groups], recent_budget)
    if summarized == 0:
        return all_fit_recent(groups[-1].end, sum(g.tokens for g in groups), recent_budget)
    until = groups[summarized - 1].end
    plan = CutPlan(
        summarize_until=until,
        summarized_groups=summarized,
        kept_groups=len(groups) - summarized,
        kept_messages=groups[-1].end - until,
        gross_removed_tokens=sum(group.tokens for group in groups[:summarized]),
        kept_tokens=sum(group.tokens for group in groups[summarized:]),
    )
    if plan.gross_removed_tokens < min_summarized_tokens:
        return too_little_to_summarize(
            f"{plan.gross_removed_tokens} tokens", plan.summarize_until, min_summarized_tokens
        )
    return plan
