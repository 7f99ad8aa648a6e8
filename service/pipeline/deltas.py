"""Coalescing streamed answer text into ``delta`` events (SPEC §4: at most ~20 per second)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from service.aio import wait_event

# 50 ms between flushes → at most 20 delta events per second, whatever the model's token rate.
FLUSH_INTERVAL_S = 0.05


class DeltaCoalescer:
    """Buffers text and writes it as one ``delta`` event per interval from a background flusher.
    ``emit(text)`` writes one event; False: the request is no longer held (then nothing more is written)."""

    def __init__(self, emit: Callable[[str], Awaitable[bool]]) -> None:
        self._emit = emit
        self._buffer: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._lost = False
        # One writer at a time, so text reaches the log in the order it streamed.
        self._write_lock = asyncio.Lock()

    async def add(self, text: str) -> None:
        """Take one text delta from the provider (never blocks on the database)."""
        if not text:
            return
        self._buffer.append(text)
        if self._task is None:
            self._task = asyncio.create_task(self._flusher(), name="sidequest-delta-flusher")

    async def flush(self) -> None:
        """Write buffered text now (e.g. before the call's ``usage`` event, so text comes first)."""
        async with self._write_lock:
            if not self._buffer or self._lost:
                return
            text = "".join(self._buffer)
            self._buffer.clear()
            if not await self._emit(text):
                self._lost = True

    async def _flusher(self) -> None:
        # Never cancelled mid-write by a close: it sets the flag and waits, so no text is dropped; the
        # rest is then the closer's (written by close(), handed over by close_rest()).
        while not await wait_event(self._closing, FLUSH_INTERVAL_S):
            await self.flush()

    async def close_rest(self) -> str | None:
        """Stop the flusher and return the text not yet written instead of writing it: the caller
        writes it with the request's success, in the same commit (None when nothing is left)."""
        await self._stop_flusher()
        async with self._write_lock:
            text = "".join(self._buffer) if not self._lost else ""
            self._buffer.clear()
        return text or None

    async def close(self) -> None:
        """Stop the flusher and write what is left (before the terminal event)."""
        await self._stop_flusher()
        await self.flush()

    async def _stop_flusher(self) -> None:
        self._closing.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def abort(self) -> None:
        """Stop the flusher without writing (the request was cancelled or lost)."""
        self._buffer.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
