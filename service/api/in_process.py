"""What the API tells a worker that runs in the same process (``sidequest serve``), typed: the API
never imports the worker, :mod:`service.serve` fills these hooks in (docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.applications import Starlette

from service.budget.prepared import PreparedSnapshot


@dataclass
class InProcessWorker:
    """Hooks into this process's worker; each None when there is none."""

    # A snapshot the API stored, prepared (its content hash, the preparation): the worker keeps it,
    # so neither the question it came with nor its background job reads it back from PostgreSQL.
    snapshot_prepared: Callable[[str, PreparedSnapshot], None] | None = None
    # A snapshot whose background summary the API will soon queue: the worker renders its material meanwhile.
    snapshot_job_expected: Callable[[PreparedSnapshot], None] | None = None


def in_process_worker(app: Starlette) -> InProcessWorker:
    """The app's hooks (made by ``create_app``)."""
    hooks: InProcessWorker = app.state.in_process_worker
    return hooks
