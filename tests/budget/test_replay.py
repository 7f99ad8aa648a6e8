"""Replay window and fold plan (SPEC §6.1): ≤ 20 newest groups, ≤ min(budget / 4, 16000) tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.budget import QAItem, select_replay
from service.budget.replay import replay_token_limit

BIG_BUDGET = 1_000_000  # budget / 4 is far above 16000


def items(count: int, tokens: int = 100, first: int = 1) -> list[QAItem]:
    return [QAItem(ordinal, tokens) for ordinal in range(first, first + count)]


@pytest.mark.parametrize(
    ("count", "replayed", "folded"),
    [
        (19, range(1, 20), ()),
        (20, range(1, 21), ()),
        (21, range(2, 22), (1,)),
        (50, range(31, 51), range(1, 31)),
    ],
)
def test_at_most_twenty_newest_groups_are_replayed(count: int, replayed: range, folded: range) -> None:
    plan = select_replay(items(count), None, BIG_BUDGET)
    assert plan.replay == tuple(replayed)
    assert plan.fold == tuple(folded)
    assert plan.replayed_ordinals == ((replayed[0], replayed[-1]) if replayed else None)


def test_fifty_groups_fold_in_batches_of_twenty() -> None:
    plan = select_replay(items(50), None, BIG_BUDGET)
    assert plan.fold_batches == (tuple(range(1, 21)), tuple(range(21, 31)))


def test_replay_of_exactly_16000_tokens_fits() -> None:
    plan = select_replay(items(16, tokens=1000), None, BIG_BUDGET)
    assert plan.replay == tuple(range(1, 17))
    assert plan.replay_tokens == 16_000 == plan.replay_limit


def test_one_token_over_16000_folds_the_oldest() -> None:
    history = [QAItem(1, 1), *items(16, tokens=1000, first=2)]
    plan = select_replay(history, None, BIG_BUDGET)
    assert plan.replay == tuple(range(2, 18))
    assert plan.fold == (1,)


def test_quarter_of_the_budget_limits_small_windows() -> None:
    assert replay_token_limit(64_000) == 16_000
    assert replay_token_limit(64_003) == 16_000
    assert replay_token_limit(40_000) == 10_000
    assert replay_token_limit(40_003) == 10_000  # floor
    assert replay_token_limit(-410) == 0
    plan = select_replay(items(20, tokens=1000), None, 40_000)
    assert plan.replay == tuple(range(11, 21))
    assert plan.fold == tuple(range(1, 11))


def test_newest_group_too_large_replays_nothing() -> None:
    plan = select_replay([QAItem(1, 10), QAItem(2, 20_000)], None, BIG_BUDGET)
    assert plan.replay == ()
    assert plan.fold == (1, 2)
    assert plan.replayed_ordinals is None


def test_window_is_contiguous_even_if_an_older_small_group_would_fit() -> None:
    history = [QAItem(1, 10), QAItem(2, 15_000), QAItem(3, 1_500)]
    plan = select_replay(history, None, BIG_BUDGET)
    assert plan.replay == (3,)
    assert plan.fold == (1, 2)


def test_covered_groups_are_neither_replayed_nor_folded() -> None:
    plan = select_replay(items(50), 30, BIG_BUDGET)
    assert plan.replay == tuple(range(31, 51))
    assert plan.fold == ()
    plan = select_replay(items(50), 45, BIG_BUDGET)
    assert plan.replay == tuple(range(46, 51))
    assert plan.fold == ()


def test_ordinal_gaps_do_not_break_contiguity() -> None:
    history = [QAItem(ordinal, 100) for ordinal in (2, 5, 9, 10)]
    plan = select_replay(history, 4, BIG_BUDGET, max_groups=2)
    assert plan.replay == (9, 10)
    assert plan.fold == (5,)


def test_max_groups_zero_forces_everything_uncovered_into_the_fold() -> None:
    plan = select_replay(items(45), 10, BIG_BUDGET, max_groups=0)
    assert plan.replay == ()
    assert plan.fold == tuple(range(11, 46))
    assert plan.fold_batches == (tuple(range(11, 31)), tuple(range(31, 46)))


def test_empty_history() -> None:
    plan = select_replay([], None, BIG_BUDGET)
    assert (plan.replay, plan.fold, plan.fold_batches) == ((), (), ())


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        select_replay([QAItem(2, 1), QAItem(1, 1)], None, BIG_BUDGET)
    with pytest.raises(ValueError):
        select_replay([QAItem(1, -1)], None, BIG_BUDGET)
    with pytest.raises(ValueError):
        select_replay(items(3), None, BIG_BUDGET, max_groups=-1)
    with pytest.raises(ValueError):
        select_replay(items(3), None, BIG_BUDGET, batch_size=0)


@st.composite
def histories(draw: st.DrawFn) -> list[QAItem]:
    gaps = draw(st.lists(st.integers(1, 3), max_size=80))
    ordinal = 0
    result = []
    for gap in gaps:
        ordinal += gap
        result.append(QAItem(ordinal, draw(st.integers(0, 5000))))
    return result


@given(
    histories(),
    st.one_of(st.none(), st.integers(0, 200)),
    st.integers(-10_000, 300_000),
    st.integers(0, 30),
    st.integers(1, 25),
)
@settings(max_examples=120)
def test_replay_fold_and_covered_partition_the_history(
    history: list[QAItem], covered: int | None, budget: int, max_groups: int, batch_size: int
) -> None:
    plan = select_replay(history, covered, budget, max_groups=max_groups, batch_size=batch_size)
    ordinals = [item.ordinal for item in history]
    covered_part = [o for o in ordinals if covered is not None and o <= covered]
    # Partition: covered, then fold, then replay, in ascending order, nothing lost or repeated.
    assert covered_part + list(plan.fold) + list(plan.replay) == ordinals
    assert tuple(o for batch in plan.fold_batches for o in batch) == plan.fold
    assert all(1 <= len(batch) <= batch_size for batch in plan.fold_batches)
    # Limits hold.
    tokens = {item.ordinal: item.tokens for item in history}
    limit = min(max(budget, 0) // 4, 16_000)
    assert len(plan.replay) <= max_groups
    assert plan.replay_tokens == sum(tokens[o] for o in plan.replay) <= limit
    # Maximal: the next older uncovered group would break a limit.
    if plan.fold:
        nearest = plan.fold[-1]
        assert len(plan.replay) == max_groups or plan.replay_tokens + tokens[nearest] > limit
