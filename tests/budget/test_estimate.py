"""Estimator: ceil(UTF-8 bytes / 3) per block, envelopes, system, tools and calibration (SPEC §5)."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from service.budget import (
    Calibration,
    estimate_message,
    estimate_messages,
    estimate_system,
    estimate_text,
    estimate_tools,
    overflow_target,
)
from service.budget.estimate import MESSAGE_ENVELOPE_TOKENS, estimate_content
from service.budget.messages import normalize_snapshot

from .strategies import mixed_text


def test_empty_text_is_zero_tokens() -> None:
    assert estimate_text("") == 0


def test_bytes_over_four_times_four_thirds_rounds_up() -> None:
    # 1..3 bytes → 1 token, 4 bytes → 2 tokens: bytes / 4 × 4/3 = bytes / 3, rounded up.
    assert [estimate_text("a" * n) for n in range(1, 8)] == [1, 1, 1, 2, 2, 2, 3]
    assert estimate_text("a" * 3000) == 1000


def test_utf8_bytes_count_not_characters() -> None:
    assert estimate_text("中") == 1  # 3 bytes
    assert estimate_text("中文") == 2  # 6 bytes
    assert estimate_text("😀") == 2  # 4 bytes
    assert estimate_text("e\u0301") == 1  # 1 + 2 bytes


def test_json_escaping_does_not_inflate_estimates() -> None:
    """The request JSON's size is not a token count: 中 is 6 escaped characters but 3 bytes."""
    text = "中文" * 100
    assert len(json.dumps(text)) > 6 * 200
    assert estimate_content(text) == 200


@given(mixed_text)
@settings(max_examples=80)
def test_estimate_is_ceil_of_utf8_bytes_over_three(text: str) -> None:
    assert estimate_text(text) == math.ceil(len(text.encode("utf-8")) / 3)


def test_blocks_are_estimated_one_by_one() -> None:
    content = [{"type": "text", "text": "a" * 4}, {"type": "text", "text": "b" * 4}]
    assert estimate_content(content) == 4  # 2 + 2, not ceil(8 / 3) = 3


def test_tool_use_counts_id_name_and_compact_json_input() -> None:
    block = {"type": "tool_use", "id": "t1", "name": "grep", "input": {"pattern": "中"}}
    expected_bytes = len("t1") + len("grep") + len('{"pattern":"中"}'.encode())
    assert estimate_content([block]) == math.ceil(expected_bytes / 3)


def test_tool_result_counts_id_and_nested_content() -> None:
    nested = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "x" * 9}]}
    flat = {"type": "tool_result", "tool_use_id": "t1", "content": "x" * 9}
    assert estimate_content([nested]) == estimate_content([flat]) == 1 + 3


def test_other_blocks_are_estimated_from_their_json() -> None:
    block = {"type": "thinking", "thinking": "hmm", "signature": "abc"}
    compact = json.dumps(block, separators=(",", ":"))
    assert estimate_content([block]) == math.ceil(len(compact) / 3)


def test_message_adds_envelope() -> None:
    message = {"role": "user", "content": "a" * 30}
    assert estimate_message(message) == 10 + MESSAGE_ENVELOPE_TOKENS
    assert estimate_messages([message, message]) == 2 * (10 + MESSAGE_ENVELOPE_TOKENS)
    assert estimate_message({"role": "assistant", "content": None}) == MESSAGE_ENVELOPE_TOKENS


def test_unnormalised_openai_tool_calls_are_still_counted() -> None:
    raw = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "grep", "arguments": "{}"}}],
    }
    assert estimate_message(raw) > MESSAGE_ENVELOPE_TOKENS


def test_both_snapshot_styles_estimate_alike() -> None:
    openai: list[dict[str, Any]] = [
        {
            "role": "assistant",
            "content": "looking",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": '{"q": "x"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "found 中文"},
    ]
    anthropic: list[dict[str, Any]] = [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "looking"},
                {"type": "tool_use", "id": "c1", "name": "grep", "input": {"q": "x"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "found 中文"}]},
    ]
    assert estimate_messages(normalize_snapshot({"messages": openai}).messages) == estimate_messages(
        anthropic
    )


def test_system_and_tools() -> None:
    assert estimate_system(None) == 0
    assert estimate_system("") == 0
    assert estimate_system("a" * 7) == 3
    assert estimate_tools([]) == 0
    tools = [{"name": "grep", "description": "搜索", "input_schema": {"type": "object"}}]
    compact = json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
    assert estimate_tools(tools) == math.ceil(len(compact.encode()) / 3)


