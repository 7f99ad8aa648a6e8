"""Cut planning for the snapshot copy (SPEC §6.2): whole groups, 8000 recent tokens, named refusals."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.budget import (
    RECENT_BUDGET_TOKENS,
    CutPlan,
    CutRefusal,
    MessageGroup,
    group_messages,
    plan_cut,
    recent_budget_within,
)
from service.budget.cut import (
    ALL_FIT_RECENT,
    CUT_REFUSAL_REASONS,
    NOTHING_TO_SUMMARIZE,
    TOO_LITTLE_TO_SUMMARIZE,
)
from service.budget.messages import normalize_snapshot, tool_result_ids, tool_use_ids

from .strategies import transcripts


def groups_of(*tokens: int, sizes: list[int] | None = None) -> list[MessageGroup]:
    """Groups with the given token counts; ``sizes`` gives messages per group (default 1)."""
    result = []
    start = 0
    for index, count in enumerate(tokens):
        size = sizes[index] if sizes else 1
        result.append(MessageGroup(start, start + size, count, size > 1))
        start += size
    return result


def test_recent_budget_default_is_8000() -> None:
    assert RECENT_BUDGET_TOKENS == 8000


def test_keeps_newest_whole_groups_within_8000() -> None:
    plan = plan_cut(groups_of(5000, 4000, 3000, 2000))
    assert isinstance(plan, CutPlan)
    assert plan.summarize_until == 2
    assert (plan.summarized_groups, plan.kept_groups) == (2, 2)
    assert plan.kept_messages == 2
    assert plan.kept_tokens == 5000
    assert plan.gross_removed_tokens == 9000


def test_kept_part_may_reach_8000_exactly_but_not_8001() -> None:
    exact = plan_cut(groups_of(4000, 5000, 3000))
    assert isinstance(exact, CutPlan) and exact.kept_tokens == 8000 and exact.summarize_until == 1
    over = plan_cut(groups_of(4000, 5001, 3000))
    assert isinstance(over, CutPlan) and over.kept_tokens == 3000 and over.summarize_until == 2


def test_counting_stops_at_the_first_group_that_does_not_fit() -> None:
    # 7000 + 2000 > 8000: the 2000 group is summarised, and so is the small one before it.
    plan = plan_cut(groups_of(3000, 10, 2000, 7000))
    assert isinstance(plan, CutPlan)
    assert plan.summarize_until == 3
    assert plan.kept_groups == 1


def test_single_newest_group_too_large_goes_whole_into_the_summary() -> None:
    plan = plan_cut(groups_of(3000, 9000, sizes=[1, 3]))
    assert isinstance(plan, CutPlan)
    assert plan.summarize_until == 4
    assert (plan.kept_groups, plan.kept_messages, plan.kept_tokens) == (0, 0, 0)
    assert plan.gross_removed_tokens == 12_000


def test_cut_falls_between_groups_of_several_messages() -> None:
    plan = plan_cut(groups_of(3000, 6000, 4000, sizes=[2, 3, 2]))
    assert isinstance(plan, CutPlan)
    assert plan.summarize_until == 5
    assert plan.kept_messages == 2


def test_net_removed_tokens_subtracts_the_summary() -> None:
    plan = plan_cut(groups_of(5000, 4000, 3000, 2000))
    assert isinstance(plan, CutPlan)
    assert plan.net_removed_tokens(600) == 8400
    assert plan.net_removed_tokens(10_000) == -1000


def test_no_messages_is_nothing_to_summarize() -> None:
    refusal = plan_cut([])
    assert isinstance(refusal, CutRefusal)
    assert refusal.reason == NOTHING_TO_SUMMARIZE
    assert refusal.explanation


def test_everything_fitting_the_recent_budget_is_all_fit_recent() -> None:
    refusal = plan_cut(groups_of(3000, 5000))
    assert isinstance(refusal, CutRefusal)
    assert refusal.reason == ALL_FIT_RECENT
    assert "8000" in refusal.explanation


def test_too_little_old_material_is_refused_and_can_be_forced() -> None:
    refusal = plan_cut(groups_of(2047, 8000))
    assert isinstance(refusal, CutRefusal)
    assert refusal.reason == TOO_LITTLE_TO_SUMMARIZE
    assert isinstance(plan_cut(groups_of(2048, 8000)), CutPlan)
    forced = plan_cut(groups_of(100, 8000), min_summarized_tokens=0)
    assert isinstance(forced, CutPlan) and forced.summarize_until == 1


def test_smaller_recent_budget_compacts_harder() -> None:
    groups = groups_of(3000, 3000, 2000)
    assert isinstance(plan_cut(groups), CutRefusal)
    harder = plan_cut(groups, recent_budget=0)
    assert isinstance(harder, CutPlan) and harder.summarize_until == 3


def test_refusal_reasons_are_distinct() -> None:
    assert len(CUT_REFUSAL_REASONS) == 3
    assert {NOTHING_TO_SUMMARIZE, ALL_FIT_RECENT, TOO_LITTLE_TO_SUMMARIZE} == CUT_REFUSAL_REASONS


def test_groups_that_do_not_tile_the_messages_are_refused() -> None:
    with pytest.raises(ValueError):
        plan_cut([MessageGroup(1, 2, 10, False)])
    with pytest.raises(ValueError):
        plan_cut([MessageGroup(0, 1, 10, False), MessageGroup(2, 3, 10, False)])


def _side_of_each_id(messages: list[dict[str, Any]], cut: int, ids_of: Any) -> dict[str, set[bool]]:
    sides: dict[str, set[bool]] = {}
    for index, message in enumerate(messages):
        for tool_id in ids_of(message):
            sides.setdefault(tool_id, set()).add(index < cut)
    return sides


@given(
    st.booleans().flatmap(lambda openai: transcripts(well_formed=True, openai_style=openai)),
    st.integers(0, 1000),
)
@settings(max_examples=120)
def test_a_cut_never_separates_a_tool_call_from_its_result(
    messages: list[dict[str, Any]], recent: int
) -> None:
    normalized = normalize_snapshot({"messages": messages}).messages
    groups = group_messages(normalized)
    plan = plan_cut(groups, recent_budget=recent, min_summarized_tokens=0)
    if isinstance(plan, CutRefusal):
        assert plan.reason in (NOTHING_TO_SUMMARIZE, ALL_FIT_RECENT)
        return
    cut = plan.summarize_until
    assert cut in {g.start for g in groups} | {len(normalized)}
    calls = _side_of_each_id(normalized, cut, tool_use_ids)
    results = _side_of_each_id(normalized, cut, tool_result_ids)
    for tool_id, call_side in calls.items():
        assert results[tool_id] == call_side  # all results on the same side as their call
    # Summarised + kept is the whole transcript; kept is the maximal fitting tail.
    assert plan.summarize_until + plan.kept_messages == len(normalized)
    assert plan.gross_removed_tokens + plan.kept_tokens == sum(g.tokens for g in groups)
    assert plan.kept_tokens <= recent
    assert plan.kept_tokens + groups[plan.summarized_groups - 1].tokens > recent


@given(transcripts(well_formed=False), st.integers(0, 3000))
@settings(max_examples=60)
def test_broken_transcripts_never_crash_the_planner(messages: list[dict[str, Any]], recent: int) -> None:
    groups = group_messages(messages)
    plan = plan_cut(groups, recent_budget=recent)
    if isinstance(plan, CutPlan):
        assert plan.summarize_until in {g.end for g in groups}
    else:
        assert plan.reason in CUT_REFUSAL_REASONS


def test_the_recent_tail_is_held_to_the_room_the_budget_leaves() -> None:
    assert recent_budget_within(50_000) == RECENT_BUDGET_TOKENS  # "up to 8000"
    assert recent_budget_within(4748) == 4748
    assert recent_budget_within(0) == 0
    assert recent_budget_within(-300) == 0  # nothing fits: keep nothing, summarise everything
