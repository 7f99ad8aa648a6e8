"""Normalisation of both snapshot styles and message groups (tool call + results = one group)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings

from service.budget import MessageGroup, estimate_message, group_messages, normalize_snapshot
from service.budget.estimate import POSTED_FORM, without_posted_form
from service.budget.messages import tool_result_ids, tool_use_ids

from .strategies import transcripts

ANTHROPIC: list[dict[str, Any]] = [
    {"role": "user", "content": "find the bug"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "searching"},
            {"type": "tool_use", "id": "t1", "name": "grep", "input": {"q": "bug"}},
            {"type": "tool_use", "id": "t2", "name": "grep", "input": {"q": "错误"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "a.py:3"},
            {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "b.py:9"}]},
        ],
    },
    {"role": "assistant", "content": "fixed"},
]

OPENAI: list[dict[str, Any]] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "find the bug"},
    {
        "role": "assistant",
        "content": "searching",
        "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "grep", "arguments": '{"q": "bug"}'}},
            {"id": "t2", "type": "function", "function": {"name": "grep", "arguments": '{"q": "错误"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "t1", "content": "a.py:3"},
    {"role": "tool", "tool_call_id": "t2", "content": [{"type": "text", "text": "b.py:9"}]},
    {"role": "assistant", "content": "fixed"},
]


def test_anthropic_messages_come_back_equal_and_untouched() -> None:
    original = copy.deepcopy(ANTHROPIC)
    assert normalize_snapshot({"messages": ANTHROPIC}).messages == original
    assert ANTHROPIC == original


def _canonical(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages or tools without the posted OpenAI form kept beside converted ones."""
    return [without_posted_form(item) for item in items]


def test_openai_messages_become_canonical() -> None:
    normalized = normalize_snapshot({"messages": OPENAI}).messages
    assert _canonical(normalized) == ANTHROPIC
    # What was converted keeps what was posted: the assistant's tool calls, the two tool messages.
    assert normalized[1][POSTED_FORM] == {"messages": [OPENAI[2]], "blocks": 3}
    assert normalized[2][POSTED_FORM] == {"messages": OPENAI[3:5], "blocks": 2}
    assert POSTED_FORM not in normalized[0] and POSTED_FORM not in normalized[3]


def test_consecutive_tool_messages_become_one_user_message() -> None:
    normalized = normalize_snapshot({"messages": OPENAI}).messages
    results = [message for message in normalized if tool_result_ids(message)]
    assert len(results) == 1
    assert tool_result_ids(results[0]) == ["t1", "t2"]


def test_openai_input_is_not_mutated() -> None:
    original = copy.deepcopy(OPENAI)
    normalize_snapshot({"messages": OPENAI})
    assert original == OPENAI


def test_invalid_or_non_object_arguments_are_kept_verbatim() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{not json"}},
            {"id": "b", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}},
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}},
        ],
    }
    blocks = normalize_snapshot({"messages": [message]}).messages[0]["content"]
    assert [block["input"] for block in blocks] == [{"_arguments": "{not json"}, {"_arguments": "[1, 2]"}, {}]


def test_snapshot_system_tools_and_numbers() -> None:
    snapshot: dict[str, Any] = {
        "system": "you are main",
        "tools": [
            {
                "type": "function",
                "function": {"name": "grep", "description": "search", "parameters": {"type": "object"}},
            },
            {"name": "read", "input_schema": {"type": "object"}},
        ],
        "messages": OPENAI,
        "context_window": 128000,
        "max_output_tokens": 32000,
    }
    normalized = normalize_snapshot(snapshot)
    assert normalized.system == "you are main\n\nbe brief"
    assert _canonical(normalized.tools) == [
        {"name": "grep", "description": "search", "input_schema": {"type": "object"}},
        {"name": "read", "input_schema": {"type": "object"}},
    ]
    assert normalized.tools[0][POSTED_FORM] == snapshot["tools"][0]
    assert _canonical(normalized.messages) == ANTHROPIC
    assert (normalized.context_window, normalized.max_output_tokens) == (128000, 32000)


def test_snapshot_without_system_or_numbers() -> None:
    normalized = normalize_snapshot({"messages": [], "context_window": True, "max_output_tokens": -1})
    assert normalized.system is None
    assert normalized.tools == []
    assert normalized.messages == []
    assert normalized.context_window is None
    assert normalized.max_output_tokens is None


