"""The per-request summary call cap, checked before each call and before a plan starts."""

from __future__ import annotations

import pytest

from service.summary.errors import SummaryCallCap
from service.summary.policy import SummaryCallBudget


def test_take_counts_until_the_cap_and_refuses_the_next_call() -> None:
    budget = SummaryCallBudget(12)
    for made in range(12):
        assert budget.remaining == 12 - made
        budget.take()
    assert budget.calls_made == 12 and budget.remaining == 0
    with pytest.raises(SummaryCallCap) as caught:
        budget.take()
    assert budget.calls_made == 12  # the refused call is not counted as made
    assert caught.value.code == "summary_call_cap"
    assert caught.value.detail == {"calls_made": 12, "calls_needed": 1, "max_calls": 12}


def test_a_plan_needing_more_calls_than_remain_fails_before_spending_any() -> None:
    budget = SummaryCallBudget(12)
    for _ in range(5):
        budget.take()
    budget.require(7)  # exactly what is left: fine
    with pytest.raises(SummaryCallCap) as caught:
        budget.require(8)
    assert caught.value.detail["calls_needed"] == 8
    assert caught.value.detail["calls_made"] == 5
    assert budget.calls_made == 5


def test_a_cap_of_zero_refuses_everything() -> None:
    budget = SummaryCallBudget(0)
    with pytest.raises(SummaryCallCap):
        budget.take()
    budget.require(0)
    with pytest.raises(ValueError):
        SummaryCallBudget(-1)


def test_a_reservation_holds_calls_for_its_plan_and_gives_back_the_rest() -> None:
    budget = SummaryCallBudget(10)
    with budget.reserve(4) as first:
        assert budget.remaining == 6 and budget.reserved == 4
        budget.take(first)
        assert (budget.calls_made, budget.reserved, budget.remaining, first.left) == (1, 3, 6, 3)
        # A second plan running beside it is checked against what no plan holds.
        with pytest.raises(SummaryCallCap) as caught:
            budget.reserve(7)
        assert caught.value.detail == {
            "calls_made": 1,
            "calls_needed": 7,
            "max_calls": 10,
            "calls_reserved": 3,
        }
        second = budget.reserve(6)
        assert budget.remaining == 0
        # A retry beyond the first plan's own calls may not eat into the second plan's.
        for _ in range(3):
            budget.take(first)
        with pytest.raises(SummaryCallCap) as beyond:
            budget.take(first)
        assert beyond.value.detail["calls_reserved"] == 6
        second.release()
    assert budget.reserved == 0 and budget.remaining == 6 and budget.calls_made == 4
    budget.take(first)  # released: an extra call now comes out of what is free
    assert budget.calls_made == 5 and budget.remaining == 5


def test_a_reservation_cannot_be_spent_in_another_budget() -> None:
    one, other = SummaryCallBudget(3), SummaryCallBudget(3)
    reservation = one.reserve(1)
    with pytest.raises(ValueError):
        other.take(reservation)
