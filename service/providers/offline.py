"""The ``offline`` provider (SPEC §1): deterministic, no network, no model, so that ``sidequest serve``
works on a fresh machine; what it answers is in docs/providers.md ("The offline provider"). Usage is
zeros with ``reported=False``: an estimate must never pass for provider usage (SPEC §7).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

from service.providers import DEFAULT_MODELS
from service.providers.base import (
    CallUsage,
    Finish,
    ProviderCall,
    ProviderEvent,
    TextDelta,
    UsageReport,
)

# Roughly 3 bytes of text per token: the offline provider's only notion of an output cap.
_BYTES_PER_TOKEN = 3
# Answer text streams in pieces of about this many characters, like a real model's deltas.
_CHUNK_CHARS = 64
# Summary bodies stay well under the 600-token (≈ 1800-byte) retry target of SPEC §6.3.
_SUMMARY_MAX_BYTES = 1500
_SUMMARY_ITEM_CHARS = 160
_SUMMARY_LIST_ITEMS = 6
_QUOTED_LINES = 3

_WORD = re.compile(r"[^\W_]+", re.UNICODE)
# Material as service.summary.material renders it: "[message 3 · user]" headers, "Q:" / "A:" pairs.
_MESSAGE_HEADER = re.compile(r"^\[message \d+ · (?P<role>[\w-]+)\]$")
_QA_HEADER = re.compile(r"^#{1,6} Side question #\d+")
_ASK_PREFIX = re.compile(r"^(?:user|human|q|question)\s*:\s*(?P<ask>\S.*)$", re.IGNORECASE)
_QUESTION_LABEL = re.compile(r"^(?:side[ _-]?)?question\s*:\s*(?P<rest>.*)$", re.IGNORECASE)
# The answer request's question block ("Side question:\n…"): the question itself, not context.
_SIDE_QUESTION_BLOCK = re.compile(r"^side question\s*:", re.IGNORECASE)
_TAGGED = r"<{tag}>\n?(?P<body>.*?)\n?</{tag}>"
# One document of a merge prompt (service.summary.prompts.merge_piece).
_MERGE_PART = re.compile(r'<summary part="\d+">\n(?P<body>.*?)\n</summary>', re.DOTALL)
# Sidequest's own instructions in the answer request (service.summary.prompts) are not context.
_INSTRUCTIONS_MARK = "[Sidequest]"
_PREVIOUS_SECTIONS = {"decisions": "decisions", "open work": "open_work", "risks": "risks"}
_DECISION = re.compile(r"decid|decision|\bchose\b|\bchosen\b|\bchoose\b|agreed", re.IGNORECASE)
_OPEN_WORK = re.compile(r"\btodo\b|\bnext\b|remaining|still need|follow[- ]up|pending", re.IGNORECASE)
_RISK = re.compile(r"error|fail|risk|exception|traceback|broken|warning", re.IGNORECASE)
_LISTED = {"decisions": _DECISION, "open_work": _OPEN_WORK, "risks": _RISK}
_NOTHING = "(no material to summarise)"
# Words too common to say anything about relevance.
_STOPWORDS = frozenset(
    """a an and are as at be been but by can could did do does for from had has have how i if in into is
    it its me my no not of on or our so than that the their them then there these they this to up was we
    were what when where which who why will with would you your about after again all also any just more
    most should some such only other over same very""".split()
)


class OfflineProvider:
    """Deterministic extractive summaries and quoting answers, without any network."""

    def __init__(self, default_model: str = DEFAULT_MODELS["offline"]) -> None:
        self.default_model = default_model

    async def aclose(self) -> None:
        """Nothing to release."""

    async def stream(self, call: ProviderCall) -> AsyncGenerator[ProviderEvent, None]:
        """Stream the reply for ``call``; never raises a provider error."""
        if call.purpose == "answer":
            text = compose_answer(call.messages)
        else:
            text = json.dumps(summarise(call.messages), ensure_ascii=False)
        cap_bytes = max(1, call.max_output_tokens) * _BYTES_PER_TOKEN
        truncated = len(text.encode("utf-8")) > cap_bytes
        if truncated:
            text = text.encode("utf-8")[:cap_bytes].decode("utf-8", errors="ignore")
        for start in range(0, len(text), _CHUNK_CHARS):
            yield TextDelta(text[start : start + _CHUNK_CHARS])
        yield UsageReport(CallUsage(reported=False))
        stop = "length" if truncated else "stop"
        yield Finish(stop_reason=stop, raw_stop_reason=stop)


def summarise(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """An extractive summary document with exactly SPEC §6.4's keys, small enough for any retry: of
    the ``<material>`` (all the text when untagged), updating a ``<previous_summary>``; or a merge
    prompt's documents, merged in order."""
    text = "\n".join(text for message in messages for text in _texts(message.get("content")))
    material = _tagged(text, "material")
    # A merge prompt's documents (``<summary part="N">`` in ``<partial_summaries>``) have no <material>:
    # a transcript that merely quotes the merge tags is still material.
    merge_block = _tagged(text, "partial_summaries") if material is None else None
    parts = [_parse_body(match.group("body")) for match in _MERGE_PART.finditer(merge_block or "")]
    if parts:
        return _fit(_merge(parts))
    previous = _parse_body(_tagged(text, "previous_summary") or "")
    if material is None:
        material = re.sub(_TAGGED.format(tag="previous_summary"), "", text, flags=re.DOTALL)
    lines = [line.strip() for line in material.splitlines() if line.strip()]
    content = [line for line in lines if not _is_header(line)]

    objective = previous.get("objective") or _first_ask(lines) or (content[0] if content else "")
    state = " ".join(content[-2:])
    document: dict[str, Any] = {
        "objective": _clip(str(objective)) or _NOTHING,
        "state": _clip(state) or str(previous.get("state") or "") or _NOTHING,
    }
    for key, pattern in _LISTED.items():
        kept = [_clip(item) for item in previous.get(key, [])]
        document[key] = _items(kept, (_clip(line) for line in content if pattern.search(line)))
    return _fit(document)


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Parts in material order into one document: the first objective, the last state, every list
    item once in order (earlier parts' items first, so earlier conclusions are kept)."""
    objective = next((str(part["objective"]) for part in parts if part.get("objective")), "")
    state = next((str(part["state"]) for part in reversed(parts) if part.get("state")), "")
    document: dict[str, Any] = {"objective": _clip(objective) or _NOTHING, "state": _clip(state) or _NOTHING}
    for key in _LISTED:
        document[key] = _items([], (_clip(item) for part in parts for item in part.get(key, [])))
    return document


def _items(kept: list[str], added: Iterable[str]) -> list[str]:
    """``kept``, then each ``added`` item it does not hold yet, at most the list's limit."""
    items = list(kept)
    for item in added:
        if item not in items:
            items.append(item)
    return items[:_SUMMARY_LIST_ITEMS]


def _fit(document: dict[str, Any]) -> dict[str, Any]:
    """Keep the body small: drop the longest list's last item until it fits."""
    while len(json.dumps(document, ensure_ascii=False).encode("utf-8")) > _SUMMARY_MAX_BYTES:
        longest = max(_LISTED, key=lambda key: len(document[key]))
        if not document[longest]:
            document["objective"] = _clip(document["objective"], 120)
            document["state"] = _clip(document["state"], 120)
            break
        document[longest].pop()
    return document


def compose_answer(messages: list[dict[str, Any]]) -> str:
    """The offline answer: the question, then the context lines sharing the most words with it."""
    question = _question(messages)
    question_words = _words(question)
    scored: list[tuple[int, int, str]] = []
    for position, line in enumerate(dict.fromkeys(_context_lines(messages))):  # each line once
        overlap = len(question_words & _words(line))
        if overlap and line != question and not _is_header(line):
            scored.append((overlap, position, line))
    # Most shared words first; among equals the latest line, the freshest state of the work.
    scored.sort(key=lambda item: (-item[0], -item[1]))
    best = sorted(scored[:_QUOTED_LINES], key=lambda item: item[1])

    parts = [
        "This answer comes from Sidequest's offline provider: no language model was called. "
        "It quotes the context lines that share the most words with your question.",
        "",
        f"Question: {question}" if question else "Question: (none found)",
        "",
    ]
    if best:
        parts.append("Most relevant context lines:")
        parts.extend(f"> {_clip(line, 400)}" for _, _, line in best)
    else:
        parts.append("No line of the context shares a word with the question.")
    return "\n".join(parts) + "\n"


def _context_lines(messages: list[dict[str, Any]]) -> list[str]:
    """Every non-empty line of the conversation except Sidequest's own instructions and the question."""
    out: list[str] = []
    for message in messages:
        for text in _texts(message.get("content")):
            stripped = text.lstrip()
            if stripped.startswith(_INSTRUCTIONS_MARK) or _SIDE_QUESTION_BLOCK.match(stripped):
                continue
            out.extend(line.strip() for line in text.splitlines() if line.strip())
    return out


def _texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        out: list[str] = []
        for block in content:
            if isinstance(block, str):
                out.append(block)
            elif isinstance(block, Mapping):
                kind = block.get("type")
                if kind == "text":
                    out.append(str(block.get("text", "")))
                elif kind == "tool_result":
                    out.extend(_texts(block.get("content")))
                elif kind == "tool_use":
                    out.append(f"{block.get('name', 'tool')}: {json.dumps(block.get('input') or {})}")
        return out
    return [str(content)]


def _tagged(text: str, tag: str) -> str | None:
    bodies = [m.group("body") for m in re.finditer(_TAGGED.format(tag=tag), text, re.DOTALL)]
    return "\n".join(bodies) if bodies else None


def _parse_body(body: str) -> dict[str, Any]:
    """The rendered body of service.summary.document.render_body, read back into its fields."""
    found: dict[str, Any] = {key: [] for key in _LISTED}
    section: str | None = None
    for raw in body.splitlines():
        line = raw.strip()
        lowered = line.lower()
        label, colon, value = line.partition(":")
        if colon and label.lower() in ("objective", "state"):
            found[label.lower()] = value.strip()
            section = None
        elif lowered.rstrip(":") in _PREVIOUS_SECTIONS and line.endswith(":"):
            section = _PREVIOUS_SECTIONS[lowered.rstrip(":")]
        elif section and line.startswith("- ") and line != "- (none)":
            found[section].append(line[2:].strip())
    return found


def _is_header(line: str) -> bool:
    return bool(_MESSAGE_HEADER.match(line) or _QA_HEADER.match(line))


def _first_ask(lines: list[str]) -> str:
    """The first thing a user asked: the line after a "[message N · user]" header, or a "Q:" line."""
    after_user_header = False
    for line in lines:
        header = _MESSAGE_HEADER.match(line)
        if header:
            after_user_header = header.group("role") == "user"
            continue
        if after_user_header:
            return line
        ask = _ASK_PREFIX.match(line)
        if ask:
            return ask.group("ask").strip()
    return ""


def _question(messages: list[dict[str, Any]]) -> str:
    """The side question: what follows the last "Side question:" label of the last user turn, else
    that turn's last line."""
    for message in reversed(messages):
        if message.get("role") != "user":
            continue
        lines = [line.strip() for text in _texts(message.get("content")) for line in text.splitlines()]
        lines = [line for line in lines if line]
        for index in range(len(lines) - 1, -1, -1):
            label = _QUESTION_LABEL.match(lines[index])
            if label:
                return " ".join([label.group("rest"), *lines[index + 1 :]]).strip()
        if lines:
            return lines[-1]
    return ""


def _words(text: str) -> set[str]:
    words = (match.group(0).lower() for match in _WORD.finditer(text))
    return {_stem(word) for word in words if len(word) > 2 and word not in _STOPWORDS}


def _stem(word: str) -> str:
    """A crude English stem, so that "decide" meets "decided" and "rounding" meets "round"."""
    for suffix in ("ing", "ed", "es", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            break
    return word[:-1] if word.endswith("e") and len(word) > 3 else word


def _clip(text: str, limit: int = _SUMMARY_ITEM_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"
