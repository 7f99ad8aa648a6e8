"""Snapshot normalisation and message groups (SPEC §3 snapshot, §6.2 "cut only between groups").

Canonical messages are Anthropic-style; OpenAI-style ones are converted, canonical ones pass through
as the very same objects (nothing here mutates its input). Malformed but recognisable input never
raises; only a message or tool that is not a mapping is refused (``ValueError``): the API validates
snapshots, so that is a caller bug. The rules are in docs/budget.md "Messages and groups".
"""

from __future__ import annotations

import json
import json.scanner
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from service.budget.estimate import POSTED_FORM, compact_json, estimate_message
from service.budget.window import positive_setting

Message = dict[str, Any]

# OpenAI puts instructions in messages; "developer" is its newer name for "system".
_SYSTEM_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True)
class NormalizedSnapshot:
    """A snapshot in canonical form: system text, Anthropic-style tools and messages, and the
    snapshot's own window and output cap (None unless a positive integer)."""

    system: str | None
    tools: list[dict[str, Any]]
    messages: list[Message]
    context_window: int | None = None
    max_output_tokens: int | None = None
    # The snapshot's ``system`` as posted when it is a list of text blocks no system message joins: a
    # provider that takes blocks gets them as they are, so the main session's prefix cache and its
    # ``cache_control`` breakpoints still match (SPEC §7); ``system`` is their text.
    system_blocks: tuple[dict[str, Any], ...] = ()


def _posted_system_blocks(system: object) -> tuple[dict[str, Any], ...]:
    """A snapshot's ``system`` when it is a non-empty list of text blocks, as posted; else ()."""
    if isinstance(system, (list, tuple)) and system and all(_is_text_block(b) for b in system):
        return tuple(dict(b) for b in system)
    return ()


def _is_text_block(block: object) -> bool:
    return isinstance(block, Mapping) and block.get("type") == "text" and isinstance(block.get("text"), str)


# slots: plans build thousands of groups, and slotted instances are smaller and quicker to make.
@dataclass(frozen=True, slots=True)
class MessageGroup:
    """A run of messages that must stay together, ``messages[start:end]`` (:func:`group_messages`);
    ``tokens`` is its estimate, envelopes included."""

    start: int
    end: int
    tokens: int
    has_tool_calls: bool
    unanswered_calls: int = 0
    orphan_results: int = 0


def _text_of(content: object) -> str:
    """Plain text of a system message's content (string, or text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "\n".join(_part_text(part) for part in content)
    return compact_json(content)


def _part_text(part: object) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping) and isinstance(part.get("text"), str):
        return str(part["text"])
    return compact_json(part)


def _content_blocks(content: object) -> list[Any]:
    """OpenAI message content as a list of canonical blocks (empty text dropped)."""
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, (list, tuple)):
        # OpenAI text parts are already {"type": "text", "text"}; other parts (images, audio) are
        # kept as they came and estimated from their JSON.
        return list(content)
    return [content]


# The decoder json.loads uses, called directly: loads adds a BOM check, two whitespace regex scans
# and an end check, which cost twice the parse itself for a small arguments object.
# typeshed types make_scanner's argument as a scanner, but it reads the decoder's options (duck typed).
_scan_json: Final = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _parse_json(text: str) -> Any:
    """``json.loads(text)``, by the decoder alone for text that is exactly one JSON object (``{`` …
    ``}``, no whitespace around it); json.loads decides (and words) the rest."""
    if text.startswith("{") and text.endswith("}"):
        try:
            parsed, end = _scan_json(text, 0)
            if end == len(text):
                return parsed
        except (StopIteration, ValueError):
            pass
    return json.loads(text)


def _tool_input(arguments: object) -> Any:
    """An OpenAI ``arguments`` JSON string as a tool_use ``input`` object; arguments that are not a
    JSON object are kept verbatim under ``"_arguments"``, so nothing sent is lost or invented."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            parsed = _parse_json(arguments)
        except ValueError:
            return {"_arguments": arguments}
        return parsed if isinstance(parsed, dict) else {"_arguments": arguments}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    return {"_arguments": arguments}


