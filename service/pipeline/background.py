"""Background summary jobs (SPEC §6.6; docs/pipeline.md, "Background summary jobs" and "Single
flight"): the same summaries as a request's stages, made before anyone asks — a ``qa_fold`` of the Q&A
up to ``through_ordinal``, a ``context_summary`` of a snapshot as a question on it would compact it. A
job's failure never fails a request: a waiting request makes the summary itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from service.budget import HISTORY_BATCH_SIZE, Calibration, CutRefusal
from service.budget.ladder import NONE, SUMMARY, decide, snapshot_room
from service.pipeline.calibration import CalibrationBook
from service.pipeline.failures import database_gone, error_object
from service.pipeline.history import folded_context_time
from service.pipeline.prepare import choose_models, parse_cache, parse_qa_summary, plan_numbers, text_setting
from service.pipeline.recorder import JobRecorder
from service.pipeline.runtime import DEADLINE_GRACE_S, MASKED_MATERIAL, PipelineDeps
from service.store import jobs, memory
from service.store.execute import committed, transaction
from service.store.history import iter_history
from service.summary.context import compact_snapshot
from service.summary.material import QAPair
from service.summary.policy import SummaryCallBudget
from service.summary.rolling import fold_qa
from service.summary.runner import SummaryRunner
from service.vocabulary import (
    JobKind,
    Status,
    TerminalStatus,
    masks_tool_results,
    session_cleared_error,
    snapshot_missing_error,
    utc_iso,
)

log = logging.getLogger(__name__)

# A job's summary runner for a window and safety margin (a fold's are the session's, a snapshot's its own).
RunnerFactory = Callable[[int, int], SummaryRunner]


@dataclasses.dataclass
class JobOutcome:
    """How a job ended for this worker."""

    # "lost": nothing written; the job is not ours any more, or the database is away (its lease ends).
    status: TerminalStatus | Literal["lost"]
    calls: int = 0
    covered: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    # What a succeeded job saves (``qa_summary`` or ``context_summary``), in its end's transaction.
    summary: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


async def run_job(deps: PipelineDeps, job: jobs.ClaimedJob) -> JobOutcome:
    """Run one claimed background job to its end (cancellation propagates to the caller)."""
    timeout = deps.settings.background_timeout_s
    deadline = time.monotonic() + timeout
    budget = SummaryCallBudget(deps.settings.max_summary_calls)
    try:
        if job.cleared:  # the claim read the session: cleared (or gone) since the job was queued
            return await _end(deps, job, JobOutcome(Status.CANCELLED, error=session_cleared_error()))
        models = choose_models(deps.settings, job.settings, None, deps.provider.default_model)
        book = CalibrationBook(deps.db, deps.settings.provider, enabled=deps.settings.calibration_on)
        calibration = await book.snapshot(models.summary)

        recorder = JobRecorder(deps.db, job.id)

        def runner(window: int, margin: int) -> SummaryRunner:
            return SummaryRunner(
                provider=deps.provider,
                model=models.summary,
                request_id=str(job.id),
                recorder=recorder,
                on_attempt=recorder.attempt_started,
                deadline=deadline,
                budget=budget,
                window=window,
                safety_margin=margin,
                job_id=str(job.id),
                parallelism=deps.settings.summary_parallelism,
                instructions=text_setting(job.settings, "summary_instructions"),
                calibration=calibration,
                on_sample=book.sample,
                material_variant=MASKED_MATERIAL if masks_tool_results(job.settings) else None,
            )

        async with asyncio.timeout(timeout + DEADLINE_GRACE_S):
            if job.kind == JobKind.QA_FOLD:
                outcome = await _qa_fold(deps, job, runner)
            else:
                # The fit is decided as a question's would be: the answer model's learned ratio (§5.1).
                fit = calibration if models.answer == models.summary else await book.snapshot(models.answer)
                outcome = await _context_summary(deps, job, runner, fit)
        outcome.calls = budget.calls_made
        return await _end(deps, job, outcome)
    except Exception as exc:
        if database_gone(exc, deadline):
            log.info(
                "background job %s (%s): the database went away; its lease brings it back", job.id, job.kind
            )
            return JobOutcome("lost", calls=budget.calls_made)
        error = error_object(exc, stage=job.kind, timeout_s=timeout, what="the background job")
        log.info("background job %s (%s) failed: %s", job.id, job.kind, error["code"])
        return await _end(deps, job, JobOutcome(Status.FAILED, calls=budget.calls_made, error=error))


async def _end(deps: PipelineDeps, job: jobs.ClaimedJob, outcome: JobOutcome) -> JobOutcome:
    """The job's summary (if it made one) and its terminal state, in one commit (§6.5's guard first:
    a job whose session was cleared, or that is no longer this worker's, writes nothing)."""
    assert outcome.status != "lost", "a lost outcome writes nothing; here one is found by the writes below"
    async with deps.db.connection() as conn, transaction(conn):
        if outcome.summary and not await memory.save_memory(
            conn, job.id, owner=job.owner, job=True, **outcome.summary
        ):
            return JobOutcome("lost", calls=outcome.calls)
        written = await jobs.finish_job(
            conn,
            job.id,
            job.owner,
            status=outcome.status,
            calls=outcome.calls,
            covered=outcome.covered,
            error=outcome.error,
        )
    if written:
        deps.waiter.notify()  # this process's waiting requests at once; others hear NOTIFY sidequest_jobs
    return outcome if written else JobOutcome("lost", calls=outcome.calls)


