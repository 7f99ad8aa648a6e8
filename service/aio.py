"""asyncio helpers the shell's layers share (stdlib only)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Collection, Iterable
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait until ``event`` is set or ``seconds`` passed; whether it is set. The one way this code
    waits for an event: on Python 3.11 ``asyncio.wait_for(event.wait(), timeout)`` *returns* when the
    task is cancelled at the moment the event is set (CPython gh-86296), and a loop cancelled on
    shutdown runs on; ``asyncio.timeout`` tells its own cancellation from anyone else's."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(max(0.0, seconds)):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()


async def all_or_first_failure(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Run ``awaitables`` at once; their results in order, or the first failure raised as it came, once
    the others are cancelled and have ended (their own cleanup, a recorded attempt say, has run).

    Not a ``TaskGroup``: there, a child's error raised while the children are being cancelled replaces
    the caller's own cancellation; here a cancelled caller stays cancelled."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    if not tasks:
        return []
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # a task that has ended ignores it
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if task in done and not task.cancelled() and (failure := task.exception()) is not None:
            raise failure
    return [task.result() for task in tasks]


async def settle(tasks: Collection[asyncio.Task[object]], seconds: float, what: str) -> None:
    """Wait for ``tasks`` (already told to stop) to end, at most ``seconds``; log those still going.

    A shutdown must end: a task stuck on a write (a database that stopped answering) is left behind
    with a warning rather than holding the process forever — whatever it held is a lease, which
    expires, and the sweep runs its work again. Unlike ``asyncio.gather``, a stuck task does not hold
    the caller; unlike ``asyncio.wait_for``, nothing waits for a cancellation to complete.
    """
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=seconds)
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: a failure on the way out is the task's own to log
    for task in pending:
        # The line of the task's own coroutine it waits at: a suspended task's stack is that one frame
        # (not the chain of awaits below it), enough to tell which step of the task held the stop.
        frames = [f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in task.get_stack()]
        log.warning(
            "%s %s still running %.0f s after the stop; left to end on their own (at %s)",
            what,
            task.get_name(),
            seconds,
            ", ".join(frames) or "no frame",
        )
