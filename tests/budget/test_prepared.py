"""The snapshot prepared once (service/budget/prepared.py) equals what a request would derive itself."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.budget import (
    estimate_message,
    estimate_system,
    estimate_tools,
    group_messages,
    normalize_snapshot,
)
from service.budget.prepared import (
    MAX_SNAPSHOT_DEPTH,
    PREPARED_VERSION,
    PreparedSnapshot,
    UnstorableSnapshot,
    encode_snapshot,
    json_depth,
    prefix_digests,
    prepare_snapshot,
    summary_cache_key,
)
from service.vocabulary import canonical_bytes

texts = st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=40)


@st.composite
def snapshots(draw: st.DrawFn) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for i in range(draw(st.integers(0, 12))):
        if draw(st.booleans()):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": draw(texts)})
        else:
            tid = f"t{i}"
            messages.append(
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": tid, "name": "grep", "input": {}}],
                }
            )
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": tid, "content": draw(texts)}],
                }
            )
    # A system prompt as a string, or as Anthropic text blocks (kept as posted: system_blocks).
    block = st.builds(
        lambda text, cached: {
            "type": "text",
            "text": text,
            **({"cache_control": {"type": "ephemeral"}} if cached else {}),
        },
        texts,
        st.booleans(),
    )
    system = draw(st.one_of(texts, st.lists(block, min_size=1, max_size=3)))
    return {"system": system, "tools": [{"name": "grep", "input_schema": {}}], "messages": messages}


@settings(max_examples=60)
@given(snapshots())
def test_prepared_matches_what_a_request_would_compute(content: dict[str, Any]) -> None:
    prepared = prepare_snapshot(content)
    normal = normalize_snapshot(content)
    assert prepared.messages == normal.messages
    assert list(prepared.message_tokens) == [estimate_message(m) for m in normal.messages]
    assert list(prepared.groups) == group_messages(normal.messages)
    assert prepared.system_tokens == estimate_system(normal.system)
    assert prepared.snapshot.system_blocks == normal.system_blocks
    assert prepared.tools_tokens == estimate_tools(normal.tools)
    assert list(prepared.digests) == prefix_digests(normal.messages)
    for length in range(len(normal.messages) + 1):
        assert prepared.cache_key(length, "m", "v") == summary_cache_key(
            prefix_digests(normal.messages[:length])[-1], "m", "v"
        )


@settings(max_examples=40)
@given(snapshots())
def test_the_stored_form_round_trips_through_json(content: dict[str, Any]) -> None:
    prepared = prepare_snapshot(content)
    stored = json.loads(json.dumps(prepared.to_json()))
    assert stored["version"] == PREPARED_VERSION
    posted = json.loads(json.dumps(content.get("messages")))
    assert PreparedSnapshot.from_json(stored, posted) == prepared
    # The transcript is stored once: the preparation keeps its own copy only when it differs.
    assert (stored["messages"] is None) == prepared.messages_as_posted
    if prepared.messages_as_posted:
        with pytest.raises(ValueError):
            PreparedSnapshot.from_json(stored)


def test_a_system_of_text_blocks_is_kept_as_posted_unless_system_messages_join_it() -> None:
    """SPEC §7: the main session's system prompt is sent as it had it (its cache breakpoints too)."""
    blocks = [
        {"type": "text", "text": "You are"},
        {"type": "text", "text": "the agent.", "cache_control": {"type": "ephemeral"}},
    ]
    user = {"role": "user", "content": "hi"}
    kept = normalize_snapshot({"system": blocks, "messages": [user]})
    assert kept.system_blocks == tuple(blocks) and kept.system == "You are\nthe agent."
    stored = prepare_snapshot({"system": blocks, "messages": [user]}).to_json()
    assert PreparedSnapshot.from_json(json.loads(json.dumps(stored)), [user]).snapshot.system_blocks == tuple(
        blocks
    )
    # Joined with a system message's text, or not all text blocks, or a string: only the text.
    joined = normalize_snapshot(
        {"system": blocks, "messages": [{"role": "system", "content": "More."}, user]}
    )
    assert joined.system_blocks == () and joined.system == "You are\nthe agent.\n\nMore."
    assert (
        normalize_snapshot({"system": [*blocks, {"type": "image"}], "messages": [user]}).system_blocks == ()
    )
    assert normalize_snapshot({"system": "plain", "messages": [user]}).system_blocks == ()


def test_another_version_is_refused_so_it_is_recomputed() -> None:
    stored = prepare_snapshot({"messages": [{"role": "user", "content": "hi"}]}).to_json()
    stored["version"] = PREPARED_VERSION + 1
    try:
        PreparedSnapshot.from_json(stored)
    except ValueError:
        return
    raise AssertionError("a prepared snapshot of another version must not be trusted")