def test_system_given_as_text_blocks() -> None:
    normalized = normalize_snapshot(
        {"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert normalized.system == "a\nb"


def test_tool_call_and_its_results_form_one_group() -> None:
    groups = group_messages(ANTHROPIC)
    assert [(g.start, g.end, g.has_tool_calls) for g in groups] == [
        (0, 1, False),
        (1, 3, True),
        (3, 4, False),
    ]
    assert groups[1].tokens == estimate_message(ANTHROPIC[1]) + estimate_message(ANTHROPIC[2])
    assert all(g.unanswered_calls == 0 and g.orphan_results == 0 for g in groups)


def test_results_spread_over_several_messages_stay_in_the_group() -> None:
    messages = [
        ANTHROPIC[1],
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "y"}]},
        {"role": "user", "content": "thanks"},
    ]
    assert [(g.start, g.end) for g in group_messages(messages)] == [(0, 3), (3, 4)]


def test_call_without_result_is_its_own_group() -> None:
    messages = [ANTHROPIC[1], {"role": "user", "content": "never mind"}]
    groups = group_messages(messages)
    assert [(g.start, g.end) for g in groups] == [(0, 1), (1, 2)]
    assert groups[0].unanswered_calls == 2


def test_partially_answered_call_keeps_its_answered_results() -> None:
    messages = [
        ANTHROPIC[1],
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]},
        {"role": "assistant", "content": "moving on"},
    ]
    groups = group_messages(messages)
    assert [(g.start, g.end, g.unanswered_calls) for g in groups] == [(0, 2, 1), (2, 3, 0)]


def test_orphan_result_is_its_own_group() -> None:
    orphan = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "gone", "content": "x"}]}
    groups = group_messages([{"role": "user", "content": "hi"}, orphan, ANTHROPIC[1], ANTHROPIC[2], orphan])
    assert [(g.start, g.end, g.orphan_results) for g in groups] == [
        (0, 1, 0),
        (1, 2, 1),
        (2, 4, 0),
        (4, 5, 1),
    ]


def test_precomputed_tokens_are_used_and_checked() -> None:
    groups = group_messages(ANTHROPIC, message_tokens=[1, 2, 3, 4])
    assert [g.tokens for g in groups] == [1, 5, 4]
    with pytest.raises(ValueError):
        group_messages(ANTHROPIC, message_tokens=[1])


def test_empty_transcript_has_no_groups() -> None:
    assert group_messages([]) == []


def test_non_object_message_is_refused() -> None:
    with pytest.raises(ValueError):
        normalize_snapshot({"messages": ["hello"]})


def _assert_partition(groups: list[MessageGroup], count: int) -> None:
    position = 0
    for group in groups:
        assert group.start == position < group.end
        position = group.end
    assert position == count


@given(transcripts(well_formed=False))
@settings(max_examples=60)
def test_groups_partition_any_transcript(messages: list[dict[str, Any]]) -> None:
    groups = group_messages(messages)
    _assert_partition(groups, len(messages))
    assert sum(g.tokens for g in groups) == sum(estimate_message(m) for m in messages)


@given(transcripts(well_formed=True, openai_style=True))
@settings(max_examples=60)
def test_openai_transcripts_group_every_call_with_its_results(messages: list[dict[str, Any]]) -> None:
    normalized = normalize_snapshot({"messages": messages}).messages
    groups = group_messages(normalized)
    _assert_partition(groups, len(normalized))
    for group in groups:
        calls = {i for m in normalized[group.start : group.end] for i in tool_use_ids(m)}
        results = {i for m in normalized[group.start : group.end] for i in tool_result_ids(m)}
        assert calls == results
        assert group.unanswered_calls == group.orphan_results == 0


def test_tool_result_text_joins_text_blocks_and_lets_the_caller_label_the_rest() -> None:
    from service.budget import tool_result_text

    content = [
        {"type": "text", "text": "line 1"},
        {"type": "image"},
        "raw",
        {"type": "text", "text": "line 2"},
    ]
    text = tool_result_text(content, other_block=lambda b: f"<{b['type']}>", other_value=repr)
    assert text == "line 1\n<image>\nraw\nline 2"
    assert tool_result_text(None, other_block=str, other_value=repr) == ""
    assert tool_result_text({"k": 1}, other_block=str, other_value=lambda v: "other") == "other"
