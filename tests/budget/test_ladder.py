"""The compaction ladder's one decision (SPEC §6.2): fits, masks the fewest oldest groups, or summarises
the fewest oldest groups; masking off is the plain summarising cut."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from service.budget import CutRefusal, MessageGroup, plan_cut
from service.budget.cut import ALL_FIT_RECENT, TOO_LITTLE_TO_SUMMARIZE, recent_start
from service.budget.ladder import Compaction, plan_after_summary, plan_compaction
from service.budget.masking import Artifact
from service.budget.trail import TrailSizes, bound_trail, collect_trail, trail_tokens


def groups_of(tokens: list[int]) -> list[MessageGroup]:
    return [MessageGroup(i, i + 1, t, False, 0, 0) for i, t in enumerate(tokens)]


def test_a_transcript_that_fits_is_left_alone() -> None:
    assert plan_compaction(groups_of([100, 100]), [10, 10], 200, summary_tokens=50) == Compaction(
        "none", 0, 0
    )


def test_masking_stops_at_the_fewest_oldest_groups_that_make_it_fit() -> None:
    groups = groups_of([1000] * 10)
    plan = plan_compaction(groups, [100] * 10, 7000, summary_tokens=500, recent_budget=2000)
    # 10 000 tokens; each masked group saves 900: four make 6400 ≤ 7000, three would be 7300.
    assert plan == Compaction("masked", 0, 4)


def test_the_recent_part_is_never_masked() -> None:
    groups = groups_of([1000] * 10)
    # Even masking the 8 groups before the recent 2000 tokens leaves 2800 > 2500: tier 2.
    plan = plan_compaction(
        groups, [100] * 10, 2500, summary_tokens=100, recent_budget=2000, min_summarized_tokens=0
    )
    assert isinstance(plan, Compaction) and plan.tier == "summary" and plan.mask_until == 8
    # The fewest summarised groups: 100 (summary) + masked [s:8] + 2000 ≤ 2500 → s = 4.
    assert plan.summarize_until == 4 and plan.fits


def test_the_trail_of_the_summarised_groups_is_counted_exactly() -> None:
    groups = groups_of([1000] * 10)
    plan = plan_compaction(
        groups,
        [100] * 10,
        2500,
        summary_tokens=100,
        trail_tokens=lambda s: 50 * s,
        recent_budget=2000,
        min_summarized_tokens=0,
    )
    # 100 + 50·s + 100·(8 − s) + 2000 ≤ 2500 → s ≥ 8 (without the trail, s = 4 would do).
    assert isinstance(plan, Compaction) and plan.summarize_until == 8


def test_masking_off_cuts_as_before_masking() -> None:
    groups = groups_of([3000] * 10)
    plan = plan_compaction(groups, None, 12000, summary_tokens=2400, recent_budget=8000)
    cut = plan_cut(groups, 8000)
    assert not isinstance(cut, CutRefusal)
    assert plan == Compaction("summary", cut.summarized_groups, cut.summarized_groups, True)
    refused = plan_compaction(groups_of([3000, 3000]), None, 5000, summary_tokens=2400, recent_budget=8000)
    assert isinstance(refused, CutRefusal) and refused.reason == ALL_FIT_RECENT


def test_a_summary_of_too_little_is_refused() -> None:
    plan = plan_compaction(groups_of([100] * 5 + [8000]), [10] * 5 + [8000], 8040, summary_tokens=2400)
    assert isinstance(plan, CutRefusal) and plan.reason == TOO_LITTLE_TO_SUMMARIZE


def test_a_recent_part_left_empty_still_refuses_too_little_by_its_message_count() -> None:
    # The newest group alone is beyond a recent budget of 0 (a small window's): every group is old.
    plan = plan_compaction(groups_of([300, 300]), [300, 300], 500, summary_tokens=100, recent_budget=0)
    assert isinstance(plan, CutRefusal) and plan.reason == TOO_LITTLE_TO_SUMMARIZE
    assert "in 2 old messages" in plan.explanation


def test_after_a_cached_summary_the_later_groups_are_masked_as_needed() -> None:
    groups = groups_of([1000] * 10)
    plan = plan_after_summary(groups, [100] * 10, 5000, covered=3, summary_tokens=500, recent_budget=2000)
    # 500 + masked [3:k] + verbatim [k:10] ≤ 5000 → k = 6 (500 + 300 + 4000 = 4800).
    assert plan == Compaction("summary", 3, 6)
    assert (
        plan_after_summary(groups, [100] * 10, 2000, covered=3, summary_tokens=500, recent_budget=2000)
        is None
    )


@given(
    st.lists(st.integers(min_value=0, max_value=5000), max_size=40), st.integers(min_value=0, max_value=9000)
)
def test_the_recent_part_is_the_newest_groups_within_its_budget(tokens: list[int], budget: int) -> None:
    start = recent_start(tokens, budget)
    assert sum(tokens[start:]) <= budget
    assert start == 0 or sum(tokens[start - 1 :]) > budget


@given(
    st.lists(
        st.lists(
            st.tuples(st.sampled_from(["Read", "Bash"]), st.text(min_size=1, max_size=90), st.booleans()),
            max_size=4,
        ),
        max_size=40,
    )
)
def test_trail_sizes_are_the_rendered_trails(groups: list[list[tuple[str, str, bool]]]) -> None:
    artifacts = [[(Artifact(tool, text), error) for tool, text, error in found] for found in groups]
    sizes = TrailSizes(artifacts)
    for s in range(len(artifacts) + 1):
        expected = trail_tokens(bound_trail(collect_trail(use for found in artifacts[:s] for use in found)))
        assert sizes(s) == expected


@given(
    st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 5000)), max_size=12),
    st.integers(0, 20000),
    st.integers(0, 9000),
)
def test_every_transcript_gets_a_plan_or_a_refusal(
    sizes: list[tuple[int, int]], room: int, recent_budget: int
) -> None:
    groups = groups_of([verbatim for verbatim, _ in sizes])
    masked = [min(verbatim, masked) for verbatim, masked in sizes]
    for mask in (masked, None):
        plan = plan_compaction(groups, mask, room, summary_tokens=100, recent_budget=recent_budget)
        assert isinstance(plan, Compaction | CutRefusal)
        if isinstance(plan, Compaction):
            assert 0 <= plan.summarize_until <= plan.mask_until <= len(groups)
