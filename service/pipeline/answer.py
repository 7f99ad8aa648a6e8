"""Stage ``answering`` (SPEC §7): the answer request's layout, the one streaming call, the overflow
retry, and the success write with its follow-up background jobs."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from service import vocabulary
from service.budget import (
    RECENT_BUDGET_TOKENS,
    CutRefusal,
    QAItem,
    WindowPlan,
    overflow_target,
    plan_cut,
    plan_window,
    pressure,
    prompt_drift,
    recent_budget_within,
)
from service.budget.chunk import SUMMARY_MAX_TOKENS
from service.budget.trail import TRAIL_MAX_TOKENS
from service.context_info import EstimateInfo
from service.pipeline.compaction import (
    ContextPlan,
    compact,
    record_compaction,
    record_fidelity,
    snapshot_job_key,
)
from service.pipeline.deltas import DeltaCoalescer
from service.pipeline.failures import PipelineFailure, RequestLost
from service.pipeline.history import HistoryPlan, fold_history, fold_key, next_fold, qa_group_tokens
from service.pipeline.prepare import Prepared
from service.pipeline.runtime import RequestRuntime, cancelled
from service.providers.base import ContextOverflow, ProviderCall, ProviderError
from service.providers.calling import CallResult, run_call
from service.store import terminal
from service.store.calibration import Sample
from service.store.db import is_unavailable
from service.store.execute import transaction
from service.summary.material import QAPair
from service.summary.prompts import AnswerRequest, build_answer_request
from service.vocabulary import JobKind


def build_answer(prepared: Prepared, history: HistoryPlan, context: ContextPlan) -> AnswerRequest:
    snap = prepared.snapshot
    return build_answer_request(
        question=prepared.claimed.question,
        system=snap.snapshot.system if snap else None,
        system_blocks=snap.snapshot.system_blocks if snap else (),
        tools=snap.snapshot.tools if snap else (),
        messages=context.kept_messages(snap),
        messages_tokens=context.kept_tokens(snap),
        context_summary=context.summary.prompt_text() if context.summary else None,
        qa_summary=history.qa.rendered() if history.qa else None,
        replayed=history.replayed,
        context_time=prepared.context_time,
    )


def meter(rt: RequestRuntime, prepared: Prepared, answer: AnswerRequest) -> None:
    rt.info.estimate = EstimateInfo(**answer.estimate.as_dict())
    rt.info.pressure = pressure(answer.estimate.total, prepared.plan.input_budget)  # type: ignore[assignment]


def stated_plan(prepared: Prepared, context_limit: int | None) -> WindowPlan:
    """For an overflow retry: the provider's stated window when smaller than the planned one (none configured:
    200 000 assumed, a local model's 32 768 stated), sizing the retry and its summary calls for the model that
    answers; else the request's own — also when the output cap leaves the stated window no input budget: a
    server counting only the prompt against its window (llama.cpp) may still take the shrunk one."""
    if context_limit is None or context_limit >= prepared.plan.window:
        return prepared.plan
    stated = plan_window(context_limit, prepared.plan.max_output_tokens)
    return stated if stated.input_budget > 0 else prepared.plan


async def answer(
    rt: RequestRuntime,
    prepared: Prepared,
    history: HistoryPlan,
    context: ContextPlan,
    request: AnswerRequest,
) -> dict[str, Any]:
    """Stream the answer; on a first-reply overflow shrink once and retry; write the success."""
    # The stage changes and notes so far, in one commit, written while the call starts.
    rt.flush_in_background()
    deltas = DeltaCoalescer(rt.emit_delta)

    async def before_usage() -> None:
        await rt.flushed()
        await deltas.flush()

    rt.recorder.before_usage = before_usage
    rt.recorder.hold_purpose = "answer"  # its successful call is written with the success (_finish)
    try:
        try:
            result = await _call(rt, prepared, request, deltas)
        except ContextOverflow as exc:
            # SPEC 7: only a first reply that streamed nothing (no text, no tool call: the calling policy's
            # after_output) is retried, once: the retry's overflow is raised from this handler, not caught.
            if exc.after_output:
                raise
            if exc.prompt_tokens:
                # The error states the prompt's real count: a calibration sample (SPEC §5.1).
                await rt.book.sample(prepared.models.answer, request.estimate.total, exc.prompt_tokens)
            if exc.output_fills_window:
                raise  # the provider says the output cap alone fills its window: no prompt would fit
            await rt.progress(vocabulary.overflow_retry(estimate_before=request.estimate.total))
            plan = stated_plan(prepared, exc.context_limit)
            target: int | None = None
            if exc.prompt_tokens:
                # …and the size to shrink to, instead of a guess.
                target = overflow_target(plan.input_budget, request.estimate.total, exc.prompt_tokens)
            elif plan is not prepared.plan:
                target = plan.input_budget  # a stated window without a count: fit its budget
            # Sized for a smaller window the provider stated: the retry's summary calls too, since sized
            # for the planned window they could be larger than the whole window the model has.
            planned = prepared if plan is prepared.plan else dataclasses.replace(prepared, plan=plan)
            shrunk = await _shrink(rt, planned, history, context, request, target)
            if shrunk is None:
                raise PipelineFailure(
                    "context_overflow",
                    "the prompt does not fit the window and cannot be made smaller: " + exc.message,
                    {
                        "status": exc.status,
                        "message": exc.message,
                        "estimate": request.estimate.total,
                        "input_budget": prepared.plan.input_budget,
                    },
                ) from exc
            # What follows (the fidelity, the success, its follow-up jobs) is of the shrunk prompt.
            history, context, request = shrunk
            record_fidelity(rt, prepared.snapshot, context)
            rt.info.overflow_retries = 1
            meter(rt, prepared, request)
            await rt.save_info()
            await rt.progress(vocabulary.overflow_retry(estimate_after=request.estimate.total, retry=1))
            result = await _call(rt, prepared, request, deltas)
    except BaseException as exc:
        with contextlib.suppress(RequestLost):  # lost meanwhile: the held call is still written
            await deltas.abort() if cancelled() else await deltas.close()
        await rt.recorder.write_held()
        if isinstance(exc, ProviderError) and not isinstance(exc, ContextOverflow):
            # A failed answer call that reported its prompt tokens is a sample too (SPEC §5.1).
            await rt.book.sample(prepared.models.answer, request.estimate.total, exc.reported_prompt_tokens)
        raise
    finally:
        rt.recorder.before_usage = None
        rt.recorder.hold_purpose = None
    rest = await deltas.close_rest()
    sample = rt.book.pending(prepared.models.answer, request.estimate.total, result.prompt_tokens)
    try:
        return await _finish(rt, prepared, history, context, request, result, rest, sample)
    except BaseException:
        # Refused before the success was written (a tool call, an empty answer): what it would have
        # carried is written on its own — the text, the call (tokens were spent), the sample. Once
        # the success was attempted, the call is no longer held: that transaction wrote them or not.
        if rt.recorder.held is not None:
            if rest and not cancelled():
                try:
                    await rt.emit_delta(rest)
                except Exception as lost:
                    # Lost, or the database away: the call is still written (tokens were spent).
                    if not (isinstance(lost, RequestLost) or is_unavailable(lost)):
                        raise
            await rt.recorder.write_held()
            if sample is not None:
                await rt.book.sample(sample.model, sample.estimate, sample.reported_prompt_tokens)
        raise


async def _shrink(
    rt: RequestRuntime,
    prepared: Prepared,
    history: HistoryPlan,
    context: ContextPlan,
    current: AnswerRequest,
    target: int | None,
) -> tuple[HistoryPlan, ContextPlan, AnswerRequest] | None:
    """Overflow recovery's one shrink: fold the replayed Q&A, then compact harder. None: nothing to do.
    ``target``: the raw estimate to reach when the provider stated the prompt's real count (SPEC §5.1)."""
    changed = False
    if history.replay.replay:
        history.replay = dataclasses.replace(
            history.replay,
            replay=(),
            fold=history.replay.replay,
            fold_batches=(history.replay.replay,),
            replay_tokens=0,
        )
        history = await fold_history(rt, prepared, history)
        changed = True
    snapshot = prepared.snapshot
    if snapshot is not None and context.kept_from < len(snapshot.messages):
        # Keep half of what is kept now (never more than the default recent budget), and accept any
        # non-empty old part: the provider already said the prompt is too long.
        kept_tokens = context.kept_tokens(snapshot)
        recent_budget = min(RECENT_BUDGET_TOKENS, kept_tokens) // 2
        if target is not None:
            around = build_answer(prepared, history, context).estimate.total - kept_tokens
            # The summary of the longer old part can be larger than today's, so a retry sized on
            # today's could land over the stated count: sized at its largest, the retry fits.
            room = max(0, SUMMARY_MAX_TOKENS - (context.summary.tokens if context.summary is not None else 0))
            if prepared.mask_tool_results:
                room += TRAIL_MAX_TOKENS  # the new summary's trail, at its largest
            recent_budget = recent_budget_within(target - around - room)
        cut = plan_cut(snapshot.groups, recent_budget=recent_budget, min_summarized_tokens=0)
        if isinstance(cut, CutRefusal):
            await rt.progress(vocabulary.compaction_refused(cut.reason, cut.explanation))
        elif context.summary is not None and cut.summarize_until <= context.kept_from:
            await rt.progress(vocabulary.compaction_refused("no_further_cut"), defer=True)
        else:
            context = await compact(rt, prepared, cut.summarize_until, masked=prepared.mask_tool_results)
            record_compaction(rt, context, snapshot)
            changed = True
    if not changed:
        return None
    shrunk = build_answer(prepared, history, context)
    return (history, context, shrunk) if shrunk.estimate.total < current.estimate.total else None


