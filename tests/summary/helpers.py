"""Test helpers for the summary layer: an in-memory call recorder, a scripted server whose summary
replies can depend on the request (a tiny "summariser" that really merges), and prompt parsers."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.providers.helpers import ListRecorder
from tests.scripted_provider import RecordedRequest, ScriptedServer, Step

# The summary tests record calls exactly like the provider tests do.
MemoryRecorder = ListRecorder


Responder = Callable[[RecordedRequest], Step]


class RespondingServer(ScriptedServer):
    """The scripted server, plus per-purpose responders that build a reply from the request, and gates.

    Scripted steps still win (FIFO); a responder replaces the purpose's default when the queue is
    empty. Relies on ``_route`` picking the step synchronously, before its first await, so the request
    being routed is the one stored here (one event loop, no interleaving in between).

    Every request's start and end is logged in order (:meth:`peak_in_flight`), and a :meth:`gate`
    holds matching requests until enough of them are in flight at once: a way to prove calls overlap
    without measuring wall-clock time (a gate that is never reached counts in ``gate_timeouts``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._responders: dict[str, Responder] = {}
        self._routing: RecordedRequest | None = None
        # (request, +1 at its start / -1 at its end), in the order they happened on the server loop.
        self.flight_log: list[tuple[RecordedRequest, int]] = []
        self._gates: list[_Gate] = []
        self.gate_timeouts = 0

    def respond(self, purpose: str, responder: Responder) -> None:
        self._responders[purpose] = responder

    def gate(
        self, count: int, match: Callable[[RecordedRequest], bool] = lambda _: True, timeout_s: float = 10.0
    ) -> None:
        """Hold every ``match``-ing request until ``count`` of them are in flight at once; from then on
        the gate stays open. After ``timeout_s`` a held request goes on and ``gate_timeouts`` grows."""
        self._gates.append(_Gate(count, match, timeout_s))

    def in_flight(self, match: Callable[[RecordedRequest], bool]) -> int:
        return sum(delta for request, delta in self.flight_log if match(request))

    def peak_in_flight(self, match: Callable[[RecordedRequest], bool] = lambda _: True) -> int:
        """The most ``match``-ing requests that were ever in flight at the same time."""
        now = peak = 0
        for request, delta in list(self.flight_log):
            if match(request):
                now += delta
                peak = max(peak, now)
        return peak

    async def _route(self, request: RecordedRequest, reader: Any, writer: Any) -> None:
        self.flight_log.append((request, 1))
        try:
            for gate in self._gates:
                if gate.match(request) and not gate.opened:
                    await self._wait_at(gate)
            self._routing = request
            await super()._route(request, reader, writer)
        finally:
            self.flight_log.append((request, -1))

    async def _wait_at(self, gate: _Gate) -> None:
        deadline = time.monotonic() + gate.timeout_s
        while self.in_flight(gate.match) < gate.count and not gate.opened:
            if time.monotonic() > deadline:
                self.gate_timeouts += 1
                return
            await asyncio.sleep(0.005)
        gate.opened = True

    def _next_step(self, purpose: str | None) -> Step:
        key = purpose or "answer"
        if self.pending(key) == 0 and key in self._responders and self._routing is not None:
            return self._responders[key](self._routing)
        return super()._next_step(purpose)


@dataclass
class _Gate:
    count: int
    match: Callable[[RecordedRequest], bool]
    timeout_s: float
    opened: bool = False


# ---- reading our own prompts back out of recorded requests --------------------------------------------


def prompt_of(request: RecordedRequest) -> str:
    """The user prompt text of a summary call (the last message; content is a string)."""
    content = request.body["messages"][-1]["content"]
    assert isinstance(content, str)
    return content


def is_merge(request: RecordedRequest) -> bool:
    """Whether a summary call is a merge (parallel mode) rather than a chunk."""
    return "<partial_summaries>\n" in prompt_of(request)


def is_chunk(request: RecordedRequest) -> bool:
    """Whether a request is a summary call over material (not a merge, not an answer)."""
    return request.purpose in ("qa_summary", "context_summary") and not is_merge(request)


_PART = re.compile(r'<summary part="(\d+)">\n(.*?)\n</summary>\n', re.DOTALL)


def merge_parts_of(request: RecordedRequest) -> list[str]:
    """The document bodies a merge call carried, in the order it numbered them (checked: 1, 2, …)."""
    text = prompt_of(request)
    block = text[text.index("<partial_summaries>\n") : text.index("</partial_summaries>")]
    parts = _PART.findall(block)
    assert [int(number) for number, _ in parts] == list(range(1, len(parts) + 1))
    return [body for _, body in parts]


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


def parallel_summariser(request: RecordedRequest) -> Step:
    """:func:`merging_summariser` for chunks, and for merges a model that does what the merge prompt
    asks: every part's decisions, in part order (so merge order is visible in the result)."""
    if not is_merge(request):
        return merging_summariser(request)
    decisions = [item for body in merge_parts_of(request) for item in _decisions(body)]
    document = {
        "objective": "Answer side questions about the main task.",
        "state": f"Merged {len(merge_parts_of(request))} parts.",
        "decisions": decisions[-32:],
        "open_work": [],
        "risks": [],
    }
    return Step.valid_summary(document, chunks=2)


def summary_json(**overrides: Any) -> str:
    document = {"objective": "o", "state": "s", "decisions": [], "open_work": [], "risks": []}
    document.update(overrides)
    return json.dumps(document, ensure_ascii=False)
