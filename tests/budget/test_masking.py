"""Masking (SPEC §6.8) and the artifact trail (§6.9): the rules, and the properties that make masking
safe to apply to a main session's copy — groups never split, what names a call never elided, the
masked form of a group its own, masking oldest-first monotone, OpenAI arguments still JSON."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from service.budget import estimate_message, group_messages
from service.budget.estimate import POSTED_FORM
from service.budget.masking import (
    ELIDED_PREFIX,
    PAYLOAD_THRESHOLD_BYTES,
    Artifact,
    artifact_of,
    key_argument,
    mask_group,
    mask_groups,
    result_stub,
)
from service.budget.messages import normalize_snapshot
from service.budget.trail import TRAIL_MAX_BYTES, TRAIL_MAX_ENTRIES, bound_trail, collect_trail, render_trail
from tests.budget.strategies import mixed_text

TOOLS = ["Read", "Bash", "Edit", "Write", "Grep"]


def _payload(draw: st.DrawFn) -> str:
    small = draw(mixed_text)
    lines = draw(st.integers(min_value=0, max_value=60))
    return small + "".join(
        f"\nline {n}: {draw(st.sampled_from(['ok', 'x' * 30, '中文字符']))}" for n in range(lines)
    )


@st.composite
def tool_transcripts(draw: st.DrawFn, *, openai_style: bool = False) -> list[dict[str, Any]]:
    """Tool-heavy transcripts: text turns and tool calls with key arguments and payloads of every size."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": draw(mixed_text) or "go"}]
    for turn in range(draw(st.integers(min_value=0, max_value=8))):
        if draw(st.booleans()):
            messages.append({"role": "assistant", "content": draw(mixed_text) or "thinking"})
            messages.append({"role": "user", "content": draw(mixed_text) or "ok"})
            continue
        calls = []
        for k in range(draw(st.integers(min_value=1, max_value=3))):
            name = draw(st.sampled_from(TOOLS))
            arguments: dict[str, Any] = {"file_path": f"/src/m{turn}_{k}.py"} if name != "Bash" else {}
            if name == "Bash":
                arguments["command"] = f"pytest -k case{turn}\n# second line"
            if name in ("Edit", "Write"):
                arguments["content"] = _payload(draw)
            if draw(st.booleans()):
                arguments["limit"] = 40
            calls.append((f"t{turn}_{k}", name, arguments, _payload(draw), draw(st.booleans())))
        text = draw(mixed_text)
        if openai_style:
            messages.append(
                {
                    "role": "assistant",
                    "content": text or None,
                    "tool_calls": [
                        {
                            "id": cid,
                            "type": "function",
                            "function": {
                                "name": name,
                                "arguments": json.dumps(arguments, ensure_ascii=False),
                            },
                        }
                        for cid, name, arguments, _, _ in calls
                    ],
                }
            )
            messages.extend(
                {"role": "tool", "tool_call_id": cid, "content": out} for cid, *_, out, _ in calls
            )
        else:
            blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
            blocks += [
                {"type": "tool_use", "id": cid, "name": name, "input": args}
                for cid, name, args, _, _ in calls
            ]
            messages.append({"role": "assistant", "content": blocks})
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": cid,
                            "content": out,
                            **({"is_error": True} if err else {}),
                        }
                        for cid, _, _, out, err in calls
                    ],
                }
            )
    return normalize_snapshot({"messages": messages}).messages


def _masked(messages: list[dict[str, Any]]) -> tuple[Any, Any, list[int]]:
    tokens = [estimate_message(m) for m in messages]
    groups = group_messages(messages, tokens)
    return groups, mask_groups(messages, groups, tokens), tokens


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


@settings(max_examples=80)
@given(tool_transcripts())
def test_a_group_is_masked_whole_and_never_split(messages: list[dict[str, Any]]) -> None:
    groups, forms, _ = _masked(messages)
    for group, form in zip(groups, forms, strict=True):
        originals = messages[group.start : group.end]
        assert len(form.messages) == len(originals)
        for original, masked in zip(originals, form.messages, strict=True):
            assert masked["role"] == original["role"]
            kinds = [
                (b.get("type"), b.get("id"), b.get("name"), b.get("tool_use_id")) for b in _blocks(original)
            ]
            assert kinds == [
                (b.get("type"), b.get("id"), b.get("name"), b.get("tool_use_id")) for b in _blocks(masked)
            ]


@settings(max_examples=80)
@given(tool_transcripts())
def test_text_and_key_arguments_are_never_elided(messages: list[dict[str, Any]]) -> None:
    _, forms, _ = _masked(messages)
    masked_messages = [m for form in forms for m in form.messages]
    for original, masked in zip(messages, masked_messages, strict=True):
        if isinstance(original["content"], str):
            assert masked is original
            continue
        for before, after in zip(_blocks(original), _blocks(masked), strict=True):
            if before.get("type") == "text":
                assert after == before
            if before.get("type") == "tool_use":
                key = key_argument(before["input"])
                if key is not None:
                    assert after["input"][key] == before["input"][key]
                assert set(after["input"]) == set(before["input"])
                assert artifact_of(after) == artifact_of(before)


