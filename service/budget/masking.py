"""Tier 1 of the compaction ladder: masking tool payloads (SPEC §6.8), and the artifacts (§6.9).

Masking keeps what a person names a tool call by (its key argument) and elides payloads larger than
:data:`PAYLOAD_THRESHOLD_BYTES`; docs/budget.md "The compaction ladder" has the rules. The masked form
of a group is a function of that group alone (no index, neighbour or budget), so the masked prefix of a
growing session is byte-identical from one question to the next and a provider's prompt cache serves it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from service.budget.estimate import POSTED_FORM, compact_json, estimate_message, utf8_length
from service.budget.messages import MessageGroup, tool_result_text

# SPEC §6.8's order: what names a call for a person, most specific first.
KEY_ARGUMENT_FIELDS: Final = (
    "file_path",
    "path",
    "notebook_path",
    "command",
    "cmd",
    "pattern",
    "url",
    "query",
    "glob",
)
# Below this a payload costs about as much as the stub that would replace it (~50–90 tokens).
PAYLOAD_THRESHOLD_BYTES: Final = 512
# An artifact and a stub's first/last line are cut here: enough for a path or a command line.
ARTIFACT_MAX_CHARS: Final = 160
STUB_LINE_MAX_CHARS: Final = 160
# Every elision starts with this, so a reader (and a test) can tell Sidequest's words from the session's.
ELIDED_PREFIX: Final = "[elided by Sidequest: "


@dataclass(frozen=True, order=True)
class Artifact:
    """What a person names a tool call by: its tool and the first line of its key argument."""

    tool: str
    text: str


def key_argument(arguments: Mapping[str, Any]) -> str | None:
    """The name of the key argument of a tool call's input (SPEC §6.8), or None when it has no string."""
    for name in KEY_ARGUMENT_FIELDS:
        value = arguments.get(name)
        if isinstance(value, str) and value:
            return name
    for name, value in arguments.items():
        if isinstance(value, str):
            return str(name)
    return None


def artifact_text(value: str) -> str:
    """A key argument's artifact: its first line, at most :data:`ARTIFACT_MAX_CHARS` characters."""
    newline = value.find("\n")
    return (value if newline < 0 else value[:newline])[:ARTIFACT_MAX_CHARS]


def artifact_of(block: Mapping[str, Any]) -> Artifact | None:
    """The artifact of a ``tool_use`` block, None for another block or a call without a string argument."""
    if block.get("type") != "tool_use":
        return None
    arguments = block.get("input")
    if not isinstance(arguments, Mapping):
        return None
    key = key_argument(arguments)
    if key is None:
        return None
    text = artifact_text(str(arguments[key]))
    return Artifact(str(block.get("name") or ""), text) if text else None


