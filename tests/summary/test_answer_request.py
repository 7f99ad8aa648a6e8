"""The side answer request layout (SPEC §7): snapshot prefix untouched, one final Sidequest user turn."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from service.budget import (
    envelope_tokens,
    estimate_messages,
    estimate_system,
    estimate_text,
    estimate_tools,
)
from service.summary.material import QAPair
from service.summary.prompts import (
    ANSWER_INSTRUCTIONS,
    ANSWER_INSTRUCTIONS_NO_CONTEXT,
    CONTEXT_SUMMARY_ACK,
    PENDING_TOOL_RESULT,
    build_answer_request,
)

SYSTEM = "You are the main coding agent."
TOOLS = [{"name": "grep", "description": "search", "input_schema": {"type": "object"}}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "Fix the flaky test in tests/test_io.py"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Searching."},
            {"type": "tool_use", "id": "t1", "name": "grep", "input": {"pattern": "sleep"}},
        ],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "test_io.py:12"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "The test sleeps 0.1 s; replacing it."}]},
]


def _texts(message: dict[str, Any]) -> list[str]:
    return [b["text"] for b in message["content"] if b.get("type") == "text"]


def test_snapshot_prefix_is_sent_exactly_and_sidequest_text_comes_last_in_order() -> None:
    original = copy.deepcopy(MESSAGES)
    request = build_answer_request(
        question="Why was the test flaky?",
        system=SYSTEM,
        tools=TOOLS,
        messages=MESSAGES,
        qa_summary="[Summary of side Q&A ordinals 1–3]\nObjective: x",
        replayed=[QAPair(4, "Which file?", "tests/test_io.py"), QAPair(5, "Which line?", "12")],
        context_time="2026-11-29T10:00:00Z",
    )
    assert MESSAGES == original  # the main transcript is never changed
    assert request.system == SYSTEM and request.tools == TOOLS
    assert request.messages[: len(MESSAGES)] == MESSAGES
    assert len(request.messages) == len(MESSAGES) + 1
    final = request.messages[-1]
    assert final["role"] == "user"
    texts = _texts(final)
    assert texts[0].startswith(ANSWER_INSTRUCTIONS)
    assert "not new tool evidence" in texts[0] and "latest main context wins" in texts[0]
    assert "2026-11-29T10:00:00Z" in texts[0]
    assert "ordinals 1–3" in texts[1]
    assert texts[2].index("#4") < texts[2].index("Which file?") < texts[2].index("#5") < texts[2].index("12")
    assert texts[3].endswith("Why was the test flaky?")


def test_segment_estimates_add_up_and_are_attributed() -> None:
    request = build_answer_request(
        question="q?",
        system=SYSTEM,
        tools=TOOLS,
        messages=MESSAGES,
        qa_summary="S" * 300,
        replayed=[QAPair(1, "a", "b" * 90)],
    )
    est = request.estimate
    assert est.system == estimate_system(SYSTEM)
    assert est.tools == estimate_tools(TOOLS)
    assert est.context == estimate_messages(MESSAGES) - envelope_tokens(len(MESSAGES))
    assert est.qa_summary >= 100 and est.qa_raw >= 30
    # The question segment is the question alone; our instructions and label are envelope.
    assert est.question == estimate_text("q?")
    final_texts = [b["text"] for b in request.messages[-1]["content"] if b.get("type") == "text"]
    wrappers = estimate_text(final_texts[0]) + estimate_text(final_texts[-1]) - estimate_text("q?")
    assert est.envelope == envelope_tokens(len(request.messages)) + wrappers
    # Every token of the request is in exactly one segment.
    whole = estimate_system(SYSTEM) + estimate_tools(TOOLS) + estimate_messages(request.messages)
    assert est.total == whole


def test_a_12000_byte_question_estimates_exactly_4000_tokens() -> None:
    question = "x" * 12_000
    request = build_answer_request(question=question, messages=MESSAGES)
    assert request.estimate.question == 4000
    whole = estimate_messages(request.messages)
    assert request.estimate.total == whole  # the wrappers moved to envelope, the total did not change


def test_a_trailing_user_turn_gets_the_sidequest_blocks_appended_not_a_fake_assistant_turn() -> None:
    messages = [*MESSAGES, {"role": "user", "content": "Also check the CI config"}]
    request = build_answer_request(question="What does CI run?", messages=messages)
    assert len(request.messages) == len(messages)
    assert request.messages[:-1] == messages[:-1]
    last = request.messages[-1]
    assert last["role"] == "user"
    assert last["content"][0] == {"type": "text", "text": "Also check the CI config"}
    assert _texts(last)[-1].endswith("What does CI run?")
    assert messages[-1]["content"] == "Also check the CI config"  # the input is not mutated


def test_tool_results_in_the_trailing_user_turn_stay_first() -> None:
    messages = MESSAGES[:3]
    request = build_answer_request(question="q", messages=messages)
    last = request.messages[-1]
    assert last["content"][0]["type"] == "tool_result"
    assert all(b["type"] == "text" for b in last["content"][1:])


def test_a_tool_call_still_running_gets_a_pending_result_before_the_question() -> None:
    messages = MESSAGES[:2]  # snapshot taken while grep ran
    request = build_answer_request(question="q", messages=messages)
    assert request.messages[:2] == messages
    final = request.messages[2]
    assert final["content"][0] == {"type": "tool_result", "tool_use_id": "t1", "content": PENDING_TOOL_RESULT}
    assert final["content"][1]["type"] == "text"


def test_compacted_context_puts_the_summary_pair_first_then_kept_messages_unchanged() -> None:
    kept = MESSAGES[2:]
    request = build_answer_request(question="q", messages=kept, context_summary="SUMMARY TEXT")
    # kept starts with a user turn: a summary user turn and a short assistant acknowledgement first.
    assert request.messages[0] == {"role": "user", "content": [{"type": "text", "text": "SUMMARY TEXT"}]}
    assert request.messages[1]["role"] == "assistant" and _texts(request.messages[1]) == [CONTEXT_SUMMARY_ACK]
    assert request.messages[2:4] == kept
    kept_from_assistant = MESSAGES[3:]
    request = build_answer_request(question="q", messages=kept_from_assistant, context_summary="S")
    assert [m["role"] for m in request.messages] == ["user", "assistant", "user"]
    assert request.messages[1] == kept_from_assistant[0]


def test_roles_alternate_for_every_trailing_shape() -> None:
    for cut in range(len(MESSAGES) + 1):
        for summary in (None, "S"):
            request = build_answer_request(question="q", messages=MESSAGES[cut:], context_summary=summary)
            roles = [m["role"] for m in request.messages]
            assert roles[-1] == "user"
            assert all(a != b for a, b in itertools.pairwise(roles)), (cut, summary, roles)


def test_no_snapshot_means_just_the_final_turn() -> None:
    request = build_answer_request(question="What did we decide?", qa_summary="S")
    assert request.system is None and request.tools == []
    assert len(request.messages) == 1 and request.estimate.context == 0
    assert request.messages[0]["content"][0]["text"] == ANSWER_INSTRUCTIONS_NO_CONTEXT