def test_unserialisable_input_does_not_crash() -> None:
    cyclic: list[object] = []
    cyclic.append(cyclic)
    assert estimate_content([{"type": "tool_use", "id": "t", "name": "n", "input": cyclic}]) > 0


def observed(pairs: list[tuple[int, int]]) -> Calibration:
    """The counters after these (estimate, provider prompt tokens) samples, as the store adds them."""
    return Calibration(len(pairs), sum(e for e, _ in pairs), sum(p for _, p in pairs))


def test_calibration_is_neutral_until_five_samples() -> None:
    calibration = observed([(1000, 1500)] * 4)
    assert calibration.ratio == 1.0
    assert calibration.apply(1000) == 1000
    calibration = observed([(1000, 1500)] * 5)
    assert calibration.ratio == 1.5
    assert calibration.apply(1001) == 1502  # 1501.5 rounded up


def test_calibration_ratio_is_clamped() -> None:
    high = observed([(100, 1000)] * 5)
    low = observed([(1000, 100)] * 5)
    assert high.ratio == 2.0
    assert high.apply(100) == 200
    assert low.ratio == 0.5
    assert low.apply(101) == 51


@given(st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 10**6)), max_size=20), st.integers(0, 10**6))
@settings(max_examples=60)
def test_calibrated_total_stays_within_clamp(pairs: list[tuple[int, int]], total: int) -> None:
    calibration = observed(pairs)
    assert 0.5 <= calibration.ratio <= 2.0
    assert math.ceil(total / 2) <= calibration.apply(total) <= 2 * total


def test_calibration_info_reports_ratio_samples_and_applied() -> None:
    calibration = Calibration.empty()
    assert calibration.info() == {"ratio": 1.0, "samples": 0, "applied": False}
    calibration = observed([(1000, 1500)] * 4)
    # Four samples: the ratio is not in use yet, whatever the counters say.
    assert calibration.info() == {"ratio": 1.0, "samples": 4, "applied": False}
    calibration = observed([(1000, 1500)] * 5)
    assert calibration.info() == {"ratio": 1.5, "samples": 5, "applied": True}
    exact = observed([(100, 100)] * 5)
    # In use but equal to 1: not "applied" (it changes nothing).
    assert exact.info() == {"ratio": 1.0, "samples": 5, "applied": False}


def test_raw_capacity_is_the_inverse_of_apply_rounded_down() -> None:
    calibration = observed([(1000, 1500)] * 5)
    assert calibration.raw_capacity(1500) == 1000
    assert calibration.raw_capacity(1501) == 1000
    assert calibration.raw_capacity(0) == 0
    assert Calibration.empty().raw_capacity(777) == 777


@given(
    st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 10**6)), max_size=12),
    st.integers(1, 10**7),
)
@settings(max_examples=80)
def test_raw_capacity_never_overfills(pairs: list[tuple[int, int]], capacity: int) -> None:
    calibration = observed(pairs)
    raw = calibration.raw_capacity(capacity)
    # What fits by the raw estimate fits by the calibrated one, and one token more would not.
    assert calibration.apply(raw) <= capacity
    assert calibration.apply(raw + 1) > capacity or calibration.ratio < 1


@given(st.integers(0, 10**6), st.integers(1, 10**6), st.integers(1, 10**6))
@settings(max_examples=80)
def test_overflow_target_fits_the_budget_at_the_reported_rate(budget: int, estimate: int, real: int) -> None:
    target = overflow_target(budget, estimate, real)
    assert 0 <= target
    # At the provider's rate (real / estimate tokens per estimated token) the target fits the budget.
    assert target * real <= budget * estimate
    assert (target + 1) * real > budget * estimate


def test_overflow_target_without_a_count_is_the_budget() -> None:
    assert overflow_target(1000, 800, 0) == 1000
    assert overflow_target(1000, 0, 1200) == 1000
    assert overflow_target(1000, 1000, 1500) == 666


def test_the_reported_ratio_never_reads_as_one_while_it_is_applied() -> None:
    # 34000 / 34001: in use and not 1, so applied; rounded to 4 places it would read 1.0.
    near = Calibration(samples=6, estimate_sum=34001, provider_sum=34000)
    info = near.info()
    assert info["applied"] is True and info["ratio"] != 1.0 and info["ratio"] == near.ratio
    exact = Calibration(samples=6, estimate_sum=34000, provider_sum=34000)
    assert exact.info() == {"ratio": 1.0, "samples": 6, "applied": False}
