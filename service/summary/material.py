"""What gets summarised, as text: side Q&A pairs and snapshot transcript messages.

Both are rendered one *piece* per group (one Q&A pair, one message group), so the chunker can prefer to
cut between groups and only falls back to lines inside a group that alone is too large.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from service.budget import tool_result_text


@dataclass(frozen=True)
class QAPair:
    """One earlier, successful side question and its answer."""

    ordinal: int
    question: str
    answer: str
    created_at: str | None = None


def render_qa_pair(pair: QAPair) -> str:
    """One Q&A pair as summary material / replay text, labelled with its ordinal."""
    when = f" (asked {pair.created_at})" if pair.created_at else ""
    return f"### Side question #{pair.ordinal}{when}\nQ: {pair.question.strip()}\nA: {pair.answer.strip()}\n"


def _json(value: Any) -> str:
    # ensure_ascii=False keeps Chinese as UTF-8 (its real byte size) instead of 6-byte \\u escapes.
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def render_message(index: int, message: Mapping[str, Any]) -> str:
    """One canonical snapshot message as transcript text, labelled with its index in the snapshot."""
    lines = [f"[message {index} · {message.get('role', '?')}]"]
    content = message.get("content")
    if isinstance(content, str):
        lines.append(content)
    elif isinstance(content, list):
        for block in content:
            if not isinstance(block, dict):
                lines.append(str(block))
                continue
            kind = block.get("type")
            if kind == "text":
                lines.append(str(block.get("text", "")))
            elif kind == "tool_use":
                lines.append(
                    f"→ tool call {block.get('name')} (id {block.get('id')}): {_json(block.get('input', {}))}"
                )
            elif kind == "tool_result":
                flag = " (error)" if block.get("is_error") else ""
                result = tool_result_text(
                    block.get("content"),
                    other_block=lambda other: f"[{other.get('type', 'block')}]",
                    other_value=_json,
                )
                lines.append(f"← tool result for {block.get('tool_use_id')}{flag}:\n{result}")
            elif kind not in ("thinking", "redacted_thinking"):
                # Thinking is left out: the main model's private reasoning is not evidence for anyone else.
                lines.append(f"[{kind}]")
    elif content is not None:
        lines.append(_json(content))
    return "\n".join(lines) + "\n"


def render_messages(messages: Sequence[Mapping[str, Any]], start: int = 0) -> str:
    """Consecutive messages as one transcript piece; ``start`` is the first message's snapshot index."""
    return "".join(render_message(start + i, m) for i, m in enumerate(messages))
