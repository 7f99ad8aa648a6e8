"""Test helpers for the summary layer: an in-memory call recorder, a scripted server whose summary
replies can depend on the request (a tiny "summariser" that really merges), and prompt parsers."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from tests.providers.helpers import ListRecorder
from tests.scripted_provider import RecordedRequest, ScriptedServer, Step

# The summary tests record calls exactly like the provider tests do.
MemoryRecorder = ListRecorder


Responder = Callable[[RecordedRequest], Step]


class RespondingServer(ScriptedServer):
    """The scripted server, plus per-purpose responders that build a reply from the request.

    Scripted steps still win (FIFO); a responder replaces the purpose's default when the queue is
    empty. Relies on ``_route`` picking the step synchronously, before its first await, so the request
    being routed is the one stored here (one event loop, no interleaving in between).
    """

    def __init__(self) -> None:
        super().__init__()
        self._responders: dict[str, Responder] = {}
        self._routing: RecordedRequest | None = None

    def respond(self, purpose: str, responder: Responder) -> None:
        self._responders[purpose] = responder

    async def _route(self, request: RecordedRequest, reader: Any, writer: Any) -> None:
        self._routing = request
        await super()._route(request, reader, writer)

    def _next_step(self, purpose: str | None) -> Step:
        key = purpose or "answer"
        if self.pending(key) == 0 and key in self._responders and self._routing is not None:
            return self._responders[key](self._routing)
        return super()._next_step(purpose)


# ---- reading our own prompts back out of recorded requests --------------------------------------------


def prompt_of(request: RecordedRequest) -> str:
    """The user prompt text of a summary call (the last message; content is a string)."""
    content = request.body["messages"][-1]["content"]
    assert isinstance(content, str)
    return content


def material_of(request: RecordedRequest) -> str:
    """The material a summary call carried."""
    text = prompt_of(request)
    start = text.index("<material>\n") + len("<material>\n")
    end = text.rindex("\n</material>")
    return text[start:end]


def previous_of(request: RecordedRequest) -> str | None:
    """The previous summary body shown to an update call, or None for a fresh summary."""
    text = prompt_of(request)
    if "<previous_summary>\n" not in text:
        return None
    start = text.index("<previous_summary>\n") + len("<previous_summary>\n")
    return text[start : text.index("\n</previous_summary>")]


def output_cap_of(request: RecordedRequest) -> int:
    body = request.body
    return int(body.get("max_tokens") or body.get("max_completion_tokens"))


def _decisions(body: str | None) -> list[str]:
    """The ``Decisions:`` items of a rendered summary body."""
    if body is None:
        return []
    items: list[str] = []
    inside = False
    for line in body.splitlines():
        if line == "Decisions:":
            inside = True
            continue
        if inside and not line.startswith("- "):
            break
        if inside and line != "- (none)":
            items.append(line[2:])
    return items


_FACT = re.compile(r"FACT: ([^\n]+)")


def merging_summariser(request: RecordedRequest) -> Step:
    """A deterministic stand-in model that does what the update prompt asks: it keeps the previous
    summary's decisions and adds every ``FACT: …`` line of the new material (newest kept if over 32)."""
    previous = previous_of(request)
    material = material_of(request)
    decisions = _decisions(previous) + _FACT.findall(material)
    document = {
        "objective": "Answer side questions about the main task.",
        "state": f"Summarised {len(material)} more characters.",
        "decisions": decisions[-32:],
        "open_work": [],
        "risks": [],
    }
    return Step.valid_summary(document, chunks=2)


def summary_json(**overrides: Any) -> str:
    document = {"objective": "o", "state": "s", "decisions": [], "open_work": [], "risks": []}
    document.update(overrides)
    return json.dumps(document, ensure_ascii=False)
