"""The stage functions chained, claim to terminal state (SPEC §6–8; docs/pipeline.md, "One request")."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, cast

from service.aio import all_or_first_failure
from service.budget.chunk import SUMMARY_MAX_TOKENS
from service.pipeline.answer import answer, build_answer, meter
from service.pipeline.compaction import ContextPlan, compact_snapshot_copy, record_fidelity
from service.pipeline.failures import RequestLost, database_gone, error_object
from service.pipeline.history import HistoryPlan, fold_history, plan_history
from service.pipeline.prepare import prepare
from service.pipeline.runtime import DEADLINE_GRACE_S, PipelineDeps, RequestRuntime
from service.store import queue, terminal
from service.store.execute import transaction
from service.vocabulary import Stage, Status


async def _execute(rt: RequestRuntime) -> dict[str, Any]:
    """The stages wired together; the request's ``done`` record."""
    prepared = await prepare(rt)
    rt.enter(Stage.ORGANIZING_HISTORY)
    history = await plan_history(rt, prepared)
    context = ContextPlan()  # the whole snapshot verbatim
    folding = bool(history.replay.fold)
    provisional = build_answer(prepared, history, context)
    meter(rt, prepared, provisional)
    # While a fold runs beside the compaction decision, the summary it will produce is counted at its
    # largest valid size (the body limit plus room for the provenance header), so the decision holds.
    bound = SUMMARY_MAX_TOKENS if folding and history.qa is None else 0

    def fits(candidate: ContextPlan) -> bool:
        estimate = build_answer(prepared, history, candidate).estimate.total
        return rt.calibration.fits(estimate + bound, prepared.plan.input_budget)

    # The transcript's room: the budget in raw tokens (scaled back by the learned ratio) less everything else.
    snapshot_tokens = context.kept_tokens(prepared.snapshot)
    room = rt.calibration.raw_capacity(prepared.plan.input_budget) - (
        provisional.estimate.total - snapshot_tokens + bound
    )
    # Tier none of the ladder: the transcript fits the room the ladder plans in (exactly the
    # calibrated fit of the whole request, since raw_capacity is the inverse of that fit).
    needs_compaction = snapshot_tokens > room

    async def compaction() -> ContextPlan:
        rt.enter(Stage.COMPACTING_CONTEXT)
        return await compact_snapshot_copy(rt, prepared, fits, room) or context

    # A fold that found its range taken by a background job re-plans the history: the answer is
    # built from the plan it returns, which holds that job's summary.
    if folding and needs_compaction:
        made, folded = await all_or_first_failure([compaction(), fold_history(rt, prepared, history)])
        context, history = cast(ContextPlan, made), cast(HistoryPlan, folded)
    elif folding:
        history = await fold_history(rt, prepared, history)
    elif needs_compaction:
        context = await compaction()
    request = build_answer(prepared, history, context)
    meter(rt, prepared, request)
    record_fidelity(rt, prepared.snapshot, context)
    rt.enter(Stage.ANSWERING)

    return await answer(rt, prepared, history, context, request)


@dataclass(frozen=True)
class Outcome:
    """How a request ended for this worker: ``succeeded``, ``failed`` or ``lost`` (nothing written: not ours
    any more, or the database away)."""

    status: str
    error: dict[str, Any] | None = None


async def run_request(deps: PipelineDeps, claimed: queue.Claimed) -> Outcome:
    """Run one claimed request to its terminal state. A cancellation propagates (after the in-flight
    call was recorded as ``cancelled``) for the worker to settle; any other failure is written here."""
    rt = RequestRuntime(deps, claimed)
    try:
        async with asyncio.timeout(deps.settings.request_timeout_s + DEADLINE_GRACE_S):
            await _execute(rt)
        return Outcome(Status.SUCCEEDED)
    except RequestLost:
        return Outcome("lost")
    except Exception as exc:
        if database_gone(exc, rt.deadline):
            # Write nothing: the lease expires and the sweep runs the request again (or fails it
            # worker_lost) once PostgreSQL is back.
            return Outcome("lost")
        error = error_object(exc, stage=rt.info.stage, timeout_s=rt.timeout_s)
        with contextlib.suppress(Exception):  # best effort: the failure itself is what must land
            await rt.flush()  # the stages it reached come before its end (after a background flush)
        async with rt.db.connection() as conn, transaction(conn):
            ended = await terminal.finish_request(
                conn,
                rt.claimed.id,
                status=Status.FAILED,
                owner=rt.owner,
                error=error,
                model=rt.answer_model,
                context_info=rt.info.to_json(),
            )
        return Outcome(Status.FAILED if ended else "lost", error=error)