def _tool_use_block(call: object) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry as a canonical ``tool_use`` block."""
    # isinstance(dict) first: the Mapping ABC check is slower and JSON input is always dicts.
    if not (isinstance(call, dict) or isinstance(call, Mapping)):
        return {"type": "tool_use", "id": "", "name": "", "input": {"_arguments": call}}
    function = call.get("function")
    if not (isinstance(function, dict) or isinstance(function, Mapping)):
        function = {}
    return {
        "type": "tool_use",
        "id": str(call.get("id") or ""),
        "name": str(function.get("name") or ""),
        "input": _tool_input(function.get("arguments")),
    }


def normalize_messages_with_system(messages: Sequence[Mapping[str, Any]]) -> tuple[str | None, list[Message]]:
    """Canonical messages plus the text of any system messages found among them (joined by a blank
    line); consecutive ``role: tool`` messages become ONE user message of ``tool_result`` blocks."""
    system_parts: list[str] = []
    result: list[Message] = []
    # The user message currently being filled by consecutive role:tool messages, if any.
    open_results: list[Any] | None = None
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) or isinstance(message, Mapping)):
            raise ValueError(f"message {index} is not an object")
        role = message.get("role")
        if role == "tool":
            content = message.get("content")
            if not isinstance(content, str):
                content = "" if content is None else _content_blocks(content)
            block = {
                "type": "tool_result",
                "tool_use_id": str(message.get("tool_call_id") or ""),
                "content": content,
            }
            if open_results is None:
                open_results = []
                result.append({"role": "user", "content": open_results, POSTED_FORM: {"messages": []}})
            open_results.append(block)
            result[-1][POSTED_FORM]["messages"].append(message)
            result[-1][POSTED_FORM]["blocks"] = len(open_results)
            continue
        open_results = None
        if role in _SYSTEM_ROLES:
            text = _text_of(message.get("content"))
            if text:
                system_parts.append(text)
            continue
        if role == "assistant" and "tool_calls" in message:
            calls = message.get("tool_calls") or []
            blocks = _content_blocks(message.get("content"))
            if isinstance(calls, (list, tuple)):
                blocks.extend(map(_tool_use_block, calls))
            result.append(
                {
                    "role": "assistant",
                    "content": blocks,
                    POSTED_FORM: {"messages": [message], "blocks": len(blocks)},
                }
            )
            continue
        result.append(message if isinstance(message, dict) else dict(message))
    return "\n\n".join(system_parts) or None, result


def _normalize_tool(tool: object) -> dict[str, Any]:
    """An OpenAI function tool as ``{name, description, input_schema}``; others unchanged."""
    if not isinstance(tool, Mapping):
        raise ValueError("a tool schema is not an object")
    function = tool.get("function")
    if tool.get("type") == "function" and isinstance(function, Mapping):
        converted: dict[str, Any] = {"name": str(function.get("name") or "")}
        if function.get("description") is not None:
            converted["description"] = function["description"]
        parameters = function.get("parameters")
        converted["input_schema"] = (
            dict(parameters) if isinstance(parameters, Mapping) else {"type": "object", "properties": {}}
        )
        converted[POSTED_FORM] = dict(tool)
        return converted
    return tool if isinstance(tool, dict) else dict(tool)


def _tool_name(tool: object) -> object:
    if not isinstance(tool, Mapping):
        return None
    function = tool.get("function")
    if tool.get("type") == "function" and isinstance(function, Mapping):
        return function.get("name")
    return tool.get("name")


def snapshot_shape_problem(snapshot: Mapping[str, Any]) -> str | None:
    """What makes a posted snapshot one no provider would take, or normalising would lose silently (list:
    docs/budget.md), or None. Checked when storing a snapshot, not reading one (accepted before the rule)."""
    taken_at = snapshot.get("taken_at")
    if taken_at is not None and not _is_timestamp(taken_at):
        return "taken_at is not an ISO 8601 time (like 2026-11-29T10:00:00Z)"
    tools = snapshot.get("tools")
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not _named(_tool_name(tool)):
            return f"tools[{index}] has no name"
    messages = snapshot.get("messages")
    for index, message in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(message, Mapping):
            continue
        where = f"messages[{index}]"
        role = message.get("role")
        if role not in _KNOWN_ROLES:
            return f"{where} has no known role (user, assistant, system, developer, tool, function)"
        if role == "tool" and not _named(message.get("tool_call_id")):
            return f"{where} (role tool) has no tool_call_id"
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            return f"{where}.tool_calls is not a list"
        if "content" not in message and not calls:
            return f"{where} has no content"
        for at, call in enumerate(calls if isinstance(calls, list) else ()):
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(call, Mapping) and not (
                isinstance(function, Mapping) and _named(function.get("name"))
            ):
                return f"{where}.tool_calls[{at}] has no name"
        problem = _blocks_problem(message.get("content"), f"{where}.content")
        if problem is not None:
            return problem
    return None


# The roles a main session's transcript can hold (Anthropic's two, OpenAI's, its legacy "function").
_KNOWN_ROLES: Final = frozenset({"user", "assistant", "system", "developer", "tool", "function"})


def _is_timestamp(value: object) -> bool:
    if not isinstance(value, str) or not value:
        return False
    try:
        datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value)
    except ValueError:
        return False
    return True


def _named(name: object) -> bool:
    return isinstance(name, str) and bool(name)


def _blocks_problem(content: object, where: str) -> str | None:
    """A content list's first block without a ``type`` (an object), or ``tool_use`` without a name —
    also inside a ``tool_result``'s own content list."""
    for at, block in enumerate(content if isinstance(content, list) else ()):
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if not isinstance(kind, str):
            return f"{where}[{at}] has no type"
        if kind == "tool_use" and not _named(block.get("name")):
            return f"{where}[{at}] has no name"
        if kind == "tool_result":
            inner = _blocks_problem(block.get("content"), f"{where}[{at}].content")
            if inner is not None:
                return inner
    return None


