"""What one running side request carries through its stages: its I/O, never its decisions, every write
a client can see lease-guarded (docs/pipeline.md, "One request" and "Guarded writes").
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.budget import Calibration
from service.config import Settings
from service.context_info import ContextInfo
from service.pipeline.calibration import CalibrationBook
from service.pipeline.failures import RequestLost
from service.pipeline.recorder import LedgerRecorder
from service.pipeline.snapshots import PreparedSnapshots
from service.pipeline.waiting import JobWaiter
from service.providers.base import Provider
from service.store import lease, memory, queue
from service.store.db import Database
from service.store.execute import committed, transaction
from service.store.ledger import merge_context_info
from service.summary.policy import SummaryCallBudget
from service.summary.runner import SummaryRunner
from service.vocabulary import Status, utc_iso

if TYPE_CHECKING:  # the stages import this module
    from service.pipeline.prepare import Prepared

# The material variant of a summary of masked groups (SPEC §6.8), part of its cache key: a change to the
# masking rules bumps it, so no summary of differently masked material is reused.
MASKED_MATERIAL = "masked-1"
# A request's or a job's outer safety net fires this long after its deadline: the calling policy's own
# deadline (which records the in-flight call as failed) should always win; this only catches a stuck DB step.
DEADLINE_GRACE_S = 1.0


@dataclass
class PipelineDeps:
    """What one worker process gives every request (and background job) it runs."""

    db: Database
    settings: Settings
    provider: Provider
    # Wakes requests waiting for a background job (the worker feeds it from NOTIFY sidequest_jobs).
    waiter: JobWaiter = field(default_factory=JobWaiter)
    # Immutable prepared snapshots this worker used last (no request re-reads a 600 KB preparation).
    snapshots: PreparedSnapshots = field(default_factory=PreparedSnapshots)


class RequestRuntime:
    """The I/O of one claimed request: events, stage, context_info, ledger, call budget, deadline."""

    def __init__(self, deps: PipelineDeps, claimed: queue.Claimed) -> None:
        self.deps = deps
        self.claimed = claimed
        self.db = deps.db
        self.owner = claimed.owner  # this claim's lease owner: a stale run's writes are refused
        self.timeout_s = deps.settings.request_timeout_s
        self.deadline = time.monotonic() + self.timeout_s
        self.info = ContextInfo.starting(claimed.attempt)
        self.recorder = LedgerRecorder(deps.db, claimed.id, claimed.owner)
        self.budget = SummaryCallBudget(deps.settings.max_summary_calls)
        self.book = CalibrationBook(deps.db, deps.settings.provider, enabled=deps.settings.calibration_on)
        # Events between two slow steps, written together (see :meth:`flush`).
        self._pending: list[tuple[str, dict[str, Any]]] = []
        self._pending_stage: str | None = None
        self._flush_lock = asyncio.Lock()
        self._background_flush: asyncio.Future[None] | None = None
        # SPEC §5.1: the learned ratio per (provider, model), as it stood when the request was prepared.
        self.calibration = Calibration.empty()
        # The answer model once `preparing` chose it (SPEC §11.2): a failed record names it too.
        self.answer_model: str | None = None
        self.summary_calibration = Calibration.empty()

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def progress(self, fields: dict[str, Any], *, defer: bool = False) -> None:
        """One ``progress`` event (lease-guarded). ``defer``: written with the next flush — for a note
        about something already done, when nothing slow comes before the next write."""
        # ``at`` is when it happened, not when its batch is written (the inspector's stage timeline).
        self._pending.append(("progress", {"stage": self.info.stage, **fields, "at": utc_iso()}))
        if not defer:
            await self.flush()

    def enter(self, stage: str) -> None:
        """Move to ``stage``: its ``status`` event and the context_info so far, written with the next
        flush (at the latest right before the next slow step: a model call or a wait)."""
        self.info.stage = stage
        self._pending.append(("status", {"status": Status.RUNNING, "stage": stage, "at": utc_iso()}))
        self._pending_stage = stage

    async def flush(self) -> None:
        """Write the pending events (and the stage change, with context_info) in one transaction."""
        # Under the lock, batches commit in the order made (a fold and a compaction may write at once).
        async with self._flush_lock:
            if not self._pending:
                return
            events, stage = self._pending, self._pending_stage
            self._pending, self._pending_stage = [], None
            async with self.db.connection() as conn, committed(conn):
                if not await lease.emit_if_held(
                    conn,
                    self.claimed.id,
                    self.owner,
                    events,
                    stage=stage,
                    context_info=self.info.to_json() if stage is not None else None,
                ):
                    raise RequestLost()

    def flush_in_background(self) -> None:
        """Start :meth:`flush` and return at once (docs/pipeline.md, step 4): whatever must come after
        the flushed events waits for it in :meth:`flushed`; later flushes queue behind it on the lock."""
        task = asyncio.ensure_future(self.flush())
        # Retrieved here so an outcome nobody awaited (the call failed first) is not reported as
        # "never retrieved"; awaiting the task still raises it.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._background_flush = task

    async def flushed(self) -> None:
        """Wait for the background flush, if one was started (raising :class:`RequestLost` as it did)."""
        if self._background_flush is not None:
            await self._background_flush

    async def save_info(self) -> None:
        """Store context_info as it stands (not lease-guarded: it is metadata of what was done)."""
        await self.flushed()  # never overtaken by the older context_info a background flush carries
        async with self.db.sessions() as session, session.begin():
            await merge_context_info(session, self.claimed.id, self.info.to_json())

    async def load_memory(self) -> dict[str, Any]:
        async with self.db.connection() as conn:
            return await memory.load_memory(conn, self.claimed.session_id)

    async def save_memory(self, **summary: dict[str, Any]) -> None:
        """Save a summary to the session's memory, lease-guarded (:class:`RequestLost` when refused)."""
        async with self.db.connection() as conn, transaction(conn):
            if not await memory.save_memory(conn, self.claimed.id, owner=self.owner, job=False, **summary):
                raise RequestLost()

    async def emit_delta(self, text: str) -> bool:
        """One ``delta`` event (after the background flush); False when the request is no longer held."""
        await self.flushed()
        async with self.db.connection() as conn, committed(conn):
            return await lease.emit_if_held(conn, self.claimed.id, self.owner, [("delta", {"text": text})])

    def summary_runner(self, prepared: Prepared) -> SummaryRunner:
        """A fresh runner (its own ``attempts_made``) on the request's shared budget and recorder, one
        per concurrent summary (a fold and a compaction may run at once)."""
        return SummaryRunner(
            provider=self.deps.provider,
            model=prepared.models.summary,
            request_id=str(self.claimed.id),
            recorder=self.recorder,
            deadline=self.deadline,
            budget=self.budget,
            window=prepared.plan.window,
            safety_margin=prepared.plan.safety_margin,
            on_progress=self.progress,
            parallelism=self.deps.settings.summary_parallelism,
            instructions=prepared.summary_instructions,
            calibration=self.summary_calibration,
            on_sample=self.book.sample,
            material_variant=MASKED_MATERIAL if prepared.mask_tool_results else None,
        )

    def sync_calls(self) -> None:
        self.info.summary_calls = self.budget.calls_made


def cancelled() -> bool:
    """Whether the current task is being cancelled (versus failing)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
