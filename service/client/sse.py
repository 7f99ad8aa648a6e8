"""The one Server-Sent Events parser of the project (the CLI's ``ask`` and every test stream use it)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class SseMessage:
    """One block of a Server-Sent Events stream (the ``data`` lines joined by newlines). ``event`` is
    ``None`` for a block that dispatches no event (only comments, an ``id`` or a ``retry``), returned all
    the same so that a caller sees the cursor, the retry hint and the keep-alive comments. ``id`` is the
    last event id seen so far (the standard's buffer)."""

    event: str | None = "message"
    data: str = ""
    id: str | None = None
    retry_ms: int | None = None
    comments: tuple[str, ...] = ()

    def json(self) -> Any:
        return json.loads(self.data)


class SseParser:
    """Parse SSE lines (without line terminators) one at a time, per the HTML living standard: a
    block cut off by the end of the stream is never dispatched."""

    def __init__(self) -> None:
        self._last_id: str | None = None
        self._reset()

    def _reset(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._retry: int | None = None
        self._comments: list[str] = []
        self._seen_field = False

    def feed(self, line: str) -> SseMessage | None:
        """Take one line; return the block it completes (a blank line), else ``None``."""
        if line == "":
            message = None
            if self._data or self._seen_field or self._comments:
                event = (self._event or "message") if self._data else None
                data = "\n".join(self._data)
                message = SseMessage(event, data, self._last_id, self._retry, tuple(self._comments))
            self._reset()
            return message
        if line.startswith(":"):
            self._comments.append(line[1:].strip())
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        self._seen_field = True
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\x00" not in value:
            self._last_id = value
        elif name == "retry" and value.isdigit():
            self._retry = int(value)
        return None


def iter_sse(lines: Iterable[str]) -> Iterator[SseMessage]:
    """Parse SSE lines (without line terminators) into messages (see :class:`SseParser`)."""
    parser = SseParser()
    for line in lines:
        message = parser.feed(line)
        if message is not None:
            yield message
