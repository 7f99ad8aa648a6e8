"""The FastAPI application factory. Tests build their own app with ``create_app(settings, url)``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from service.config import Settings
from service.store.db import Database, connect, current_revision, head_revision

log = logging.getLogger(__name__)


def create_app(settings: Settings, database_url: str, *, run_worker: bool = False) -> FastAPI:
    """Build the app. ``run_worker`` also runs the worker inside this process (``sidequest serve``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = connect(database_url)
        app.state.db = db
        app.state.settings = settings
        worker = None
        if run_worker:
            from service.worker import start_worker

            worker = await start_worker(settings, db)
        try:
            yield
        finally:
            if worker is not None:
                await worker.stop()
            await db.dispose()

    app = FastAPI(title="Sidequest", version="0.1.0", lifespan=lifespan)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz() -> JSONResponse:
        """Readiness: the database answers and its schema is at the head revision."""
        db: Database = app.state.db
        head = head_revision()
        try:
            current = await current_revision(db)
        except Exception as exc:  # any driver error means "not ready", never a 500
            return JSONResponse(
                {"status": "unavailable", "database": "unreachable", "detail": str(exc)[:200]},
                status_code=503,
            )
        if current != head:
            return JSONResponse(
                {"status": "unavailable", "database": "reachable", "schema": current, "head": head},
                status_code=503,
            )
        return JSONResponse({"status": "ok", "schema": current})

    return app
