"""Replay window and fold plan for the side Q&A history (SPEC §6.1 organizing_history)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Final

# The replay window is at most REPLAY_MAX_GROUPS of the newest Q&A groups, whose estimate stays within
# min(input budget / REPLAY_BUDGET_DIVISOR, REPLAY_MAX_TOKENS); earlier Q&A is loaded and folded into
# the rolling summary in batches of HISTORY_BATCH_SIZE (SPEC §6.1). Why: docs/budget.md "The numbers".
REPLAY_MAX_GROUPS: Final = 20
REPLAY_BUDGET_DIVISOR: Final = 4
REPLAY_MAX_TOKENS: Final = 16_000
HISTORY_BATCH_SIZE: Final = 20


# slots: a plan makes one per side Q&A group (thousands in a long session); slotted ones are quicker.
@dataclass(frozen=True, slots=True)
class QAItem:
    """One successful side Q&A group: its ordinal and estimated tokens as it would be replayed."""

    ordinal: int
    tokens: int


@dataclass(frozen=True)
class ReplayPlan:
    """Which Q&A groups (ascending ordinals) are replayed verbatim and which folded into the rolling
    summary, in ``fold_batches``; ``replay_tokens`` is the replay's estimate, ``replay_limit`` its limit."""

    replay: tuple[int, ...]
    fold: tuple[int, ...]
    fold_batches: tuple[tuple[int, ...], ...]
    replay_tokens: int = 0
    replay_limit: int = 0

    @property
    def replayed_ordinals(self) -> tuple[int, int] | None:
        """``(first, last)`` replayed ordinal, or None (SPEC ``context_info.replayed_ordinals``)."""
        return (self.replay[0], self.replay[-1]) if self.replay else None


def replay_token_limit(input_budget: int, max_tokens: int = REPLAY_MAX_TOKENS) -> int:
    """``min(input_budget // 4, max_tokens)``, never below 0 (floor: a budget share rounds down)."""
    return max(0, min(input_budget // REPLAY_BUDGET_DIVISOR, max_tokens))


def select_replay(
    items: Sequence[QAItem],
    covered_through_ordinal: int | None,
    input_budget: int,
    max_groups: int = REPLAY_MAX_GROUPS,
    max_tokens: int = REPLAY_MAX_TOKENS,
    batch_size: int = HISTORY_BATCH_SIZE,
) -> ReplayPlan:
    """Choose the verbatim replay window (the newest uncovered run of ``items`` within ``max_groups``
    and :func:`replay_token_limit`, without holes) and fold every older uncovered item, in batches
    (docs/budget.md "Replay"). ``max_groups=0`` replays nothing and folds every uncovered item."""
    if max_groups < 0:
        raise ValueError("max_groups must be >= 0")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if any(before.ordinal >= after.ordinal for before, after in pairwise(items)):
        raise ValueError("items must be in strictly ascending ordinal")
    if any(item.tokens < 0 for item in items):
        raise ValueError("item tokens must be >= 0")

    uncovered = [
        item for item in items if covered_through_ordinal is None or item.ordinal > covered_through_ordinal
    ]
    limit = replay_token_limit(input_budget, max_tokens)
    replay_count = 0
    replay_tokens = 0
    for item in reversed(uncovered):
        if replay_count >= max_groups or replay_tokens + item.tokens > limit:
            break
        replay_count += 1
        replay_tokens += item.tokens
    split = len(uncovered) - replay_count
    fold = tuple(item.ordinal for item in uncovered[:split])
    replay = tuple(item.ordinal for item in uncovered[split:])
    fold_batches = tuple(fold[start : start + batch_size] for start in range(0, len(fold), batch_size))
    return ReplayPlan(replay, fold, fold_batches, replay_tokens, limit)
