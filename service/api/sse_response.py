"""sse-starlette's EventSourceResponse with a cheaper per-send timeout: instead of a timer per message
(a third of an event's delivery cost, docs/benchmarks.md), one :class:`SendWatchdog` per app cancels a
send pending too long, which then fails with sse-starlette's own ``SendTimeoutError``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.types import Message, Send

# How often an idle stream sends a comment (proxies close silent connections), and how long one send
# may wait for the client's socket before the stream ends.
PING_S = 15.0
SEND_TIMEOUT_S = 30.0
WATCHDOG_TICK_S = 1.0
# The watchdog task ends after this many idle ticks and starts again with the next send.
WATCHDOG_IDLE_TICKS = 30


@dataclass(slots=True, eq=False)
class _Pending:
    task: asyncio.Task[object]
    deadline: float
    expired: bool = False


class SendWatchdog:
    """Cancels sends that outlive their deadline (one task, on the loop of the latest send, checking
    every tick while any send is pending; it ends after a while without one)."""

    def __init__(self) -> None:
        self._pending: set[_Pending] = set()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def enter(self, timeout: float) -> _Pending:
        task = asyncio.current_task()
        assert task is not None  # a send runs in the connection's task
        loop = asyncio.get_running_loop()
        entry = _Pending(task, loop.time() + timeout)
        self._pending.add(entry)
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._task = loop.create_task(self._run(), name="sidequest-sse-send-watchdog")
        return entry

    def leave(self, entry: _Pending) -> None:
        self._pending.discard(entry)

    async def _run(self) -> None:
        idle = 0
        loop = asyncio.get_running_loop()
        while idle < WATCHDOG_IDLE_TICKS:
            await asyncio.sleep(WATCHDOG_TICK_S)
            idle = 0 if self._pending else idle + 1
            now = loop.time()
            for entry in list(self._pending):
                if not entry.expired and now >= entry.deadline:
                    entry.expired = True
                    entry.task.cancel()


class StreamResponse(EventSourceResponse):
    """An EventSourceResponse whose send timeout a :class:`SendWatchdog` keeps: the app's, or its own."""

    def __init__(self, *args: Any, watchdog: SendWatchdog | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watchdog = watchdog if watchdog is not None else SendWatchdog()

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is None:
            await send(message)
            return
        entry = self._watchdog.enter(self.send_timeout)
        try:
            await send(message)
        except asyncio.CancelledError:
            if not entry.expired:
                raise
            entry.task.uncancel()  # the watchdog's cancel, turned into the timeout it stands for
            raise SendTimeoutError() from None
        finally:
            self._watchdog.leave(entry)