@settings(max_examples=60)
@given(snapshots(), st.dictionaries(st.sampled_from(["a", "max_output_tokens", "system", "zz"]), texts))
def test_one_encoding_gives_the_canonical_bytes_digests_and_stored_json(
    content: dict[str, Any], extra: dict[str, str]
) -> None:
    # Keys before and after "messages" (sorted), so the splice is checked on both sides of the array.
    content = {**extra, **content}
    encoded = encode_snapshot(content)
    assert encoded.canonical == canonical_bytes(content)
    assert encoded.size == len(json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode())
    prepared = prepare_snapshot(content, encoded)
    assert prepared.digests == prepare_snapshot(content).digests
    assert json.loads(prepared.to_json_text(encoded)) == json.loads(json.dumps(prepared.to_json()))


def test_rewritten_messages_are_encoded_not_borrowed() -> None:
    # role:tool messages are rewritten by normalisation: their bytes cannot come from the posted ones.
    content = {
        "messages": [
            {"role": "assistant", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "result"},
        ]
    }
    encoded = encode_snapshot(content)
    assert prepare_snapshot(content, encoded).digests == prepare_snapshot(content).digests


def test_nul_and_lone_surrogates_are_refused_wherever_they_are() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": [{"role": "user", "content": "a\x00b"}]}, "nul"),
        ({"system": "\x00", "messages": []}, "nul"),
        ({"a": "\x00", "messages": [1]}, "nul"),  # a key before "messages" holding the mark itself
        ({"messages": "x\x00"}, "nul"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "surrogate"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1e400}]}]}, "number"),
        ({"tools": [{"name": "t", "input_schema": {"maximum": -1e400}}], "messages": []}, "number"),
    ]
    for content, reason in cases:
        with pytest.raises(UnstorableSnapshot) as refused:
            encode_snapshot(content)
        assert refused.value.reason == reason, content


def test_the_text_backslash_u0000_is_not_a_nul() -> None:
    # Six characters common in source code: JSON writes them "\\u0000", which contains "\u0000".
    for text in ['printf("\\u0000")', "\\\\\\u0000", "\\"]:
        encoded = encode_snapshot({"messages": [{"role": "user", "content": text}], "system": text})
        assert encoded.canonical == canonical_bytes(
            {"messages": [{"role": "user", "content": text}], "system": text}
        )


def test_rewritten_messages_keep_their_own_copy_in_the_stored_form() -> None:
    content = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ]
    }
    prepared = prepare_snapshot(content)
    assert not prepared.messages_as_posted  # the system message was lifted out of the list
    stored = json.loads(prepared.to_json_text())
    assert stored["messages"] == [{"role": "user", "content": "hi"}]
    assert PreparedSnapshot.from_json(stored) == prepared
    plain = prepare_snapshot({"messages": [{"role": "user", "content": "hi"}]})
    assert plain.messages_as_posted and json.loads(plain.to_json_text())["messages"] is None


def _nested(levels: int) -> object:
    """A value of exactly ``levels`` levels (json_depth): lists around a string."""
    deep: object = "leaf"
    for _ in range(levels - 1):
        deep = [deep]
    return deep


@pytest.mark.parametrize("where", ["message", "envelope"])
def test_the_nesting_limit_is_exact_inside_messages_and_around_them(where: str) -> None:
    """Depth MAX is stored, MAX + 1 refused, wherever the nesting is (a message is walked only when
    its bracket count says it might be too deep: the limit must not move)."""

    def snapshot(levels: int) -> dict[str, object]:
        if where == "message":  # snapshot (1) > messages (2) > message (3) > "content" value (4…)
            return {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "user", "content": _nested(levels - 3)},
                ]
            }
        return {"messages": [{"role": "user", "content": "hi"}], "x": _nested(levels - 1)}

    assert json_depth(snapshot(MAX_SNAPSHOT_DEPTH)) == MAX_SNAPSHOT_DEPTH
    encode_snapshot(snapshot(MAX_SNAPSHOT_DEPTH))
    assert json_depth(snapshot(MAX_SNAPSHOT_DEPTH + 1)) == MAX_SNAPSHOT_DEPTH + 1
    with pytest.raises(UnstorableSnapshot) as refused:
        encode_snapshot(snapshot(MAX_SNAPSHOT_DEPTH + 1))
    assert refused.value.reason == "depth"


def test_nesting_past_the_interpreters_recursion_limit_is_refused_as_depth() -> None:
    with pytest.raises(UnstorableSnapshot) as refused:
        encode_snapshot({"messages": [{"role": "user", "content": _nested(5000)}]})
    assert refused.value.reason == "depth"


def test_absurd_nesting_is_refused() -> None:
    deep: object = "leaf"
    for _ in range(MAX_SNAPSHOT_DEPTH):
        deep = [deep]
    assert json_depth({"messages": [], "x": deep}) == MAX_SNAPSHOT_DEPTH + 2
    with pytest.raises(UnstorableSnapshot) as refused:
        encode_snapshot({"messages": [], "x": deep})
    assert refused.value.reason == "depth"
    encode_snapshot({"messages": [], "x": [[["fine"]]]})
