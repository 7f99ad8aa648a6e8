"""Stage ``organizing_history`` (SPEC §6.1, §6.6; docs/pipeline.md): replay window, rolling summary.

Split in two so that a needed fold (:func:`fold_history`) can run while the context is compacted: the
two are the slowest steps of a preparation, and neither needs the other's result.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from service import vocabulary
from service.budget import QAItem, ReplayPlan, estimate_text, select_replay
from service.pipeline.prepare import Prepared, parse_qa_summary
from service.pipeline.runtime import RequestRuntime
from service.pipeline.waiting import registered, wait_for_background_jobs
from service.store.db import Database
from service.store.history import iter_history, latest_context_time
from service.summary.material import QAPair, render_qa_pair
from service.summary.rolling import StoredQASummary, fold_qa
from service.summary.runner import SummaryRunner
from service.vocabulary import JobKind, utc_iso


def qa_group_tokens(pair: QAPair) -> int:
    """The SPEC §5 estimate of one Q&A group as it is replayed (stored with the request on success)."""
    return estimate_text(render_qa_pair(pair))


def fold_key(ordinals: Sequence[int]) -> str:
    """The single-flight key of a fold: the ordinal range it folds."""
    return f"{ordinals[0]}-{ordinals[-1]}"


@dataclass
class HistoryPlan:
    """What ``organizing_history`` found: the summary, the uncovered Q&A and the replay window."""

    qa: StoredQASummary | None
    pairs: dict[int, QAPair]
    items: list[QAItem]
    replay: ReplayPlan
    waited_ms: int = 0
    folded: bool = False
    calls: int = 0

    @property
    def replayed(self) -> list[QAPair]:
        """The replayed Q&A pairs, oldest first."""
        return [self.pairs[o] for o in self.replay.replay]

    @property
    def fold_batches(self) -> list[list[QAPair]]:
        """What must be folded into the summary before answering, in ascending batches."""
        return [[self.pairs[o] for o in batch] for batch in self.replay.fold_batches]


async def _reload_qa(rt: RequestRuntime) -> StoredQASummary | None:
    return parse_qa_summary((await rt.load_memory()).get("qa_summary"))


async def _plan(
    rt: RequestRuntime, prepared: Prepared, qa: StoredQASummary | None, waited_ms: int, calls: int = 0
) -> HistoryPlan:
    """Load the Q&A after ``qa``'s coverage (with their stored estimates) and choose the replay window."""
    covered = qa.covered_through_ordinal if qa else None
    pairs: dict[int, QAPair] = {}
    items: list[QAItem] = []
    async for batch in iter_history(
        rt.db,
        rt.claimed.session_id,
        before_ordinal=rt.claimed.ordinal,
        after_ordinal=covered or 0,
        clear_version=rt.claimed.clear_version,
    ):
        for row in batch:
            pair = QAPair(row.ordinal, row.question, row.answer, utc_iso(row.created_at))
            pairs[row.ordinal] = pair
            tokens = row.qa_tokens if row.qa_tokens is not None else qa_group_tokens(pair)
            items.append(QAItem(row.ordinal, tokens))
    replay = select_replay(items, covered, prepared.plan.input_budget)
    plan = HistoryPlan(qa=qa, pairs=pairs, items=items, replay=replay, waited_ms=waited_ms, calls=calls)
    update_qa_info(rt, plan)
    return plan


async def plan_history(rt: RequestRuntime, prepared: Prepared) -> HistoryPlan:
    """Wait for background folds (if any), load the uncovered history and choose the replay window."""
    qa = prepared.qa
    waited: int | None = None
    if rt.deps.settings.background_on and rt.claimed.jobs_active:
        waited = await wait_for_background_jobs(rt, JobKind.QA_FOLD)
        if waited is not None:
            qa = await _reload_qa(rt)
    plan = await _plan(rt, prepared, qa, waited or 0)
    replay = plan.replay
    await rt.progress(
        vocabulary.replay(len(replay.replay), rt.info.replayed_ordinals, len(replay.fold)), defer=True
    )
    return plan


