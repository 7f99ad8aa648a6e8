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