async def _qa_fold(deps: PipelineDeps, job: jobs.ClaimedJob, runner: RunnerFactory) -> JobOutcome:
    through = int(job.params.get("through_ordinal") or 0)
    qa = parse_qa_summary(job.memory.get("qa_summary"))
    covered = qa.covered_through_ordinal if qa else 0
    if through <= covered:
        return JobOutcome(
            Status.SUCCEEDED, covered={"covered_through_ordinal": covered, "reason": "already_covered"}
        )
    pairs: list[QAPair] = []
    async for batch in iter_history(
        deps.db,
        job.session_id,
        before_ordinal=through + 1,
        after_ordinal=covered,
        clear_version=job.clear_version,
    ):
        pairs.extend(QAPair(r.ordinal, r.question, r.answer, utc_iso(r.created_at)) for r in batch)
    if not pairs:
        return JobOutcome(
            Status.SUCCEEDED, covered={"covered_through_ordinal": covered, "reason": "nothing_to_fold"}
        )
    plan = plan_numbers(deps.settings, job.settings, {}, None)
    batches = [pairs[i : i + HISTORY_BATCH_SIZE] for i in range(0, len(pairs), HISTORY_BATCH_SIZE)]
    context_time = await folded_context_time(deps.db, job.session_id, qa, batches, job.clear_version)
    folded = await fold_qa(runner(plan.window, plan.safety_margin), qa, batches, context_time)
    assert folded is not None
    folded = dataclasses.replace(folded, made_by="background")
    return JobOutcome(
        Status.SUCCEEDED,
        covered={"covered_through_ordinal": folded.covered_through_ordinal},
        summary={"qa_summary": folded.to_json()},
    )


async def _context_summary(
    deps: PipelineDeps, job: jobs.ClaimedJob, runner: RunnerFactory, fit: Calibration
) -> JobOutcome:
    snapshot_id = str(job.params.get("snapshot_id") or "")
    snapshot = await deps.snapshots.load(deps.db, job.session_id, snapshot_id, job.snapshot_hash)
    if snapshot is None:
        return JobOutcome(Status.FAILED, error=snapshot_missing_error())
    # A 6.7 follow-up carries its question's window and cap; a snapshot's job the ones the trigger
    # expected (the session's settings, else its latest question's).
    plan = plan_numbers(deps.settings, job.settings, job.params, snapshot)
    mask = masks_tool_results(job.settings)
    # The learned ratio decides every fit (SPEC §5.1); the admission queued the job on the raw estimate.
    decision = decide(snapshot, snapshot_room(snapshot, fit.raw_capacity(plan.input_budget)), mask=mask)
    if isinstance(decision, CutRefusal):
        return JobOutcome(Status.SUCCEEDED, covered={"covered_messages": 0, "reason": decision.reason})
    if decision.tier != SUMMARY:
        # A question on it needs no summary (it fits, or masking alone makes it fit): none is made.
        reason = "not_needed" if decision.tier == NONE else "masking_is_enough"
        return JobOutcome(Status.SUCCEEDED, covered={"covered_messages": 0, "reason": reason})
    until = snapshot.boundary(decision.summarize_until)
    summarizer = runner(plan.window, plan.safety_margin)
    key = snapshot.cache_key(until, summarizer.model, summarizer.prompt_version)
    cache = parse_cache(job.memory.get("context_summaries") or [])
    if any(entry.key == key for entry in cache):
        return JobOutcome(Status.SUCCEEDED, covered={"covered_messages": until, "reason": "cached"})
    async with deps.db.connection() as conn, committed(conn):
        if not await jobs.take_key(conn, job.id, key):
            # A request (or a job for the same content under another id) is making it right now.
            return JobOutcome(
                Status.SUCCEEDED, covered={"covered_messages": until, "reason": "made_elsewhere"}
            )
    started = time.monotonic()
    result = await compact_snapshot(
        summarizer, snapshot_id, snapshot, until, cache, snapshot.taken_at, masked=mask
    )
    # Never a hit: an entry under this key returned "cached" above.
    assert result.new_entry is not None
    log.info("background context summary for %s took %.1fs", snapshot_id, time.monotonic() - started)
    return JobOutcome(
        Status.SUCCEEDED,
        covered={"covered_messages": until, "cache": result.cache, "chunks": result.chunks},
        summary={"context_summary": dataclasses.replace(result.new_entry, made_by="background").to_json()},
    )