async def _call(
    rt: RequestRuntime, prepared: Prepared, request: AnswerRequest, deltas: DeltaCoalescer
) -> CallResult:
    call = ProviderCall(
        model=prepared.models.answer,
        messages=request.messages,
        max_output_tokens=prepared.plan.max_output_tokens,
        purpose="answer",
        request_id=str(rt.claimed.id),
        system=request.system,
        system_blocks=request.system_blocks,
        tools=request.tools,
    )
    # Its calibration sample (SPEC §5.1) is written with the success (answer()).
    return await run_call(
        rt.deps.provider,
        call,
        recorder=rt.recorder,
        deadline=rt.deadline,
        on_text=deltas.add,
    )


def follow_ups(
    rt: RequestRuntime, prepared: Prepared, history: HistoryPlan, context: ContextPlan, own: QAItem
) -> tuple[terminal.FollowUp, ...]:
    """Background jobs this success makes worthwhile (SPEC §6.6), when background summaries are on."""
    if not rt.deps.settings.background_on:
        return ()
    jobs: list[terminal.FollowUp] = []
    fold = next_fold(history, own, prepared.plan.input_budget)
    if fold:
        params = {"through_ordinal": fold[-1], "ordinals": list(fold)}
        jobs.append(terminal.FollowUp(JobKind.QA_FOLD, fold_key(fold), params))
    snapshot_id = prepared.claimed.snapshot_id
    if context.extend_later and snapshot_id is not None:
        # The job plans with this question's window and cap (its own, or the session's), so the
        # summary it extends is the one the next question like it needs.
        params = {
            "snapshot_id": snapshot_id,
            "context_window": prepared.plan.window,
            "max_output_tokens": prepared.plan.max_output_tokens,
        }
        jobs.append(terminal.FollowUp(JobKind.CONTEXT_SUMMARY, snapshot_job_key(snapshot_id), params))
    return tuple(jobs)


