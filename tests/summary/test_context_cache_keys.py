"""Content-keyed context summary cache: keys and the hit / prefix / miss decision (pure)."""

from __future__ import annotations

from typing import Any

from service.budget.prepared import prepare_snapshot
from service.summary.context import (
    CachedContextSummary,
    CacheHit,
    CacheMiss,
    PrefixReuse,
    Reuse,
    find_reusable,
)
from service.summary.document import Provenance, SummaryDocument
from service.summary.prompts import PROMPT_VERSION


def _messages(n: int, tag: str = "") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        out.append({"role": role, "content": f"message {i}{tag}"})
    return out


def _reuse(
    messages: list[dict[str, Any]], until: int, entries: list[CachedContextSummary], model: str = "m"
) -> Reuse:
    """find_reusable for ``messages[:until]`` of this transcript."""
    return find_reusable(prepare_snapshot({"messages": messages}), entries, until, model=model)


def prefix_key(messages: list[dict[str, Any]], model: str, prompt_version: str = PROMPT_VERSION) -> str:
    """The cache key a prepared snapshot of just ``messages`` gives their whole prefix."""
    return prepare_snapshot({"messages": messages}).cache_key(len(messages), model, prompt_version)


def _entry(messages: list[dict[str, Any]], covered: int, model: str = "m") -> CachedContextSummary:
    key = prefix_key(messages[:covered], model)
    return CachedContextSummary(
        key=key,
        snapshot_id="s",
        covered_messages=covered,
        document=SummaryDocument(objective="o", state=f"covers {covered}"),
        provenance=Provenance.for_context(
            prefix_hash=key, end=covered, model=model, created_at="t", context_time=None
        ),
        tokens=10,
        created_at="t",
    )


def test_key_is_content_not_spelling_and_depends_on_model_and_prompt_version() -> None:
    a = [{"role": "user", "content": [{"type": "text", "text": "中文"}]}]
    b = [{"content": [{"text": "中文", "type": "text"}], "role": "user"}]
    assert prefix_key(a, "m") == prefix_key(b, "m")
    assert prefix_key(a, "m") != prefix_key(a, "other-model")
    assert prefix_key(a, "m", "v1") != prefix_key(a, "m", "v2")
    assert prefix_key(a, "m") != prefix_key([{"role": "user", "content": "中文!"}], "m")
    # Message boundaries are part of the content: [x, y] is not [xy].
    assert prefix_key([{"role": "user", "content": "ab"}], "m") != prefix_key(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "m"
    )


def test_the_same_prefix_is_a_hit_whatever_the_snapshot_id() -> None:
    msgs = _messages(20)
    entry = _entry(msgs, 14)
    reuse = _reuse(msgs, 14, [entry])
    assert reuse == CacheHit(entry)


def test_a_longer_snapshot_reuses_the_longest_matching_prefix() -> None:
    old = _messages(20)
    new = [*old, *_messages(10, tag="-new")]
    entries = [_entry(old, 6), _entry(old, 14), _entry(_messages(20, tag="-other"), 16)]
    reuse = _reuse(new, 24, entries)
    assert isinstance(reuse, PrefixReuse)
    assert reuse.entry is entries[1] and reuse.covered_messages == 14


def test_different_content_or_model_is_a_miss() -> None:
    msgs = _messages(20)
    changed = [*msgs[:3], {"role": "assistant", "content": "edited"}, *msgs[4:]]
    reuse = _reuse(changed, 14, [_entry(msgs, 14)])
    assert reuse == CacheMiss()
    reuse = _reuse(msgs, 14, [_entry(msgs, 14, model="x")])
    assert reuse == CacheMiss()


def test_an_entry_longer_than_the_new_cut_is_not_used() -> None:
    msgs = _messages(30)
    reuse = _reuse(msgs, 10, [_entry(msgs, 20)])
    assert reuse == CacheMiss()


def test_a_prefix_ending_between_a_tool_call_and_its_result_is_not_reused() -> None:
    # The old snapshot ended while a tool ran; in the new one its result follows at index 2.
    old: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]},
    ]
    new: list[dict[str, Any]] = [
        *old,
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a b"}]},
        *_messages(6, tag="-later"),
    ]
    reuse = _reuse(new, 7, [_entry(old, 2)])
    assert reuse == CacheMiss()
    assert isinstance(_reuse(new, 7, [_entry(new, 3)]), PrefixReuse)


def test_cached_entries_round_trip_through_json() -> None:
    entry = _entry(_messages(4), 2)
    assert CachedContextSummary.from_json(entry.to_json()) == entry
