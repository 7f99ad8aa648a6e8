"""Read a streaming httpx response as Server-Sent Events, with the client's parser (one SSE parser)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from service.client.sse import SseMessage, SseParser


async def messages(response: httpx.Response) -> AsyncIterator[SseMessage]:
    """Every block of a streaming response as it arrives: events, pings and the retry hint."""
    parser = SseParser()
    async for line in response.aiter_lines():
        message = parser.feed(line)
        if message is not None:
            yield message


async def events(response: httpx.Response) -> AsyncIterator[SseMessage]:
    """Only real events (skip pings and the retry hint)."""
    async for message in messages(response):
        if message.event is not None:
            yield message
