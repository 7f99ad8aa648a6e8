"""One side request from claim to terminal state (SPEC §6–8).

Stages, in order: ``preparing`` (written by the claim) → ``organizing_history`` → ``compacting_context``
(only when the whole request exceeds the input budget) → ``answering``. Every stage change is a
``status`` event; what happens inside a stage is a ``progress`` event; every provider call is a ledger
entry plus a ``usage`` event; the answer streams as coalesced ``delta`` events; the end is
``status`` + ``done`` or ``status`` + ``error``.

No transaction is open across a model call: each database step is its own short transaction through
the store (:mod:`service.store.queue`, :mod:`service.store.ledger`, :mod:`service.store.memory`), and
every write that a client can see is guarded by the lease, so a cancelled, cleared or taken-over request
is never written again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from service.budget import (
    RECENT_BUDGET_TOKENS,
    Calibration,
    CutPlan,
    CutRefusal,
    NormalizedSnapshot,
    QAItem,
    estimate_messages,
    estimate_text,
    group_messages,
    normalize_snapshot,
    overflow_target,
    plan_cut,
    plan_window,
    pressure,
    prompt_drift,
    resolve_output_cap,
    resolve_window,
    select_replay,
)
from service.config import Settings
from service.pipeline.calibration import CalibrationBook
from service.pipeline.deltas import DeltaCoalescer
from service.pipeline.failures import PipelineFailure, RequestLost, error_object
from service.pipeline.recorder import LedgerRecorder
from service.providers.base import ContextOverflow, Provider, ProviderCall
from service.providers.calling import CallResult, run_call
from service.store import memory, queue
from service.store.db import Database, is_unavailable
from service.store.events import utc_iso
from service.store.history import RequestInput, iter_history, load_request_input, load_snapshot
from service.store.ledger import merge_context_info
from service.summary.context import CachedContextSummary, ContextCompaction, compact_context
from service.summary.document import BODY_TOKEN_LIMIT
from service.summary.material import QAPair, render_qa_pair
from service.summary.policy import SummaryCallBudget, SummaryRunner
from service.summary.prompts import AnswerRequest, build_answer_request
from service.summary.rolling import StoredQASummary, fold_qa

# The outer safety net fires this long after the request deadline: the calling policy's own deadline
# (which records the in-flight call as failed) should always win; this only catches a stuck DB step.
DEADLINE_GRACE_S = 1.0


@dataclass
class PipelineDeps:
    """What one worker process gives every request it runs."""

    db: Database
    settings: Settings
    provider: Provider
    owner: str
    clock: Callable[[], float] = time.monotonic


def _int_option(options: dict[str, Any], name: str) -> int | None:
    value = options.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class _Run:
    """The state of one request while it runs (fields mirror ``context_info``)."""

    def __init__(self, deps: PipelineDeps, claimed: queue.Claimed) -> None:
        self.deps = deps
        self.claimed = claimed
        self.db = deps.db
        self.owner = deps.owner
        self.timeout_s = deps.settings.request_timeout_s
        self.deadline = deps.clock() + self.timeout_s
        self.stage = "preparing"
        self.info: dict[str, Any] = {
            "stage": "preparing",
            "replayed_groups": 0,
            "replayed_ordinals": None,
            "qa_summary": {"used": False, "covered_through_ordinal": None, "updated": False, "calls": 0},
            "context_summary": {
                "used": False,
                "cache": "none",
                "summarized_messages": 0,
                "kept_messages": 0,
                "calls": 0,
                "chunks": 0,
            },
            "summary_calls": 0,
            "overflow_retries": 0,
            "provider_prompt_tokens": None,
            "drift": None,
            "attempt": claimed.attempt,
        }
        self.recorder = LedgerRecorder(deps.db, claimed.id, deps.owner)
        self.budget = SummaryCallBudget(deps.settings.max_summary_calls)
        # SPEC 5.1: counters per (provider, model); the snapshot is taken once, in prepare.
        self.book = CalibrationBook(deps.db, deps.settings.provider, enabled=deps.settings.calibration_on)
        self.calibration = Calibration.empty()
        # Filled in as the request is prepared.
        self.request: RequestInput | None = None
        self.snapshot: NormalizedSnapshot | None = None
        self.context_time: str | None = None
        self.model = ""
        self.input_budget = 0
        self.output_cap = 0
        self.qa: StoredQASummary | None = None
        self.replayed: list[QAPair] = []
        self.history: dict[int, QAPair] = {}
        self.context_summary: ContextCompaction | None = None
        self.kept_messages: list[dict[str, Any]] = []
        self.cache_entries: list[CachedContextSummary] = []
        self.runner: SummaryRunner | None = None

    # ---------------------------------------------------------------- writes (all lease-guarded)

    async def progress(self, fields: dict[str, Any]) -> None:
        data = {"stage": self.stage, **fields}
        async with self.db.sessions() as session:
            if not await queue.emit_if_held(session, self.claimed.id, self.owner, "progress", data):
                raise RequestLost()

    async def enter(self, stage: str) -> None:
        self.stage = stage
        self.info["stage"] = stage
        async with self.db.sessions() as session:
            if not await queue.set_stage(session, self.claimed.id, self.owner, stage, context_info=self.info):
                raise RequestLost()

    async def save_info(self) -> None:
        async with self.db.sessions() as session:
            await merge_context_info(session, self.claimed.id, self.info)

    async def emit_delta(self, text: str) -> bool:
        async with self.db.sessions() as session:
            return await queue.emit_if_held(session, self.claimed.id, self.owner, "delta", {"text": text})

    # ---------------------------------------------------------------- the request

    async def execute(self) -> dict[str, Any] | None:
        await self.prepare()
        await self.enter("organizing_history")
        await self.organize_history()
        answer = self.build_answer()
        self.meter(answer)
        # The fit is decided on the calibrated total (SPEC 5.1); estimate.* stays raw.
        if self.calibration.apply(answer.estimate.total) > self.input_budget:
            await self.enter("compacting_context")
            if await self.compact(recent_budget=RECENT_BUDGET_TOKENS, min_summarized=None):
                answer = self.build_answer()
        self.meter(answer)
        await self.enter("answering")
        return await self.answer(answer)

    async def prepare(self) -> None:
        async with self.db.sessions() as session:
            request = await load_request_input(session, self.claimed.id)
        if request is None:
            raise RequestLost()
        self.request = request
        options = request.options
        raw: dict[str, Any] | None = None
        if request.snapshot_id is not None:
            async with self.db.sessions() as session:
                raw = await load_snapshot(session, request.session_id, request.snapshot_id)
            if raw is None:
                raise PipelineFailure(
                    "snapshot_missing",
                    f"snapshot {request.snapshot_id!r} is not stored for this session",
                    {"snapshot_id": request.snapshot_id},
                )
            self.snapshot = normalize_snapshot(raw)
            taken_at = raw.get("taken_at")
            self.context_time = taken_at if isinstance(taken_at, str) else None
        settings = self.deps.settings
        self.model = (
            options.get("model") or request.model or settings.model or self.deps.provider.default_model
        )
        window = resolve_window(
            _int_option(options, "context_window"),
            self.snapshot.context_window if self.snapshot else None,
            settings.context_window,
        )
        main_cap = _int_option(options, "main_max_output_tokens") or (
            self.snapshot.max_output_tokens if self.snapshot else None
        )
        self.output_cap = resolve_output_cap(
            _int_option(options, "max_output_tokens"), settings.max_output_tokens, main_cap
        )
        plan = plan_window(window, self.output_cap)
        self.input_budget = plan.input_budget
        self.info.update(plan.as_dict())
        self.calibration = await self.book.snapshot(self.model)
        self.info["calibration"] = self.calibration.info()
        self.kept_messages = list(self.snapshot.messages) if self.snapshot else []
        async with self.db.sessions() as session:
            mem = await memory.load_memory(session, request.session_id)
        self.qa = _parse_qa(mem.get("qa_summary"))
        self.cache_entries = _parse_cache(mem.get("context_summaries") or [])
        self.runner = SummaryRunner(
            provider=self.deps.provider,
            model=self.model,
            request_id=str(self.claimed.id),
            recorder=self.recorder,
            deadline=self.deadline,
            budget=self.budget,
            window=plan.window,
            safety_margin=plan.safety_margin,
            on_progress=self.progress,
            clock=self.deps.clock,
            calibration=self.calibration,
            on_sample=self.book.sample,
        )
        await self.save_info()

    async def organize_history(self) -> None:
        assert self.request is not None and self.runner is not None
        covered = self.qa.covered_through_ordinal if self.qa else None
        items: list[QAItem] = []
        async for batch in iter_history(
            self.db.sessions,
            self.request.session_id,
            before_ordinal=self.request.ordinal,
            after_ordinal=covered or 0,
            clear_version=self.request.clear_version,
        ):
            for row in batch:
                pair = QAPair(row.ordinal, row.question, row.answer, utc_iso(row.created_at))
                self.history[row.ordinal] = pair
                items.append(QAItem(row.ordinal, estimate_text(render_qa_pair(pair))))
        plan = select_replay(items, covered, self.input_budget)
        self.replayed = [self.history[o] for o in plan.replay]
        first_last = plan.replayed_ordinals
        self.info["replayed_groups"] = len(plan.replay)
        self.info["replayed_ordinals"] = list(first_last) if first_last else None
        await self.progress(
            {
                "what": "replay",
                "replayed_groups": len(plan.replay),
                "replayed_ordinals": self.info["replayed_ordinals"],
                "folded_groups": len(plan.fold),
            }
        )
        if plan.fold:
            await self.fold([[self.history[o] for o in batch] for batch in plan.fold_batches])
        self.update_qa_info()

    async def fold(self, batches: Sequence[Sequence[QAPair]]) -> None:
        """Fold Q&A into the rolling summary and save it (guarded); lost if the save is refused."""
        assert self.runner is not None
        before = self.runner.attempts_made
        folded = await fold_qa(self.runner, self.qa, batches, self.context_time)
        qa_info = self.info["qa_summary"]
        qa_info["calls"] += self.runner.attempts_made - before
        self.info["summary_calls"] = self.budget.calls_made
        if folded is not None and folded is not self.qa:
            async with self.db.sessions() as session:
                if not await memory.save_memory(
                    session, self.claimed.id, owner=self.owner, qa_summary=folded.to_json()
                ):
                    raise RequestLost()
            self.qa = folded
            qa_info["updated"] = True

    def update_qa_info(self) -> None:
        qa_info = self.info["qa_summary"]
        qa_info["used"] = self.qa is not None
        qa_info["covered_through_ordinal"] = self.qa.covered_through_ordinal if self.qa else None
        self.info["summary_calls"] = self.budget.calls_made

    async def compact(self, *, recent_budget: int, min_summarized: int | None) -> bool:
        """Summarise the old part of the snapshot copy; False when compaction cannot help."""
        assert self.runner is not None and self.request is not None
        if self.snapshot is None or not self.snapshot.messages:
            await self.progress({"what": "compaction_skipped", "reason": "no snapshot messages"})
            return False
        messages = self.snapshot.messages
        groups = group_messages(messages)
        kwargs: dict[str, int] = {"recent_budget": recent_budget}
        if min_summarized is not None:
            kwargs["min_summarized_tokens"] = min_summarized
        cut = plan_cut(groups, **kwargs)
        if isinstance(cut, CutRefusal):
            await self.progress(
                {"what": "compaction_refused", "reason": cut.reason, "explanation": cut.explanation}
            )
            return False
        if (
            self.context_summary is not None
            and cut.summarize_until <= self.context_summary.summarized_messages
        ):
            await self.progress({"what": "compaction_refused", "reason": "no_further_cut"})
            return False
        result = await self.run_compaction(cut)
        self.context_summary = result
        self.kept_messages = list(messages[cut.summarize_until :])
        ctx = self.info["context_summary"]
        ctx.update(
            {
                "used": True,
                "cache": result.cache,
                "summarized_messages": result.summarized_messages,
                "kept_messages": result.kept_messages,
                "calls": ctx["calls"] + result.calls,
                "chunks": ctx["chunks"] + result.chunks,
            }
        )
        self.info["summary_calls"] = self.budget.calls_made
        return True

    async def run_compaction(self, cut: CutPlan) -> ContextCompaction:
        assert self.runner is not None and self.request is not None and self.snapshot is not None
        result = await compact_context(
            self.runner,
            self.request.snapshot_id,
            self.snapshot.messages,
            cut,
            self.cache_entries,
            self.context_time,
        )
        if result.new_entry is not None:
            async with self.db.sessions() as session:
                if not await memory.save_memory(
                    session, self.claimed.id, owner=self.owner, context_summary=result.new_entry.to_json()
                ):
                    raise RequestLost()
            self.cache_entries.append(result.new_entry)
        return result

    def build_answer(self) -> AnswerRequest:
        assert self.request is not None
        snap = self.snapshot
        return build_answer_request(
            question=self.request.question,
            system=snap.system if snap else None,
            tools=snap.tools if snap else (),
            messages=self.kept_messages,
            context_summary=self.context_summary.rendered_text if self.context_summary else None,
            qa_summary=self.qa.rendered() if self.qa else None,
            replayed=self.replayed,
            context_time=self.context_time,
        )

    def meter(self, answer: AnswerRequest) -> None:
        self.info["estimate"] = answer.estimate.as_dict()
        self.info["pressure"] = pressure(answer.estimate.total, self.input_budget)

    async def shrink(self, current: AnswerRequest, target: int | None = None) -> AnswerRequest | None:
        """Overflow recovery's one shrink: fold the replayed Q&A, then compact harder. None: nothing to do.

        ``target``: the raw estimate the request must reach, when the provider stated its real count
        (SPEC 5.1); the kept part of the snapshot is then sized to reach it instead of halved.
        """
        changed = False
        if self.replayed:
            await self.fold([self.replayed])
            self.replayed = []
            self.info["replayed_groups"] = 0
            self.info["replayed_ordinals"] = None
            self.update_qa_info()
            changed = True
        if self.snapshot is not None and self.kept_messages:
            # Keep half of what is kept now (never more than the default recent budget), and accept any
            # non-empty old part: the provider already said the prompt is too long.
            kept_tokens = estimate_messages(self.kept_messages)
            recent_budget = min(RECENT_BUDGET_TOKENS, kept_tokens) // 2
            if target is not None:
                # Everything but the kept messages stays; a new summary (at most the body limit)
                # replaces the old part, or the summary there is now.
                other = self.build_answer().estimate.total - kept_tokens
                summary_room = 0 if self.context_summary is not None else BODY_TOKEN_LIMIT
                recent_budget = max(0, min(RECENT_BUDGET_TOKENS, target - other - summary_room))
            if (target is None or recent_budget < kept_tokens) and await self.compact(
                recent_budget=recent_budget, min_summarized=0
            ):
                changed = True
        if not changed:
            return None
        shrunk = self.build_answer()
        return shrunk if shrunk.estimate.total < current.estimate.total else None

    async def answer(self, request: AnswerRequest) -> dict[str, Any] | None:
        deltas = DeltaCoalescer(self.emit_delta)
        self.recorder.before_usage = deltas.flush
        try:
            try:
                result = await self.call_answer(request, deltas)
            except ContextOverflow as exc:
                if deltas.streamed_chars or self.info["overflow_retries"]:
                    raise
                await self.progress({"what": "overflow_retry", "estimate_before": request.estimate.total})
                target = None
                if exc.prompt_tokens is not None:
                    # The real count is a sample, and it says how far to shrink (SPEC 5.1).
                    await self.book.sample(self.model, request.estimate.total, exc.prompt_tokens)
                    target = overflow_target(self.input_budget, request.estimate.total, exc.prompt_tokens)
                shrunk = await self.shrink(request, target)
                if shrunk is None:
                    raise PipelineFailure(
                        "context_overflow",
                        "the prompt does not fit the window and cannot be made smaller: " + exc.message,
                        {
                            "status": exc.status,
                            "message": exc.message,
                            "estimate": request.estimate.total,
                            "input_budget": self.input_budget,
                        },
                    ) from exc
                self.info["overflow_retries"] = 1
                self.meter(shrunk)
                await self.save_info()
                await self.progress(
                    {"what": "overflow_retry", "estimate_after": shrunk.estimate.total, "retry": 1}
                )
                request = shrunk
                result = await self.call_answer(request, deltas)
        except BaseException:
            await deltas.abort() if _cancelled() else await deltas.close()
            raise
        finally:
            self.recorder.before_usage = None
        await deltas.close()
        return await self.finish(request, result)

    async def call_answer(self, request: AnswerRequest, deltas: DeltaCoalescer) -> CallResult:
        call = ProviderCall(
            model=self.model,
            messages=request.messages,
            max_output_tokens=self.output_cap,
            purpose="answer",
            request_id=str(self.claimed.id),
            system=request.system,
            tools=request.tools,
        )
        result = await run_call(
            self.deps.provider,
            call,
            recorder=self.recorder,
            deadline=self.deadline,
            on_text=deltas.add,
            clock=self.deps.clock,
        )
        if result.usage.reported:
            await self.book.sample(self.model, request.estimate.total, result.usage.input_tokens)
        return result

    async def finish(self, request: AnswerRequest, result: CallResult) -> dict[str, Any] | None:
        prompt_tokens = result.usage.input_tokens if result.usage.reported else None
        self.info["provider_prompt_tokens"] = prompt_tokens
        self.info["drift"] = prompt_drift(request.estimate.total, prompt_tokens)
        if result.tool_calls or result.stop_reason == "tool_calls":
            name = result.tool_calls[0].name if result.tool_calls else None
            raise PipelineFailure(
                "answer_tool_call",
                f"the model tried to call a tool ({name or 'unnamed'}) although side answers have none",
                {"tool": name, "stop_reason": result.stop_reason},
            )
        truncated = result.stop_reason == "length" or result.raw_stop_reason in ("length", "max_tokens")
        if not result.text and not truncated:
            raise PipelineFailure(
                "provider_error",
                "the model returned an empty answer",
                {"status": None, "message": "empty answer", "stop_reason": result.stop_reason},
            )
        async with self.db.sessions() as session:
            record = await queue.finish_succeeded(
                session,
                self.claimed.id,
                self.owner,
                answer=result.text,
                truncated=truncated,
                stop_reason=result.stop_reason,
                model=self.model,
                context_info=self.info,
            )
        if record is None:
            raise RequestLost()
        return record

    async def fail(self, exc: BaseException) -> bool:
        error = error_object(exc, stage=self.stage, timeout_s=self.timeout_s)
        async with self.db.sessions() as session:
            return await queue.finish_failed(
                session,
                self.claimed.id,
                self.owner,
                code=error["code"],
                message=error["message"],
                detail=error["detail"],
                context_info=self.info,
            )


def _cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _parse_qa(value: Any) -> StoredQASummary | None:
    if not value:
        return None
    try:
        return StoredQASummary.from_json(value)
    except Exception:  # a summary we cannot read is as good as none: it is rebuilt from history
        return None


def _parse_cache(values: Sequence[Any]) -> list[CachedContextSummary]:
    entries = []
    for value in values:
        with contextlib.suppress(Exception):  # an unreadable cache entry is a cache miss
            entries.append(CachedContextSummary.from_json(value))
    return entries


@dataclass(frozen=True)
class Outcome:
    """How a request ended for this worker: ``succeeded``, ``failed`` or ``lost`` (not ours any more)."""

    status: str
    record: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


async def run_request(deps: PipelineDeps, claimed: queue.Claimed) -> Outcome:
    """Run one claimed request to its terminal state.

    Cancellation (``task.cancel()``) propagates as :class:`asyncio.CancelledError` after the in-flight
    call was recorded as ``cancelled``; the caller decides what the cancel means (the worker's cancel
    handling). Every other failure is written as the request's ``error`` here.
    """
    run = _Run(deps, claimed)
    try:
        async with asyncio.timeout(deps.settings.request_timeout_s + DEADLINE_GRACE_S):
            record = await run.execute()
        return Outcome("succeeded", record=record)
    except RequestLost:
        return Outcome("lost")
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if is_unavailable(exc, include_timeouts=False):
            # PostgreSQL went away mid-request (SPEC 9): write nothing; the lease expires and the
            # sweep runs it again (or fails it with worker_lost).
            return Outcome("lost")
        error = error_object(exc, stage=run.stage, timeout_s=run.timeout_s)
        written = await run.fail(exc)
        return Outcome("failed" if written else "lost", error=error)
