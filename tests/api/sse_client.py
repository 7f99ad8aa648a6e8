"""A small SSE reader for tests: parses `id:`, `event:`, `data:`, `retry:` and comments."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Message:
    """One SSE message (or a comment-only block, then ``event`` is None and ``comment`` set)."""

    id: str | None = None
    event: str | None = None
    data: str = ""
    retry: int | None = None
    comments: list[str] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.data)


async def messages(response: httpx.Response) -> AsyncIterator[Message]:
    """Messages of a streaming response, as they arrive."""
    current = Message()
    data_lines: list[str] = []
    touched = False
    async for line in response.aiter_lines():
        if line == "":
            if touched:
                current.data = "\n".join(data_lines)
                yield current
            current, data_lines, touched = Message(), [], False
            continue
        touched = True
        if line.startswith(":"):
            current.comments.append(line[1:].strip())
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            current.id = value
        elif name == "event":
            current.event = value
        elif name == "data":
            data_lines.append(value)
        elif name == "retry":
            current.retry = int(value)
    if touched:
        current.data = "\n".join(data_lines)
        yield current


async def events(response: httpx.Response) -> AsyncIterator[Message]:
    """Only real events (skip pings and the retry hint)."""
    async for message in messages(response):
        if message.event is not None:
            yield message