async def _finish(
    rt: RequestRuntime,
    prepared: Prepared,
    history: HistoryPlan,
    context: ContextPlan,
    request: AnswerRequest,
    result: CallResult,
    rest: str | None,
    sample: Sample | None,
) -> dict[str, Any]:
    """Check the reply and write the success with the answer's tail (the text not yet written as a
    ``delta``, the held answer call, the calibration sample) in one commit."""
    rt.info.provider_prompt_tokens = result.prompt_tokens
    rt.info.drift = prompt_drift(request.estimate.total, result.prompt_tokens)
    if result.tool_calls or result.stop_reason == "tool_calls":
        name = result.tool_calls[0].name if result.tool_calls else None
        raise PipelineFailure(
            "answer_tool_call",
            f"the model tried to call a tool ({name or 'unnamed'}) although side answers have none",
            {"tool": name, "stop_reason": result.stop_reason},
        )
    if not result.text and not result.truncated:
        filtered = result.stop_reason == "content_filter"
        raise PipelineFailure(
            "provider_error",
            "the provider's content filter (or the model's refusal) stopped the answer before any text"
            if filtered
            else "the model returned an empty answer",
            {
                "status": None,
                "message": "stopped by a content filter" if filtered else "empty answer",
                "stop_reason": result.stop_reason,
                "raw_stop_reason": result.raw_stop_reason,
            },
        )
    claimed = rt.claimed
    own = QAItem(
        claimed.ordinal,
        qa_group_tokens(QAPair(claimed.ordinal, claimed.question, result.text, claimed.created_at)),
    )
    await rt.flushed()  # the stage events the call started with come before the success
    # Taken only now: until this commit, a failure above writes them on its own (answer()).
    call = rt.recorder.take_held()
    try:
        async with rt.db.connection() as conn, transaction(conn):
            record = await terminal.finish_succeeded(
                conn,
                claimed.id,
                rt.owner,
                answer=result.text,
                truncated=result.truncated,
                stop_reason=result.stop_reason,
                model=prepared.models.answer,
                context_info=rt.info.to_json(),
                qa_tokens=own.tokens,
                follow_ups=follow_ups(rt, prepared, history, context, own),
                tail=terminal.AnswerTail(rest, call, sample),
            )
    except Exception as exc:
        if is_unavailable(exc):
            # The database went away before the success was written (a dropped connection is the
            # usual case, refused before anything ran): the call's tokens were spent, so it is held
            # again and answer() writes it on its own; the request is run again (SPEC §9).
            rt.recorder.held = call
        raise
    if record is None:
        raise RequestLost()
    return record
