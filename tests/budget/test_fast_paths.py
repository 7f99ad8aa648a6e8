"""Fast paths equal the slow definitions they replace: byte counts, compact JSON, argument parsing,
the plain-text message estimate and one-pass grouping (a plan must not change by being faster)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from service.budget import MessageGroup, estimate_message, group_messages
from service.budget.estimate import (
    MESSAGE_ENVELOPE_TOKENS,
    compact_json,
    estimate_message_content,
    utf8_length,
)
from service.budget.messages import normalize_snapshot, tool_result_ids, tool_use_ids

from .strategies import mixed_text, transcripts

# JSON-like values, plus the odd things a snapshot may still carry (non-finite floats, int keys,
# a set that only default=str can encode).
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    mixed_text,
)
plain_json_values = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(mixed_text, st.integers()), children, max_size=4),
    ),
    max_leaves=20,
)
json_values = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(mixed_text, st.integers()), children, max_size=4),
        st.frozensets(st.integers(), max_size=3),
    ),
    max_leaves=20,
)


def _reference_compact_json(value: object) -> str:
    """compact_json as first written: the checked json encoder, repr when it refuses."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    except (TypeError, ValueError):
        return repr(value)


def _reference_tool_input(arguments: str) -> Any:
    """The tool_use input of an OpenAI ``arguments`` string, by json.loads alone."""
    if not arguments:
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {"_arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"_arguments": arguments}


def _reference_groups(messages: Sequence[Mapping[str, Any]]) -> list[MessageGroup]:
    """Grouping as first written: every message's call and result ids first, then the groups."""
    tokens = [estimate_message(message) for message in messages]
    calls_of = [tool_use_ids(message) for message in messages]
    results_of = [tool_result_ids(message) for message in messages]
    groups: list[MessageGroup] = []
    index = 0
    while index < len(messages):
        if not calls_of[index]:
            groups.append(MessageGroup(index, index + 1, tokens[index], False, 0, len(results_of[index])))
            index += 1
            continue
        pending = set(calls_of[index])
        end = index + 1
        orphans = 0
        while end < len(messages) and pending:
            answered = [result for result in results_of[end] if result in pending]
            if not answered:
                break
            orphans += len(results_of[end]) - len(answered)
            pending.difference_update(answered)
            end += 1
        groups.append(MessageGroup(index, end, sum(tokens[index:end]), True, len(pending), orphans))
        index = end
    return groups


@given(st.one_of(mixed_text, st.text()))
@settings(max_examples=200)
def test_utf8_length_is_the_encoded_length(text: str) -> None:
    assert utf8_length(text) == len(text.encode("utf-8"))


@given(json_values)
@settings(max_examples=200)
def test_compact_json_equals_the_checked_encoder(value: object) -> None:
    assert compact_json(value) == _reference_compact_json(value)


def test_cycles_and_unencodable_keys_still_fall_back_to_repr() -> None:
    cyclic_list: list[object] = []
    cyclic_list.append(cyclic_list)
    cyclic_dict: dict[str, object] = {}
    cyclic_dict["self"] = [cyclic_dict]
    tuple_key = {(1, 2): "x"}
    for value in (cyclic_list, cyclic_dict, tuple_key):
        assert compact_json(value) == repr(value) == _reference_compact_json(value)


_argument_texts = st.one_of(
    # Valid JSON in every layout a client might send: compact, spaced, indented, ASCII-escaped.
    st.builds(
        lambda value, indent, ascii_only, pad: (
            pad + json.dumps(value, indent=indent, ensure_ascii=ascii_only) + pad
        ),
        plain_json_values,
        st.sampled_from([None, 0, 2]),
        st.booleans(),
        st.sampled_from(["", " ", "\n"]),
    ),
    # Broken or surprising text: truncated objects, trailing data, arrays, plain strings.
    st.builds(lambda text: "{" + text, st.text(max_size=30)),
    st.builds(lambda text: text + "}", st.text(max_size=30)),
    st.sampled_from(
        ['{"a": 1} {"b": 2}', '{"a": 1}}', "[1, 2]", '"x"', "{}", "{ }", '{"a": NaN}', "\ufeff{}"]
    ),
    st.text(max_size=40),
)


@given(_argument_texts)
@settings(max_examples=300)
def test_openai_arguments_parse_as_json_loads_would(arguments: str) -> None:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}],
    }
    converted = normalize_snapshot({"messages": [message]}).messages[0]["content"][0]["input"]
    # repr, not ==: NaN never equals itself, and repr also pins types (1 vs 1.0 vs True).
    assert repr(converted) == repr(_reference_tool_input(arguments))


@given(st.one_of(transcripts(well_formed=False), transcripts(well_formed=True, openai_style=True)))
@settings(max_examples=100)
def test_message_estimate_is_content_plus_envelope(messages: list[dict[str, Any]]) -> None:
    # Raw OpenAI messages too: their tool_calls / tool_call_id must not take the plain-text path.
    for message in [*messages, *normalize_snapshot({"messages": messages}).messages]:
        assert estimate_message(message) == estimate_message_content(message) + MESSAGE_ENVELOPE_TOKENS


@given(st.one_of(transcripts(well_formed=False), transcripts(well_formed=True, openai_style=True)))
@settings(max_examples=100)
def test_one_pass_grouping_equals_the_two_pass_definition(messages: list[dict[str, Any]]) -> None:
    canonical = normalize_snapshot({"messages": messages}).messages
    assert group_messages(canonical) == _reference_groups(canonical)