async def fold_history(rt: RequestRuntime, prepared: Prepared, plan: HistoryPlan) -> HistoryPlan:
    """Fold ``plan.fold_batches`` into the rolling summary, registered for single flight; if a background fold
    holds the range, wait, use what it made and fold the rest — once: a second refusal folds unregistered."""
    runner = rt.summary_runner(prepared)
    for attempt in range(2):
        if not plan.replay.fold:
            return plan
        async with registered(rt, JobKind.QA_FOLD, fold_key(plan.replay.fold)) as mine:
            if mine or attempt == 1:
                await _fold(rt, prepared, plan, runner)
                return plan
        waited = await wait_for_background_jobs(rt, JobKind.QA_FOLD) or 0
        plan = await _plan(rt, prepared, await _reload_qa(rt), plan.waited_ms + waited, plan.calls)
    return plan


async def folded_context_time(
    db: Database,
    session_id: uuid.UUID,
    previous: StoredQASummary | None,
    batches: Sequence[Sequence[QAPair]],
    clear_version: int,
) -> str | None:
    """The context time of folding ``batches`` into ``previous``: that of the newest folded Q&A asked on a
    snapshot (a request's fold and a background job's alike, whatever snapshot the folding request has)."""
    async with db.connection() as conn:
        return await latest_context_time(
            conn,
            session_id,
            after_ordinal=previous.covered_through_ordinal if previous is not None else 0,
            through_ordinal=batches[-1][-1].ordinal,
            clear_version=clear_version,
        )


async def _fold(rt: RequestRuntime, prepared: Prepared, plan: HistoryPlan, runner: SummaryRunner) -> None:
    before = runner.attempts_made
    try:
        context_time = await folded_context_time(
            rt.db, prepared.claimed.session_id, plan.qa, plan.fold_batches, prepared.claimed.clear_version
        )
        folded = await fold_qa(runner, plan.qa, plan.fold_batches, context_time)
    finally:
        plan.calls += runner.attempts_made - before
        if rt.info.qa_summary is not None:  # a failed fold's record counts its calls too
            rt.info.qa_summary.calls = plan.calls
        rt.sync_calls()
    if folded is not None and folded is not plan.qa:
        await rt.save_memory(qa_summary=folded.to_json())
        plan.qa = folded
        plan.folded = True
    plan.replay = dataclasses.replace(plan.replay, fold=(), fold_batches=())
    update_qa_info(rt, plan)


def update_qa_info(rt: RequestRuntime, plan: HistoryPlan) -> None:
    """Mirror the history plan into ``context_info.qa_summary`` (SPEC §3)."""
    info = rt.info.qa_summary
    assert info is not None
    info.used = plan.qa is not None
    info.first_ordinal = plan.qa.first_ordinal if plan.qa else None
    info.covered_through_ordinal = plan.qa.covered_through_ordinal if plan.qa else None
    info.updated = plan.folded
    info.calls = plan.calls
    info.waited_ms = plan.waited_ms
    if plan.qa is None:
        info.made_by = None
    else:  # what this request folded is its own, whoever made the summary it extended
        info.made_by = "background" if plan.qa.made_by == "background" and not plan.folded else "request"
    rt.info.replayed_groups = len(plan.replay.replay)
    first_last = plan.replay.replayed_ordinals
    rt.info.replayed_ordinals = list(first_last) if first_last else None
    rt.sync_calls()


def next_fold(plan: HistoryPlan, own: QAItem, input_budget: int) -> tuple[int, ...]:
    """The groups the next question would have to fold, as they leave its replay window: the
    background fold to queue after this request succeeds (SPEC §6.6 "after an answer"); () if none."""
    covered = plan.qa.covered_through_ordinal if plan.qa else None
    replayed = set(plan.replay.replay)
    items = [item for item in plan.items if item.ordinal in replayed] + [own]
    return select_replay(items, covered, input_budget).fold