@settings(max_examples=80)
@given(tool_transcripts(), tool_transcripts())
def test_the_masked_form_of_a_group_depends_on_that_group_alone(
    messages: list[dict[str, Any]], earlier: list[dict[str, Any]]
) -> None:
    groups, forms, tokens = _masked(messages)
    for group, form in zip(groups, forms, strict=True):
        alone = mask_group(messages[group.start : group.end], tokens[group.start : group.end])
        assert alone == form
    # The same groups after another transcript: the same masked bytes.
    longer = earlier + messages
    _, longer_forms, _ = _masked(longer)
    assert [json.dumps(f.messages, sort_keys=True) for f in longer_forms[-len(forms) :]] == [
        json.dumps(f.messages, sort_keys=True) for f in forms
    ]


@settings(max_examples=80)
@given(tool_transcripts())
def test_masking_oldest_first_never_grows_the_transcript(messages: list[dict[str, Any]]) -> None:
    groups, forms, _ = _masked(messages)
    sizes = []
    for k in range(len(groups) + 1):
        sizes.append(sum(f.tokens for f in forms[:k]) + sum(g.tokens for g in groups[k:]))
    assert all(a >= b for a, b in itertools.pairwise(sizes))
    for group, form in zip(groups, forms, strict=True):
        assert form.tokens == sum(estimate_message(m) for m in form.messages)
        assert form.tokens <= group.tokens


@settings(max_examples=60)
@given(tool_transcripts(openai_style=True))
def test_openai_arguments_stay_valid_json_of_the_same_keys(messages: list[dict[str, Any]]) -> None:
    _, forms, _ = _masked(messages)
    for form in forms:
        for masked in form.messages:
            for posted in (masked.get(POSTED_FORM) or {}).get("messages", []):
                for call in posted.get("tool_calls") or []:
                    arguments = json.loads(call["function"]["arguments"])
                    use = next(b for b in _blocks(masked) if b.get("id") == call["id"])
                    assert arguments == use["input"]
                if posted.get("role") == "tool":
                    result = next(
                        b for b in _blocks(masked) if b.get("tool_use_id") == posted["tool_call_id"]
                    )
                    assert posted["content"] == result["content"]


def test_the_key_argument_follows_specs_order_then_the_first_string() -> None:
    assert key_argument({"pattern": "TODO", "path": "src/"}) == "path"
    assert key_argument({"path": "", "pattern": "TODO"}) == "pattern"
    assert key_argument({"description": "list", "command": "ls -la"}) == "command"
    assert key_argument({"limit": 3, "prompt": "find it", "subagent": "x"}) == "prompt"
    assert key_argument({"limit": 3}) is None
    long_command = "python - <<'EOF'\n" + "print(1)\n" * 10
    assert artifact_of({"type": "tool_use", "name": "Bash", "input": {"command": long_command}}) == Artifact(
        "Bash", "python - <<'EOF'"
    )
    assert artifact_of({"type": "tool_use", "name": "Read", "input": {"file_path": "a" * 300}}) == Artifact(
        "Read", "a" * 160
    )


def test_a_masked_result_and_field_say_what_was_elided() -> None:
    output = "collected 3 items\n\n" + "x" * 600 + "\nFAILED tests/test_a.py::test_b - boom\n"
    use = {
        "type": "tool_use",
        "id": "t1",
        "name": "Bash",
        "input": {"command": "pytest", "content": "y" * 600},
    }
    messages = [
        {"role": "assistant", "content": [use]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": output, "is_error": True}],
        },
    ]
    form = mask_group(messages, [estimate_message(m) for m in messages])
    stub = form.messages[1]["content"][0]["content"]
    assert stub == (
        f"{ELIDED_PREFIX}{len(output)} bytes, 4 lines of Bash output (error); first line: collected 3 items;"
        " last line: FAILED tests/test_a.py::test_b - boom]"
    )
    assert stub == result_stub(output, "Bash", is_error=True)
    assert form.messages[0]["content"][0]["input"] == {
        "command": "pytest",
        "content": f"{ELIDED_PREFIX}600 bytes]",
    }
    assert form.masked_messages == 2 and form.payload_bytes == len(output) + 600


def test_small_payloads_stay_verbatim() -> None:
    small = "x" * PAYLOAD_THRESHOLD_BYTES
    messages = [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {"file_path": "a"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": small}]},
    ]
    form = mask_group(messages, [estimate_message(m) for m in messages])
    assert form.masked_messages == 0 and all(a is b for a, b in zip(form.messages, messages, strict=True))


def test_the_trail_lists_distinct_artifacts_by_last_use_with_counts_and_errors() -> None:
    uses = [
        (Artifact("Read", "a.py"), False),
        (Artifact("Bash", "pytest"), True),
        (Artifact("Read", "a.py"), False),
        (Artifact("Bash", "pytest"), False),
        (Artifact("Bash", "make"), True),
    ]
    entries = collect_trail(uses)
    assert [(e.artifact.text, e.uses, e.last_error) for e in entries] == [
        ("a.py", 2, False),
        ("pytest", 2, False),
        ("make", 1, True),
    ]
    text = render_trail(entries)
    assert text.splitlines()[1:] == [
        "- Read: a.py (x2)",
        "- Bash: pytest (x2)",
        "- Bash: make [last result an error]",
    ]


@given(st.lists(st.tuples(st.text(min_size=1, max_size=200), st.booleans()), max_size=300))
def test_the_trail_is_bounded_and_keeps_the_most_recently_used(uses: list[tuple[str, bool]]) -> None:
    entries = collect_trail((Artifact("Bash", text), error) for text, error in uses)
    kept = bound_trail(entries)
    assert len(kept) <= TRAIL_MAX_ENTRIES
    assert len(render_trail(kept).encode()) <= TRAIL_MAX_BYTES
    assert kept == entries[len(entries) - len(kept) :]
