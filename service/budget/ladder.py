"""The compaction ladder (SPEC §6.2): THE decision of how a snapshot copy is made to fit, for a
request, a background job and a stored snapshot's trigger (§6.6) alike (docs/budget.md "The compaction
ladder"). Everything is in whole groups and raw estimate tokens: ``room`` is what is left for the
transcript once the rest of the request is counted (the calibration already applied to its budget).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Final, Literal

from service.budget.chunk import SUMMARY_MAX_TOKENS
from service.budget.cut import (
    MIN_SUMMARIZED_TOKENS,
    NO_MESSAGES,
    RECENT_BUDGET_TOKENS,
    CutRefusal,
    all_fit_recent,
    plan_cut,
    recent_budget_within,
    recent_start,
    too_little_to_summarize,
)
from service.budget.estimate import MESSAGE_ENVELOPE_TOKENS
from service.budget.messages import MessageGroup
from service.budget.prepared import PreparedSnapshot
from service.budget.trail import TrailSizes

Tier = Literal["none", "masked", "summary"]
# What a summary costs beside its own text in the answer request: its user turn and the assistant's
# short acknowledgement after it (two envelopes and a sentence), rounded up.
SUMMARY_TURN_TOKENS: Final = 2 * MESSAGE_ENVELOPE_TOKENS + 24
# A summary not made yet is counted at its largest valid size, in its turn.
SUMMARY_RESERVE_TOKENS: Final = SUMMARY_MAX_TOKENS + SUMMARY_TURN_TOKENS
NONE: Final = "none"
MASKED: Final = "masked"
SUMMARY: Final = "summary"


@dataclass(frozen=True)
class Compaction:
    """Groups ``[0, summarize_until)`` summarised, ``[summarize_until, mask_until)`` masked, the rest
    verbatim. ``fits`` is False for a tier-2 plan that cannot fit even so (it then summarises all
    before the recent part), for the caller to go on or refuse."""

    tier: Tier
    summarize_until: int
    mask_until: int
    fits: bool = True


def _least_masking(
    verbatim_sums: list[int], masked_sums: list[int], start: int, limit: int, fixed: int, room: int
) -> int | None:
    """The fewest groups from ``start`` to mask (up to ``limit``) so that ``fixed`` + masked +
    verbatim fits ``room``: the index masking stops at, or None."""
    total = verbatim_sums[-1]
    for until in range(start, max(start, limit) + 1):
        size = fixed + (masked_sums[until] - masked_sums[start]) + (total - verbatim_sums[until])
        if size <= room:
            return until
    return None


def plan_compaction(
    groups: Sequence[MessageGroup],
    masked: Sequence[int] | None,
    room: int,
    *,
    summary_tokens: int,
    trail_tokens: Callable[[int], int] | None = None,
    recent_budget: int = RECENT_BUDGET_TOKENS,
    min_summarized_tokens: int = MIN_SUMMARIZED_TOKENS,
) -> Compaction | CutRefusal:
    """The ladder's tier for a transcript of ``groups`` (``masked``: each group's estimate masked; None
    when masking is off) in ``room`` tokens, as docs/budget.md "The compaction ladder" defines the
    tiers; a summary of ``s`` groups costs ``summary_tokens + trail_tokens(s)``. Masking off:
    :func:`plan_cut`'s tier 2. A :class:`CutRefusal` says why no plan can help."""
    verbatim = [group.tokens for group in groups]
    if masked is not None and len(masked) != len(verbatim):
        raise ValueError("masked must have one estimate per group")
    verbatim_sums = list(accumulate(verbatim, initial=0))
    if verbatim_sums[-1] <= room:
        return Compaction(NONE, 0, 0)
    if not groups:
        return NO_MESSAGES
    if masked is None:
        cut = plan_cut(groups, recent_budget, min_summarized_tokens)
        if isinstance(cut, CutRefusal):
            return cut
        until = cut.summarized_groups
        return Compaction(SUMMARY, until, until, summary_tokens + cut.kept_tokens <= room)
    recent = recent_start(verbatim, recent_budget)
    masked_sums = list(accumulate(masked, initial=0))
    mask_until = _least_masking(verbatim_sums, masked_sums, 0, recent, 0, room)
    if mask_until is not None:
        return Compaction(MASKED, 0, mask_until)
    if recent == 0:
        return all_fit_recent(groups[-1].end, verbatim_sums[-1], recent_budget)
    if masked_sums[recent] < min_summarized_tokens:
        return too_little_to_summarize(
            f"{masked_sums[recent]} tokens (masked)", groups[recent - 1].end, min_summarized_tokens
        )
    tail = verbatim_sums[-1] - verbatim_sums[recent]
    for until in range(1, recent + 1):
        rest = summary_tokens + (masked_sums[recent] - masked_sums[until]) + tail
        # The trail is only sized where the rest leaves it a chance (it costs a walk of its entries).
        if masked_sums[until] < min_summarized_tokens or rest > room:
            continue
        if rest + (trail_tokens(until) if trail_tokens is not None else 0) <= room:
            return Compaction(SUMMARY, until, recent)
    return Compaction(SUMMARY, recent, recent, fits=False)


