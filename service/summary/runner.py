"""A summary over one or more chunks (SPEC §6.3): the plan, the ordered and the parallel mode with its
merge rounds (docs/summaries.md, "Parallel mode and merges"). Either way a failure raises, so a failed
partial summary never feeds the next call. :func:`planned_merge_calls` bounds the merge calls with every
document at its largest: next-fit never needs more groups for smaller items, so the real rounds never
need more merge calls than planned (checked by a property test).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from service import vocabulary
from service.aio import all_or_first_failure
from service.budget import estimate_text
from service.providers.base import ContextOverflow
from service.summary.document import BODY_TOKEN_LIMIT, SummaryDocument, render_body
from service.summary.policy import PURPOSE_OF, STAGE_OF, CallReservation, SummaryCaller
from service.summary.prompts import SummaryKind, SummaryPrompt, merge_piece

ProgressCallback = Callable[[dict[str, Any]], Awaitable[None]]


def merge_groups(sizes: Sequence[int], capacity: int) -> list[range]:
    """Split documents of these token ``sizes`` into consecutive groups (next-fit, order kept) whose
    sizes sum to at most ``capacity``, unless a group is a single document larger than that."""
    groups: list[range] = []
    start = used = 0
    for index, size in enumerate(sizes):
        if index > start and used + size > capacity:
            groups.append(range(start, index))
            start, used = index, 0
        used += size
    if sizes:
        groups.append(range(start, len(sizes)))
    return groups


def merge_calls_of(groups: Sequence[range]) -> int:
    """Merge calls of one round: one per group of two or more documents (a single one passes through)."""
    return sum(1 for group in groups if len(group) > 1)


def can_merge(piece_tokens: int, capacity: int) -> bool:
    """Whether one merge call can take two documents of ``piece_tokens`` each (else merging stalls)."""
    return piece_tokens > 0 and 2 * piece_tokens <= capacity


def planned_merge_calls(documents: int, piece_tokens: int, capacity: int) -> int:
    """Merge calls needed to fold ``documents`` of at most ``piece_tokens`` each into one, all rounds;
    ``ValueError`` when one call cannot take two of them (the rounds would never end)."""
    if documents < 2:
        return 0
    if not can_merge(piece_tokens, capacity):
        raise ValueError(f"a merge call of {capacity} tokens cannot take two {piece_tokens}-token documents")
    calls = 0
    while documents > 1:
        groups = merge_groups([piece_tokens] * documents, capacity)
        calls += merge_calls_of(groups)
        documents = len(groups)
    return calls


@dataclass(frozen=True)
class SummaryPlan:
    """How a summary over ``chunks`` chunks will run, and the calls it needs before any retry."""

    chunks: int
    parallel: bool
    merge_calls: int = 0

    @property
    def calls(self) -> int:
        return self.chunks + self.merge_calls


@dataclass
class SummaryRunner(SummaryCaller):
    """A :class:`~service.summary.policy.SummaryCaller` that summarises chunks, ordered or in parallel
    (``parallelism``: at most that many calls in flight; 1 keeps the ordered mode)."""

    on_progress: ProgressCallback | None = None
    parallelism: int = 1

    def plan(self, kind: SummaryKind, chunks: int, parallel: bool | None = None) -> SummaryPlan:
        """How ``chunks`` chunks will be summarised, and the calls that needs (retries not counted).
        Parallel only when its calls fit those that remain (unless ``parallel`` is True): parallelism
        buys time, and must not fail a request that the ordered rolling update can serve."""
        # A merge call's document at its largest: a body at the 2200-token limit, plus its tag.
        worst = BODY_TOKEN_LIMIT + estimate_text(merge_piece(max(chunks, 1), ""))
        capacity = self.capacity(kind)
        if parallel is not False and chunks >= 2 and self.parallelism > 1 and can_merge(worst, capacity):
            merging = SummaryPlan(chunks, True, planned_merge_calls(chunks, worst, capacity))
            if parallel or merging.calls <= self.budget.remaining:
                return merging
        return SummaryPlan(chunks=chunks, parallel=False)

    async def summarize(
        self,
        kind: SummaryKind,
        chunks: Sequence[str],
        previous: SummaryDocument | None,
        *,
        progress_offset: int = 0,
        progress_total: int | None = None,
        parallel: bool | None = None,
        reservation: CallReservation | None = None,
    ) -> SummaryDocument:
        """Summarise ``chunks`` (in material order) into one document, updating ``previous`` (None:
        start fresh). The plan's calls are reserved before any call (:class:`SummaryCallCap` when they
        do not fit) unless the caller holds a ``reservation`` for a larger plan, of which this is one
        part (``progress_offset`` / ``progress_total`` number its chunk events)."""
        if not chunks:
            if previous is None:
                raise ValueError("nothing to summarise")
            return previous
        plan = self.plan(kind, len(chunks), parallel)
        held = self.budget.reserve(plan.calls) if reservation is None else None
        total = progress_total or len(chunks)
        slots = asyncio.Semaphore(self.parallelism)
        # Progress events go out one at a time, in the order the calls take their slots.
        emitting = asyncio.Lock()

        async def one_call(event: dict[str, Any], prompt: Callable[..., SummaryPrompt]) -> SummaryDocument:
            async with slots:
                if self.on_progress is not None:
                    async with emitting:
                        await self.on_progress(event)
                return await self.call(kind, prompt, reservation=held or reservation)

        def one_chunk(index: int, chunk: str, running: SummaryDocument | None) -> Awaitable[SummaryDocument]:
            event = vocabulary.summary_chunk(STAGE_OF[kind], PURPOSE_OF[kind], progress_offset + index, total)
            return one_call(event, self.chunk_prompt(kind, chunk, running, index, len(chunks)))

        try:
            if not plan.parallel:
                running = previous
                for index, chunk in enumerate(chunks, start=1):
                    running = await one_chunk(index, chunk, running)
                assert running is not None
                return running
            documents = await all_or_first_failure(
                [one_chunk(i, chunk, previous if i == 1 else None) for i, chunk in enumerate(chunks, start=1)]
            )
            merge_round = 0
            while len(documents) > 1:
                merge_round += 1
                documents = await self._merge_round(kind, documents, merge_round, one_call)
            return documents[0]
        finally:
            if held is not None:
                held.release()

    async def _merge_round(
        self,
        kind: SummaryKind,
        documents: Sequence[SummaryDocument],
        merge_round: int,
        one_call: Callable[[dict[str, Any], Callable[..., SummaryPrompt]], Awaitable[SummaryDocument]],
    ) -> list[SummaryDocument]:
        """One round: consecutive documents that fit one call are merged (the calls run at once); a
        document alone in its group passes to the next round as it is."""
        # Part numbers in a call are at most ``len(documents)``: sizing every piece with that bounds it.
        sizes = [estimate_text(merge_piece(len(documents), render_body(document))) for document in documents]
        groups = merge_groups(sizes, self.capacity(kind))
        calls = [group for group in groups if len(group) > 1]
        if not calls:
            # Cannot happen after plan(): it checked that one call takes two documents at the limit.
            raise ContextOverflow(
                f"a {self.window}-token window cannot hold two summary documents in one merge call"
            )

        def one_merge(number: int, group: range) -> Awaitable[SummaryDocument]:
            event = vocabulary.summary_merge(
                STAGE_OF[kind], PURPOSE_OF[kind], merge_round, number, len(calls), len(group)
            )
            return one_call(event, self.merge_prompt(kind, [documents[i] for i in group]))

        merged = iter(
            await all_or_first_failure([one_merge(number, group) for number, group in enumerate(calls, 1)])
        )
        return [next(merged) if len(group) > 1 else documents[group.start] for group in groups]
