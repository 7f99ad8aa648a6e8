"""The worker: slots, claim loop, heartbeats, cancellation, recovery sweep (SPEC §9)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from service.config import Settings
from service.store.db import Database, connect
from service.store.listener import Listener
from service.worker.runner import Worker

log = logging.getLogger(__name__)


async def start_worker(settings: Settings, db: Database, *, listener: Listener | None = None) -> Worker:
    """Start a worker on ``db`` in the running event loop; ``await handle.stop()`` to stop it.
    ``listener``: the process's LISTEN connection when the API holds one (``serve``)."""
    worker = Worker(settings, db, listener=listener)
    await worker.start()
    return worker


async def _serve_until_signalled(settings: Settings, database_url: str) -> None:
    db = connect(
        database_url, pool_size=max(5, settings.max_concurrency + 3), pooler=settings.database_pooler
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # not on every platform
            loop.add_signal_handler(signum, stop.set)
    try:
        # Building the worker may raise (its provider, its listener's URL): the pool is closed then too.
        worker = Worker(settings, db, database_url=database_url)
        try:
            await worker.start()
            await stop.wait()
            log.info("signal received: stopping the worker")
        finally:
            await worker.stop()
    finally:
        # The loop may outlive this call (a caller's own runner): its signals go back to it.
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(signum)
        await db.dispose()


def run_worker_forever(settings: Settings, database_url: str) -> None:
    """Run a worker process until SIGINT or SIGTERM (``sidequest worker``), on uvloop's loop when installed (a
    dependency everywhere but Windows), as uvicorn's ``loop="auto"`` picks it for the API."""
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve_until_signalled(settings, database_url))
