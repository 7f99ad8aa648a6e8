"""Hypothesis strategies shared by the budget tests: mixed-script text and tool-using transcripts."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Fragments that stress byte counting and splitting: CJK, 4-byte emoji, ZWJ sequences, flags,
# combining marks, CRLF and plain ASCII.
FRAGMENTS = [
    "hello",
    " world",
    "中文",
    "上下文压缩",
    "😀",
    "👨\u200d👩\u200d👧",
    "👍🏽",
    "🇯🇵",
    "e\u0301",
    "a\u0308\u0301",
    "\r\n",
    "\n",
    "x" * 40,
    "字" * 30,
]

mixed_text = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join),
    st.text(max_size=200),
)


@st.composite
def transcripts(draw: st.DrawFn, *, well_formed: bool, openai_style: bool = False) -> list[dict[str, Any]]:
    """A transcript of user / assistant / tool-call turns.

    ``well_formed`` transcripts answer every call right after it; otherwise orphan results and
    unanswered calls are mixed in. ``openai_style`` emits OpenAI ``tool_calls`` / ``role: tool``.
    """
    kinds = ["user", "assistant", "tools"] + ([] if well_formed else ["orphan", "unanswered"])
    turns = draw(st.lists(st.sampled_from(kinds), max_size=25))
    messages: list[dict[str, Any]] = []
    next_id = 0
    for kind in turns:
        text = draw(mixed_text)
        if kind in ("user", "assistant"):
            messages.append({"role": kind, "content": text})
            continue
        if kind == "orphan":
            if openai_style:
                messages.append({"role": "tool", "tool_call_id": "missing", "content": text})
            else:
                messages.append(
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "missing", "content": text}],
                    }
                )
            continue
        calls = draw(st.integers(min_value=1, max_value=3))
        ids = [f"call_{next_id + k}" for k in range(calls)]
        next_id += calls
        inputs = [{"q": draw(mixed_text)} for _ in ids]
        if openai_style:
            messages.append(
                {
                    "role": "assistant",
                    "content": text or None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "grep", "arguments": json.dumps(args, ensure_ascii=False)},
                        }
                        for call_id, args in zip(ids, inputs, strict=True)
                    ],
                }
            )
        else:
            blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
            blocks += [
                {"type": "tool_use", "id": call_id, "name": "grep", "input": args}
                for call_id, args in zip(ids, inputs, strict=True)
            ]
            messages.append({"role": "assistant", "content": blocks})
        if kind == "unanswered":
            continue
        results = [draw(mixed_text) for _ in ids]
        if openai_style:
            messages.extend(
                {"role": "tool", "tool_call_id": call_id, "content": result}
                for call_id, result in zip(ids, results, strict=True)
            )
        else:
            # Results may come in one user message or spread over several consecutive ones.
            split = draw(st.booleans())
            result_blocks = [
                {"type": "tool_result", "tool_use_id": call_id, "content": result}
                for call_id, result in zip(ids, results, strict=True)
            ]
            if split:
                messages.extend({"role": "user", "content": [block]} for block in result_blocks)
            else:
                messages.append({"role": "user", "content": result_blocks})
    return messages