def plan_after_summary(
    groups: Sequence[MessageGroup],
    masked: Sequence[int] | None,
    room: int,
    *,
    covered: int,
    summary_tokens: int,
    recent_budget: int = RECENT_BUDGET_TOKENS,
) -> Compaction | None:
    """With a summary (``summary_tokens``, trail included) of the first ``covered`` groups already at
    hand, the plan that fits ``room`` — the later groups masked oldest first as far as needed, never
    one of the recent part — or None when even that does not fit. Masking off: the later groups
    verbatim, or None."""
    verbatim = [group.tokens for group in groups]
    verbatim_sums = list(accumulate(verbatim, initial=0))
    if masked is None:
        fits = summary_tokens + verbatim_sums[-1] - verbatim_sums[covered] <= room
        return Compaction(SUMMARY, covered, covered) if fits else None
    recent = recent_start(verbatim, recent_budget)
    masked_sums = list(accumulate(masked, initial=0))
    until = _least_masking(verbatim_sums, masked_sums, covered, recent, summary_tokens, room)
    return Compaction(SUMMARY, covered, until) if until is not None else None


def decide(snapshot: PreparedSnapshot, room: int, *, mask: bool) -> Compaction | CutRefusal:
    """THE compaction decision of a prepared snapshot whose messages must fit ``room`` tokens, with
    masking on or off (SPEC §11.2 ``mask_tool_results``), for a request, a job and a trigger alike."""
    return plan_compaction(
        snapshot.groups,
        snapshot.masked_tokens() if mask else None,
        room,
        summary_tokens=SUMMARY_RESERVE_TOKENS,
        trail_tokens=TrailSizes(snapshot.artifacts()) if mask else None,
        recent_budget=recent_budget_for(room),
    )


def snapshot_room(snapshot: PreparedSnapshot, capacity: int) -> int:
    """The room a question on ``snapshot`` leaves its messages before the question is known: the
    capacity (raw tokens) less the snapshot's system prompt and tools."""
    return capacity - snapshot.system_tokens - snapshot.tools_tokens


def recent_budget_for(room: int) -> int:
    """The recent part's budget when ``room`` tokens are left for the transcript and a summary at its
    largest may have to stand beside it."""
    return recent_budget_within(room - SUMMARY_MAX_TOKENS)


def needs_summary(snapshot: PreparedSnapshot, room: int, *, mask: bool) -> bool:
    """Would a request whose transcript has ``room`` tokens need a summary (tier 2)? A refusal (no
    summary could help) needs none either: nothing would be made."""
    decision = decide(snapshot, room, mask=mask)
    return isinstance(decision, Compaction) and decision.tier == SUMMARY