def _tool_uses(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    uses: list[Mapping[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if message.get("role") == "assistant" and isinstance(content, list):
            uses.extend(b for b in content if isinstance(b, Mapping) and b.get("type") == "tool_use")
    return uses


def group_artifacts(messages: Sequence[Mapping[str, Any]]) -> list[tuple[Artifact, bool]]:
    """Each tool call's artifact in ``messages`` (one group, or any run of them), in call order, with
    whether its result in the same messages was marked as an error."""
    errors = {
        str(block.get("tool_use_id") or "")
        for message in messages
        if isinstance(content := message.get("content"), list)
        for block in content
        if isinstance(block, Mapping) and block.get("type") == "tool_result" and block.get("is_error")
    }
    return [
        (artifact, str(use.get("id") or "") in errors)
        for use in _tool_uses(messages)
        if (artifact := artifact_of(use)) is not None
    ]


def result_stub(text: str, tool: str, *, is_error: bool) -> str:
    """What a masked tool result says instead of its content (SPEC §6.8's wording)."""
    lines = text.splitlines()
    # The first and last non-empty lines, sought from both ends: a payload runs to thousands of lines.
    first = next((stripped for line in lines if (stripped := line.strip())), "")
    last = next((stripped for line in reversed(lines) if (stripped := line.strip())), "")
    flag = " (error)" if is_error else ""
    return (
        f"{ELIDED_PREFIX}{utf8_length(text)} bytes, {len(lines)} lines of {tool or 'tool'} output{flag};"
        f" first line: {first[:STUB_LINE_MAX_CHARS]}; last line: {last[:STUB_LINE_MAX_CHARS]}]"
    )


def _mask_arguments(arguments: Mapping[str, Any]) -> tuple[dict[str, Any], int] | None:
    """The input with its payload fields elided and the bytes elided; None when nothing changes."""
    key = key_argument(arguments)
    masked = dict(arguments)
    elided = 0
    for name, value in arguments.items():
        if name == key or not isinstance(value, str) or len(value) <= PAYLOAD_THRESHOLD_BYTES // 4:
            continue
        size = utf8_length(value)
        if size <= PAYLOAD_THRESHOLD_BYTES:
            continue
        masked[name] = f"{ELIDED_PREFIX}{size} bytes]"  # what a masked input field says instead
        elided += size
    return (masked, elided) if elided else None


def _mask_openai_call(call: Any) -> Any:
    """An OpenAI ``tool_calls`` entry with the same fields masked in its ``arguments`` JSON (kept valid
    JSON); the entry itself when its arguments are not a JSON object or need no masking."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    masked = _mask_arguments(arguments) if isinstance(arguments, dict) else None
    if masked is None:
        return call
    return {**call, "function": {**function, "arguments": json.dumps(masked[0], ensure_ascii=False)}}


@dataclass(frozen=True)
class MaskedGroup:
    """One group in its masked form (the very same objects where nothing changed), its estimate, how
    many messages changed and the UTF-8 bytes elided."""

    messages: tuple[dict[str, Any], ...]
    tokens: int
    masked_messages: int
    payload_bytes: int


def _mask_message(
    message: dict[str, Any], tools_by_id: Mapping[str, str]
) -> tuple[dict[str, Any], int] | None:
    content = message.get("content")
    if not isinstance(content, list):
        return None
    blocks = list(content)
    elided = 0  # > 0 exactly when a block was replaced: only payloads over the threshold are
    masked_results: dict[str, str] = {}
    for at, block in enumerate(content):
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "tool_result":
            text = tool_result_text(block.get("content"), other_block=compact_json, other_value=compact_json)
            size = utf8_length(text)
            if size > PAYLOAD_THRESHOLD_BYTES:
                use_id = str(block.get("tool_use_id") or "")
                stub = result_stub(text, tools_by_id.get(use_id, ""), is_error=bool(block.get("is_error")))
                # A stub quotes two lines of up to 160 characters: in a script of 3–4-byte characters
                # it can outweigh a payload just over the threshold, and masking must never grow a group.
                if utf8_length(stub) < size:
                    blocks[at] = {**block, "content": stub}
                    masked_results[use_id] = stub
                    elided += size
        elif kind == "tool_use" and isinstance(block.get("input"), Mapping):
            masked_input = _mask_arguments(block["input"])
            if masked_input is not None:
                blocks[at] = {**block, "input": masked_input[0]}
                elided += masked_input[1]
    if not elided:
        return None
    masked = {**message, "content": blocks}
    posted = message.get(POSTED_FORM)
    if isinstance(posted, Mapping):
        masked[POSTED_FORM] = {
            **posted,
            "messages": [_mask_posted(m, masked_results) for m in posted["messages"]],
        }
    return masked, elided


def _mask_posted(message: Any, masked_results: Mapping[str, str]) -> Any:
    """The OpenAI form a converted message was posted in, masked as its canonical form was."""
    if not isinstance(message, Mapping):
        return message
    if message.get("role") == "tool":
        stub = masked_results.get(str(message.get("tool_call_id") or ""))
        return message if stub is None else {**message, "content": stub}
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        masked_calls = [_mask_openai_call(call) for call in calls]
        if any(a is not b for a, b in zip(masked_calls, calls, strict=True)):
            return {**message, "tool_calls": masked_calls}
    return message


def mask_group(messages: Sequence[dict[str, Any]], tokens: Sequence[int]) -> MaskedGroup:
    """The masked form of one group (``messages``, with their estimates ``tokens``): only a changed
    message is copied and estimated again, the others are the same objects."""
    tools_by_id = {str(use.get("id") or ""): str(use.get("name") or "") for use in _tool_uses(messages)}
    out: list[dict[str, Any]] = []
    total = 0
    changed = 0
    elided = 0
    for message, estimate in zip(messages, tokens, strict=True):
        masked = _mask_message(message, tools_by_id)
        if masked is None:
            out.append(message)
            total += estimate
            continue
        out.append(masked[0])
        total += estimate_message(masked[0])
        changed += 1
        elided += masked[1]
    return MaskedGroup(tuple(out), total, changed, elided)


def mask_groups(
    messages: Sequence[dict[str, Any]], groups: Sequence[MessageGroup], message_tokens: Sequence[int]
) -> tuple[MaskedGroup, ...]:
    return tuple(mask_group(messages[g.start : g.end], message_tokens[g.start : g.end]) for g in groups)
