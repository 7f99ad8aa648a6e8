"""A summary over one or more chunks (SPEC §6.3): the plan, the ordered and the parallel mode.

Each chunk, and each merge call, is one call of the policy in :mod:`service.summary.policy` (one
retry, the call cap, the deadline). Two modes (``SummaryRunner.parallelism``,
``SIDEQUEST_SUMMARY_PARALLELISM``):

- *ordered* (parallelism 1, or a single chunk): chunks are updates of the running summary, which is
  always the last *valid* document;
- *parallel*: the chunks are summarised at once, each on its own (the previous summary goes with the
  first), at most ``parallelism`` calls in flight, then merge calls — summary calls like any other, with
  the same retry, cap and validation — fold the documents, in order, into one, in rounds when they do
  not fit one call (:mod:`service.summary.merge`). The first failure cancels the calls in flight.

Either way a failure raises, so a failed partial summary can never become the input of the next call.
The whole plan (chunks + planned merge calls) is reserved in the budget before the first call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from service import vocabulary
from service.budget import estimate_text
from service.providers.base import ContextOverflow
from service.summary.document import BODY_TOKEN_LIMIT, SummaryDocument, render_body
from service.summary.merge import can_merge, merge_groups, planned_merge_calls
from service.summary.policy import PURPOSE_OF, STAGE_OF, CallReservation, CallTally, SummaryCaller
from service.summary.prompts import SummaryKind, merge_piece

ProgressCallback = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class SummaryPlan:
    """How a summary over ``chunks`` chunks will run, and the calls it needs before any retry."""

    chunks: int
    parallel: bool
    merge_calls: int = 0

    @property
    def calls(self) -> int:
        """Chunk calls plus merge calls (a merge call is a call, not a chunk)."""
        return self.chunks + self.merge_calls


_T = TypeVar("_T")


async def _all_or_nothing(calls: Sequence[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run ``calls`` at once and return their results in order, or raise the first failure as it came.

    The first failure cancels the others, and they are waited for, so every cancelled provider call is
    recorded (``run_call`` records a cancelled attempt with the usage it saw) before this raises.
    """
    failure: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except BaseExceptionGroup as failed:
        failure = failed.exceptions[0]  # the one that made the group cancel the rest
    if failure is not None:
        raise failure  # outside the handler, so it is not chained to the group that carried it
    return [task.result() for task in tasks]


