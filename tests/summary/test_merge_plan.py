"""Merge planning (pure): grouping keeps every document once and in order, groups fit, rounds end, and
the rounds real documents need never take more merge calls than the plan reserved."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.summary.runner import can_merge, merge_calls_of, merge_groups, planned_merge_calls


@given(st.lists(st.integers(min_value=1, max_value=5000), max_size=40), st.integers(1, 12000))
def test_every_document_is_in_exactly_one_group_in_order_and_each_group_fits_or_is_alone(
    sizes: list[int], capacity: int
) -> None:
    groups = merge_groups(sizes, capacity)
    assert [i for group in groups for i in group] == list(range(len(sizes)))
    assert all(len(group) > 0 for group in groups)
    for group in groups:
        assert len(group) == 1 or sum(sizes[i] for i in group) <= capacity
    # Next-fit: a group ends only where the next document would not fit it.
    for group, following in itertools.pairwise(groups):
        assert sum(sizes[i] for i in group) + sizes[following.start] > capacity


def _real_rounds(sizes: list[int], capacity: int, merged_size: Callable[[], int]) -> int:
    """Merge calls the runner's rounds make; each merge's document has ``merged_size()`` tokens."""
    calls = 0
    while len(sizes) > 1:
        groups = merge_groups(sizes, capacity)
        assert merge_calls_of(groups) > 0  # every round makes progress
        calls += merge_calls_of(groups)
        sizes = [merged_size() if len(group) > 1 else sizes[group.start] for group in groups]
    return calls


@given(st.integers(min_value=100, max_value=2500), st.data())
def test_real_rounds_never_need_more_merge_calls_than_planned(worst: int, data: st.DataObject) -> None:
    capacity = data.draw(st.integers(min_value=2 * worst, max_value=12 * worst))
    count = data.draw(st.integers(min_value=2, max_value=40))
    sizes = data.draw(st.lists(st.integers(1, worst), min_size=count, max_size=count))
    planned = planned_merge_calls(count, worst, capacity)
    real = _real_rounds(sizes, capacity, lambda: data.draw(st.integers(1, worst)))
    assert real <= planned <= count - 1


def test_planned_merge_calls_counts_rounds() -> None:
    assert planned_merge_calls(1, 2200, 10_000) == 0
    assert planned_merge_calls(4, 2200, 10_000) == 1  # four fit one call
    assert planned_merge_calls(4, 2200, 4400) == 3  # pairs, then the pair of pairs
    assert planned_merge_calls(5, 2200, 4400) == 4  # (1 2) (3 4) 5 → (12 34) 5 → all
    assert planned_merge_calls(12, 2200, 6600) == 4 + 1 + 1  # threes → 4 → (3) + 1 → 2 → 1
    assert not can_merge(2200, 4399)
    with pytest.raises(ValueError, match="cannot take two"):
        planned_merge_calls(3, 2200, 4399)
