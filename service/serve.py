"""``sidequest serve``: the API app with a worker in its lifespan, sharing the app's pool and its one
LISTEN connection (docs/architecture.md). The API never imports the worker: this entry point composes
the two.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from service.api.app import create_app
from service.api.in_process import in_process_worker
from service.config import Settings
from service.worker import start_worker


def create_serving_app(settings: Settings, database_url: str) -> FastAPI:
    """The app ``sidequest serve`` runs: :func:`create_app` with its lifespan wrapped so that a worker
    runs inside it (``app.state.worker`` while it runs)."""
    app = create_app(settings, database_url)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(running: FastAPI) -> AsyncIterator[Any]:
        async with inner(running) as state:
            worker = await start_worker(settings, running.state.db, listener=running.state.listener)
            running.state.worker = worker
            hooks = in_process_worker(running)
            # The API hands each snapshot it stores, prepared, to the worker of this process, and
            # tells it of a snapshot whose background summary it will queue: the worker renders the
            # summary's material while the API waits on the database (the job is likely ours).
            hooks.snapshot_prepared = worker.snapshots.put
            hooks.snapshot_job_expected = worker.snapshots.warm
            try:
                yield state
            finally:
                hooks.snapshot_prepared = hooks.snapshot_job_expected = None
                await worker.stop()

    app.router.lifespan_context = lifespan
    return app
