"""Window, output cap, safety margin and input budget (SPEC §3, §5)."""

from __future__ import annotations

from dataclasses import asdict

from hypothesis import given, settings
from hypothesis import strategies as st

from service.budget import plan_window, resolve_output_cap, resolve_window, safety_margin
from service.budget.window import DEFAULT_WINDOW


def test_window_precedence_request_snapshot_config_default() -> None:
    assert resolve_window(100_000, 150_000, 120_000) == 100_000
    assert resolve_window(None, 150_000, 120_000) == 150_000
    assert resolve_window(None, None, 120_000) == 120_000
    assert resolve_window(None, None, None) == DEFAULT_WINDOW == 200_000


def test_non_positive_window_counts_as_not_given() -> None:
    assert resolve_window(0, -5, None) == 200_000


def test_output_cap_request_then_config_never_above_main_cap() -> None:
    assert resolve_output_cap(None, 8192, None) == 8192
    assert resolve_output_cap(4096, 8192, None) == 4096
    assert resolve_output_cap(32768, 8192, None) == 32768
    assert resolve_output_cap(32768, 8192, 32000) == 32000
    assert resolve_output_cap(None, 8192, 4000) == 4000
    assert resolve_output_cap(256, 8192, 4000) == 256


def test_safety_margin_is_five_percent_rounded_up() -> None:
    assert safety_margin(100_000) == 5000
    assert safety_margin(8192) == 410  # 409.6 rounded up
    assert safety_margin(20_001) == 1001  # 1000.05 rounded up


def test_safety_margin_floor_of_128() -> None:
    assert safety_margin(2000) == 128  # 5 % = 100, below the floor
    assert safety_margin(2540) == 128  # 127
    assert safety_margin(2560) == 128  # exactly 128
    assert safety_margin(2580) == 129  # 129, above the floor
    assert safety_margin(0) == 128


def test_safety_margin_ceiling_of_8192() -> None:
    assert safety_margin(163_820) == 8191
    assert safety_margin(163_840) == 8192  # exactly 8192
    assert safety_margin(163_860) == 8192  # 8193, above the ceiling
    assert safety_margin(200_000) == 8192  # 10000, above the ceiling
    assert safety_margin(1_000_000) == 8192


def test_default_plan() -> None:
    plan = plan_window(200_000, 8192)
    assert plan.input_budget == 200_000 - 8192 - 8192 == 183_616
    assert asdict(plan) == {
        "window": 200_000,
        "max_output_tokens": 8192,
        "safety_margin": 8192,
        "input_budget": 183_616,
    }


def test_window_8192_with_output_8192_gives_a_negative_budget_not_an_exception() -> None:
    plan = plan_window(8192, 8192)
    assert plan.safety_margin == 410
    assert plan.input_budget == -410


@given(st.integers(0, 10_000_000), st.integers(0, 40_000))
@settings(max_examples=60)
def test_budget_is_window_minus_output_minus_clamped_margin(window: int, output: int) -> None:
    plan = plan_window(window, output)
    assert 128 <= plan.safety_margin <= 8192
    assert plan.safety_margin >= min(8192, window * 5 / 100)
    assert plan.input_budget == window - output - plan.safety_margin


def test_a_window_or_cap_from_json_is_a_positive_integer_an_integral_float_too() -> None:
    from service.budget.messages import normalize_snapshot
    from service.budget.window import positive_setting

    assert positive_setting(5000) == 5000 and positive_setting(5000.0) == 5000
    for not_one in (0, -3, 5000.5, "5000", True, None, float("inf")):
        assert positive_setting(not_one) is None, not_one
    # A snapshot's own fields follow the same rule (JSON counts 64000.0 as an integer).
    snapshot = normalize_snapshot({"messages": [], "context_window": 64000.0, "max_output_tokens": 700})
    assert (snapshot.context_window, snapshot.max_output_tokens) == (64000, 700)


def test_summary_caps_are_the_specs_unless_the_window_cannot_hold_them() -> None:
    from service.budget.chunk import (
        FIRST_OUTPUT_TOKENS,
        MIN_SUMMARY_MATERIAL,
        RETRY_OUTPUT_TOKENS,
        summary_capacity,
        summary_output_caps,
    )

    assert summary_output_caps(200_000, 900, 8192) == (FIRST_OUTPUT_TOKENS, RETRY_OUTPUT_TOKENS)
    assert summary_output_caps(12_000, 900, 600) == (FIRST_OUTPUT_TOKENS, RETRY_OUTPUT_TOKENS)
    first, retry = summary_output_caps(8000, 900, 400)
    assert retry == (8000 - 400 - 900) // 2 and first == FIRST_OUTPUT_TOKENS  # 3350: room for both
    assert summary_capacity(8000, 900, 400, retry) >= MIN_SUMMARY_MATERIAL
    first, retry = summary_output_caps(4096, 900, 205)
    assert first == retry == (4096 - 205 - 900) // 2  # the first attempt never reserves more than the retry
    assert summary_capacity(4096, 900, 205, retry) > 0