@dataclass
class SummaryRunner(SummaryCaller):
    """A :class:`~service.summary.policy.SummaryCaller` that summarises chunks, ordered or in parallel.

    ``on_progress`` receives one event dict per chunk and per merge call. ``parallelism`` is
    ``SIDEQUEST_SUMMARY_PARALLELISM``: above 1, two or more chunks are summarised at once (at most
    that many calls in flight) and merged; 1 keeps the ordered rolling update.
    """

    on_progress: ProgressCallback | None = None
    # Chunk summaries of one summary made at once (SPEC §6.3, SIDEQUEST_SUMMARY_PARALLELISM).
    parallelism: int = 1

    def __post_init__(self) -> None:
        if self.parallelism < 1:
            raise ValueError("parallelism must be >= 1")

    def plan(self, kind: SummaryKind, chunks: int) -> SummaryPlan:
        """How ``chunks`` chunks will be summarised, and the calls that needs (retries not counted).

        Parallel when ``parallelism`` > 1, there are two or more chunks, one merge call can take two
        documents at the body limit, and chunks + planned merge calls fit the calls that remain. A
        parallel plan that would not fit falls back to the ordered rolling update (one call per
        chunk): parallelism buys time, and must not fail a request that the ordered mode can serve.
        """
        if (
            chunks >= 2
            and self.parallelism > 1
            and can_merge(worst_piece_tokens(chunks), self.capacity(kind))
        ):
            parallel = self._plan_of(kind, chunks, parallel=True)
            if parallel.calls <= self.budget.remaining:
                return parallel
        return SummaryPlan(chunks=chunks, parallel=False)

    def _plan_of(self, kind: SummaryKind, chunks: int, *, parallel: bool) -> SummaryPlan:
        """The plan of the given mode, whether or not it fits the budget."""
        worst, capacity = worst_piece_tokens(chunks), self.capacity(kind)
        if not parallel or chunks < 2 or self.parallelism == 1 or not can_merge(worst, capacity):
            return SummaryPlan(chunks=chunks, parallel=False)
        merges = planned_merge_calls(chunks, worst, capacity)
        return SummaryPlan(chunks=chunks, parallel=True, merge_calls=merges)

    async def summarize(
        self,
        kind: SummaryKind,
        chunks: Sequence[str],
        previous: SummaryDocument | None,
        *,
        check_cap: bool = True,
        progress_offset: int = 0,
        progress_total: int | None = None,
        parallel: bool | None = None,
        reservation: CallReservation | None = None,
        tally: CallTally | None = None,
    ) -> SummaryDocument:
        """Summarise ``chunks`` (in material order) into one document.

        Ordered mode: each chunk is an update of the running summary, ``previous`` the one the first
        chunk updates (None: start fresh). Parallel mode: every chunk is summarised on its own, at
        most ``parallelism`` at a time (``previous`` goes with the first chunk only), then merge calls
        fold the documents, in order, into one (in rounds when they do not fit one call).
        ``parallel`` None means :meth:`plan`'s choice; a caller that planned passes it.

        ``check_cap`` reserves the plan's calls (chunks + merges) in the budget first, failing with
        :class:`SummaryCallCap` before any call; a caller that already holds a ``reservation`` for a
        larger plan passes it (and ``check_cap`` False). ``progress_offset`` / ``progress_total``
        number the chunk progress events when this is one part of a larger plan (several Q&A batches).
        ``tally`` counts this summary's attempts. Returns the last valid document; raises the first
        failure (in parallel mode after cancelling the calls still in flight).
        """
        if not chunks:
            if previous is None:
                raise ValueError("nothing to summarise")
            return previous
        if parallel is None:
            plan = self.plan(kind, len(chunks))
        else:
            plan = self._plan_of(kind, len(chunks), parallel=parallel)
        held = self.budget.reserve(plan.calls) if check_cap and reservation is None else None
        try:
            if plan.parallel:
                return await self._summarize_parallel(
                    kind,
                    chunks,
                    previous,
                    progress_offset=progress_offset,
                    progress_total=progress_total,
                    reservation=held or reservation,
                    tally=tally,
                )
            return await self._summarize_ordered(
                kind,
                chunks,
                previous,
                progress_offset=progress_offset,
                progress_total=progress_total,
                reservation=held or reservation,
                tally=tally,
            )
        finally:
            if held is not None:
                held.release()

    async def _summarize_ordered(
        self,
        kind: SummaryKind,
        chunks: Sequence[str],
        previous: SummaryDocument | None,
        *,
        progress_offset: int,
        progress_total: int | None,
        reservation: CallReservation | None,
        tally: CallTally | None,
    ) -> SummaryDocument:
        running = previous
        total = len(chunks)
        for index, chunk in enumerate(chunks, start=1):
            if self.on_progress is not None:
                await self.on_progress(_chunk_event(kind, progress_offset + index, progress_total or total))
            running = await self.summarize_chunk(
                kind,
                chunk,
                running,
                chunk_index=index,
                chunks=total,
                reservation=reservation,
                tally=tally,
            )
        assert running is not None
        return running

    async def _summarize_parallel(
        self,
        kind: SummaryKind,
        chunks: Sequence[str],
        previous: SummaryDocument | None,
        *,
        progress_offset: int,
        progress_total: int | None,
        reservation: CallReservation | None,
        tally: CallTally | None,
    ) -> SummaryDocument:
        total = len(chunks)
        slots = asyncio.Semaphore(self.parallelism)
        # Progress events go out one at a time, in the order the calls take their slots.
        emitting = asyncio.Lock()

        async def report(event: dict[str, Any]) -> None:
            if self.on_progress is not None:
                async with emitting:
                    await self.on_progress(event)

        async def one_chunk(index: int, chunk: str) -> SummaryDocument:
            async with slots:
                await report(_chunk_event(kind, progress_offset + index, progress_total or total))
                return await self.summarize_chunk(
                    kind,
                    chunk,
                    previous if index == 1 else None,
                    chunk_index=index,
                    chunks=total,
                    reservation=reservation,
                    tally=tally,
                )

        documents = await _all_or_nothing(
            [one_chunk(index, chunk) for index, chunk in enumerate(chunks, start=1)]
        )
        merge_round = 0
        while len(documents) > 1:
            merge_round += 1
            documents = await self._merge_round(
                kind, documents, merge_round, slots, report, reservation=reservation, tally=tally
            )
        return documents[0]

    async def _merge_round(
        self,
        kind: SummaryKind,
        documents: Sequence[SummaryDocument],
        merge_round: int,
        slots: asyncio.Semaphore,
        report: ProgressCallback,
        *,
        reservation: CallReservation | None,
        tally: CallTally | None,
    ) -> list[SummaryDocument]:
        """One round: consecutive documents that fit one call are merged (the calls run at once); a
        document alone in its group passes to the next round as it is."""
        count = len(documents)
        # Part numbers in a call are at most ``count``: sizing every piece with that number bounds it.
        sizes = [estimate_text(merge_piece(count, render_body(document))) for document in documents]
        groups = merge_groups(sizes, self.capacity(kind))
        calls = [group for group in groups if len(group) > 1]
        if not calls:
            # Cannot happen after plan(): it checked that one call takes two documents at the limit.
            raise ContextOverflow(
                f"a {self.window}-token window cannot hold two summary documents in one merge call"
            )

        async def one_merge(number: int, group: range) -> SummaryDocument:
            async with slots:
                await report(
                    vocabulary.summary_merge(
                        STAGE_OF[kind], PURPOSE_OF[kind], merge_round, number, len(calls), len(group)
                    )
                )
                return await self.merge(
                    kind, [documents[i] for i in group], reservation=reservation, tally=tally
                )

        merged = iter(
            await _all_or_nothing([one_merge(number, group) for number, group in enumerate(calls, 1)])
        )
        return [next(merged) if len(group) > 1 else documents[group.start] for group in groups]


def _chunk_event(kind: SummaryKind, chunk: int, chunks: int) -> dict[str, Any]:
    return vocabulary.summary_chunk(STAGE_OF[kind], PURPOSE_OF[kind], chunk, chunks)


def worst_piece_tokens(documents: int) -> int:
    """The largest a merge call's document can be: a body at the 2200-token limit, plus its tag."""
    return BODY_TOKEN_LIMIT + estimate_text(merge_piece(max(documents, 1), ""))