def normalize_snapshot(snapshot: Mapping[str, Any]) -> NormalizedSnapshot:
    """A snapshot (either style) in canonical form: its ``system`` then the text of any system
    messages, joined by a blank line (None when there is none)."""
    inline_system, messages = normalize_messages_with_system(snapshot.get("messages") or [])
    parts = [text for text in (_text_of(snapshot.get("system")), inline_system) if text]
    raw_tools = snapshot.get("tools") or []
    tools = [_normalize_tool(tool) for tool in raw_tools] if isinstance(raw_tools, (list, tuple)) else []
    return NormalizedSnapshot(
        system="\n\n".join(parts) if parts else None,
        tools=tools,
        messages=messages,
        context_window=positive_setting(snapshot.get("context_window")),
        max_output_tokens=positive_setting(snapshot.get("max_output_tokens")),
        system_blocks=() if inline_system else _posted_system_blocks(snapshot.get("system")),
    )


def tool_use_ids(message: Mapping[str, Any]) -> list[str]:
    """Ids of the ``tool_use`` blocks of an assistant message (empty for anything else)."""
    if message.get("role") != "assistant":
        return []
    return _block_ids(message.get("content"), "tool_use", "id")


def pending_tool_ids(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Ids of the tool calls of a trailing assistant message, which no message can answer yet (a
    snapshot taken mid-tool): empty when the last message is anything else."""
    return tool_use_ids(messages[-1]) if messages else []


def tool_result_text(
    content: Any,
    *,
    other_block: Callable[[Mapping[str, Any]], str],
    other_value: Callable[[Any], str],
) -> str:
    """A ``tool_result``'s content as plain text, text blocks joined by lines. Callers say how a
    non-text block and a content of another type read: the wire and the transcript label them apart."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
        for block in content:
            if isinstance(block, Mapping) and block.get("type") == "text":
                pieces.append(str(block.get("text", "")))
            elif isinstance(block, Mapping):
                pieces.append(other_block(block))
            else:
                pieces.append(str(block))
        return "\n".join(pieces)
    return other_value(content)


def tool_result_ids(message: Mapping[str, Any]) -> list[str]:
    return _block_ids(message.get("content"), "tool_result", "tool_use_id")


def _block_ids(content: object, kind: str, key: str) -> list[str]:
    """``block[key]`` (as text, missing → "") of every block of type ``kind`` in ``content``."""
    if not isinstance(content, list):
        return []
    ids: list[str] = []
    for block in content:
        if (isinstance(block, dict) or isinstance(block, Mapping)) and block.get("type") == kind:
            value = block.get(key)
            ids.append(value if isinstance(value, str) else str(value or ""))
    return ids


def group_messages(
    messages: Sequence[Mapping[str, Any]], message_tokens: Sequence[int] | None = None
) -> list[MessageGroup]:
    """Partition canonical ``messages`` into contiguous groups that a cut must not split: an assistant
    message with ``tool_use`` blocks and the messages answering its calls, every other message alone
    (broken transcripts: docs/budget.md). ``message_tokens`` (of each message) saves estimating twice."""
    count = len(messages)
    if message_tokens is None:
        message_tokens = [estimate_message(message) for message in messages]
    elif len(message_tokens) != count:
        raise ValueError("message_tokens must have one entry per message")
    # One pass, reading each message once: a plan groups thousands of messages (and _block_ids skips
    # string content, most of them, without a scan).
    groups: list[MessageGroup] = []
    index = 0
    while index < count:
        message = messages[index]
        content = message.get("content")
        calls = _block_ids(content, "tool_use", "id") if message.get("role") == "assistant" else []
        if not calls:
            orphans = len(_block_ids(content, "tool_result", "tool_use_id"))
            groups.append(MessageGroup(index, index + 1, message_tokens[index], False, 0, orphans))
            index += 1
            continue
        pending = set(calls)
        end = index + 1
        orphans = 0
        while end < count and pending:
            results = _block_ids(messages[end].get("content"), "tool_result", "tool_use_id")
            answered = [result for result in results if result in pending]
            if not answered:
                break
            orphans += len(results) - len(answered)
            pending.difference_update(answered)
            end += 1
        groups.append(MessageGroup(index, end, sum(message_tokens[index:end]), True, len(pending), orphans))
        index = end
    return groups
