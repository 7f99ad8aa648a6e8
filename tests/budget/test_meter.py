"""Segment meter, pressure thresholds and drift (SPEC §5, context_info)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from service.budget import (
    SegmentEstimate,
    pressure,
    prompt_drift,
)

KEYS = ["system", "tools", "context", "qa_summary", "qa_raw", "question", "envelope", "total"]


def test_as_dict_has_the_spec_keys_and_total() -> None:
    estimate = SegmentEstimate(system=1, tools=2, context=3, qa_summary=4, qa_raw=5, question=6, envelope=7)
    assert list(estimate.as_dict()) == KEYS
    assert estimate.total == 28 == estimate.as_dict()["total"]


def test_pressure_thresholds_are_entered_on_reaching_them() -> None:
    assert pressure(0, 1000) == "normal"
    assert pressure(749, 1000) == "normal"
    assert pressure(750, 1000) == "tight"
    assert pressure(899, 1000) == "tight"
    assert pressure(900, 1000) == "critical"
    assert pressure(5000, 1000) == "critical"


def test_pressure_uses_exact_integer_edges() -> None:
    # 75 % of 10 is 7.5: 7 is below, 8 reaches it. 90 % of 10 is 9.
    assert pressure(7, 10) == "normal"
    assert pressure(8, 10) == "tight"
    assert pressure(9, 10) == "critical"
    # 75 % of 183616 = 137712 exactly; 90 % = 165254.4.
    assert pressure(137_711, 183_616) == "normal"
    assert pressure(137_712, 183_616) == "tight"
    assert pressure(165_254, 183_616) == "tight"
    assert pressure(165_255, 183_616) == "critical"


def test_unknown_or_non_positive_budget_is_critical() -> None:
    assert pressure(0, None) == "critical"
    assert pressure(0, 0) == "critical"
    assert pressure(0, -410) == "critical"


@given(st.integers(0, 10**7), st.integers(1, 10**7))
@settings(max_examples=80)
def test_pressure_matches_fractions(total: int, budget: int) -> None:
    share = total / budget
    result = pressure(total, budget)
    if total * 100 >= budget * 90:
        assert result == "critical" and share >= 0.9 - 1e-9
    elif total * 100 >= budget * 75:
        assert result == "tight" and 0.75 - 1e-9 <= share < 0.9
    else:
        assert result == "normal" and share < 0.75


def test_drift_is_reported_beside_not_instead_of_the_estimate() -> None:
    estimate = SegmentEstimate(context=1000)
    assert prompt_drift(estimate.total, 1100) == 100
    assert prompt_drift(estimate.total, 900) == -100
    assert prompt_drift(estimate.total, None) is None
    assert prompt_drift(estimate.total, 0) is None
    assert estimate.context == 1000
