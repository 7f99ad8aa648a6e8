"""The summary call policy (SPEC §6.3): attempts, the one retry, the per-request call cap, chunking.

One *summary* over some material is one or more chunks; each chunk is one call with at most one retry:

- first attempt: output cap 2048 (``FIRST_OUTPUT_TOKENS``);
- empty / thinking-only, truncated (stop reason ``length``), invalid, or body over 2200 tokens →
  exactly one retry from the *original* material (same chunk, same previous valid summary) with output
  cap 8192 (``RETRY_OUTPUT_TOKENS``), asking for a body under 600 tokens;
- a tool call → :class:`SummaryToolCall` at once; a provider error → propagates at once, unchanged;
- the retry failing too → the error of *that* failure (truncated / empty / invalid / too long).

Every provider attempt — rate-limit retries inside ``run_call`` included, because ``run_call`` calls
``budget.take`` before each — counts toward the request's :class:`SummaryCallBudget`, so the call after
the last allowed one is refused before it is made. Every attempt runs under the request deadline.

Two modes (``SummaryRunner.parallelism``, ``SIDEQUEST_SUMMARY_PARALLELISM``):

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
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from service.budget import (
    FIRST_OUTPUT_TOKENS,
    MIN_CHUNK_CAPACITY,
    RETRY_OUTPUT_TOKENS,
    Calibration,
    chunk_pieces,
    estimate_messages,
    estimate_system,
    estimate_text,
    summary_capacity,
)
from service.providers.base import ContextOverflow, Provider, ProviderCall, Purpose
from service.providers.calling import CallRecorder, CallResult, run_call
from service.summary.document import (
    BODY_TOKEN_LIMIT,
    SummaryDocument,
    check_body_size,
    parse_summary_document,
    render_body,
)
from service.summary.errors import (
    SummaryCallCap,
    SummaryEmpty,
    SummaryError,
    SummaryToolCall,
    SummaryTruncated,
)
from service.summary.merge import can_merge, merge_groups, planned_merge_calls
from service.summary.prompts import (
    SummaryKind,
    SummaryPrompt,
    build_merge_prompt,
    build_summary_prompt,
    merge_piece,
    prompt_version,
    summary_prompt_reserve,
)
from service.vocabulary import utc_iso

# Stop reasons that mean "cut at the output cap" (normalised, plus Anthropic's raw value).
_TRUNCATED = frozenset({"length", "max_tokens"})

PURPOSE_OF: dict[SummaryKind, Purpose] = {"qa": "qa_summary", "context": "context_summary"}
STAGE_OF: dict[SummaryKind, str] = {"qa": "organizing_history", "context": "compacting_context"}

ProgressCallback = Callable[[dict[str, Any]], Awaitable[None]]

# A calibration sample (SPEC §5.1): model, the request's estimate as sent, the reported prompt tokens
# (None when the provider reported none; the sink then records nothing).
SampleCallback = Callable[[str, int, int | None], Awaitable[None]]


class SummaryCallBudget:
    """The per-request summary call cap (``SIDEQUEST_MAX_SUMMARY_CALLS``, default 12).

    One budget object lives for the whole side request, shared by the Q&A fold and the context
    compaction, so retries and rate-limit attempts of either count against the same cap. The two may
    run at the same time: every method is synchronous (no await inside), so on one event loop counts
    can never interleave; and each plan reserves its calls (:meth:`reserve`), so two plans that
    together need more than remain cannot both start — the second fails before it spends anything.
    """

    def __init__(self, max_calls: int) -> None:
        if max_calls < 0:
            raise ValueError("max_calls must be >= 0")
        self.max_calls = max_calls
        self.calls_made = 0
        self._reserved = 0

    @property
    def reserved(self) -> int:
        """Calls promised to running plans and not yet made."""
        return self._reserved

    @property
    def remaining(self) -> int:
        """Calls still allowed and not promised to a running plan."""
        return self.max_calls - self.calls_made - self._reserved

    def take(self, reservation: CallReservation | None = None) -> None:
        """Count one call about to be made; raise :class:`SummaryCallCap` instead if none is left.

        The call comes out of ``reservation`` while it has calls left, else out of what no plan holds
        (a retry beyond its plan). Raising *before* the call is what guarantees the (cap + 1)-th call
        is never sent.
        """
        if reservation is not None and reservation.left > 0:
            if reservation.budget is not self:
                raise ValueError("the reservation belongs to another budget")
            reservation.left -= 1
            self._reserved -= 1
            self.calls_made += 1
            return
        if self.remaining <= 0:
            raise SummaryCallCap(
                calls_made=self.calls_made,
                calls_needed=1,
                max_calls=self.max_calls,
                calls_reserved=self._reserved,
            )
        self.calls_made += 1

    def require(self, calls_needed: int) -> None:
        """Fail now if a plan already needs more calls than remain (before any of them is spent)."""
        if calls_needed > self.remaining:
            raise SummaryCallCap(
                calls_made=self.calls_made,
                calls_needed=calls_needed,
                max_calls=self.max_calls,
                calls_reserved=self._reserved,
            )

    def reserve(self, calls_needed: int) -> CallReservation:
        """:meth:`require` the plan's calls and hold them for it until it releases the rest.

        Use as ``with budget.reserve(n) as reservation:`` and pass the reservation to ``take``.
        """
        self.require(calls_needed)
        self._reserved += calls_needed
        return CallReservation(self, calls_needed)


class CallReservation:
    """Calls a plan holds in a :class:`SummaryCallBudget`; :meth:`release` returns those not made."""

    def __init__(self, budget: SummaryCallBudget, calls: int) -> None:
        self.budget = budget
        self.left = calls

    def release(self) -> None:
        """Give back the calls not made (idempotent)."""
        self.budget._reserved -= self.left
        self.left = 0

    def __enter__(self) -> CallReservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclass
class CallTally:
    """Attempts made for one caller's summaries (context_info ``calls`` of a fold or a compaction).

    Two summaries running at once on one runner cannot tell their calls apart by the runner's shared
    ``attempts_made``; each passes its own tally instead.
    """

    calls: int = 0


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
class SummaryRunner:
    """Everything a side request's summary calls share.

    ``deadline`` is an absolute ``clock()`` value (the request's deadline, as for ``run_call``).
    ``window`` / ``safety_margin`` are the summariser model's window numbers; chunk capacity is derived
    from them. ``on_progress`` receives one event dict per chunk and per merge call. ``parallelism``
    is ``SIDEQUEST_SUMMARY_PARALLELISM``: above 1, two or more chunks are summarised at once (at most
    that many calls in flight) and merged; 1 keeps the ordered rolling update. ``model`` is the
    *summary* model (SPEC §11.2 choice); ``instructions`` the session's summary instructions, in every
    prompt (merges included).

    ``calibration`` (SPEC §5.1), when given, is used only for :meth:`capacity` (how much material
    fits one chunk). ``on_sample`` receives one calibration sample per summary attempt: the attempt's
    prompt estimate as sent (system + messages, envelopes included; summary calls carry no tools) and
    the prompt tokens the provider reported for it (from its usage, or from an overflow error that
    states the count).
    """

    provider: Provider
    model: str
    request_id: str
    recorder: CallRecorder
    deadline: float
    budget: SummaryCallBudget
    window: int
    safety_margin: int
    on_progress: ProgressCallback | None = None
    # A background job's id (SPEC §6.6): its calls carry X-Sidequest-Job-Id instead of a request id.
    job_id: str | None = None
    # Chunk summaries of one summary made at once (SPEC §6.3, SIDEQUEST_SUMMARY_PARALLELISM).
    parallelism: int = 1
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    # Wall-clock time for a summary's created_at (SPEC's one timestamp format).
    now: Callable[[], str] = utc_iso
    # The session's summary instructions (SPEC §11.2): sent with every summary call, after the built-in ones.
    instructions: str | None = None
    calibration: Calibration | None = None
    on_sample: SampleCallback | None = None
    # Attempts made through this runner (for context_info "calls"); the budget counts the same.
    attempts_made: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.parallelism < 1:
            raise ValueError("parallelism must be >= 1")

    def capacity(self, kind: SummaryKind) -> int:
        """Material tokens one call may carry, reserving the retry's output (8192) and prompt.

        The same capacity bounds a merge call's documents: the prompt reserve covers both prompts.
        """
        return summary_capacity(
            self.window,
            summary_prompt_reserve(kind, self.instructions),
            self.safety_margin,
            RETRY_OUTPUT_TOKENS,
            calibration=self.calibration,
        )

    @property
    def prompt_version(self) -> str:
        """The prompt version of this runner's calls (instructions included), for cache keys."""
        return prompt_version(self.instructions)

    def chunk(self, kind: SummaryKind, pieces: Sequence[str]) -> list[str]:
        """Pack material ``pieces`` (one per group) into chunks that each fit one call.

        Raises :class:`ContextOverflow` when the window leaves no room for material at all: chunking
        into nothing would loop forever, and no summary call could succeed.
        """
        capacity = self.capacity(kind)
        if capacity < MIN_CHUNK_CAPACITY:
            raise ContextOverflow(
                f"a {self.window}-token window leaves no room for summary material once the retry's "
                f"{RETRY_OUTPUT_TOKENS}-token output, the prompt and the safety margin are reserved"
            )
        return chunk_pieces(pieces, capacity)

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
                    {
                        "stage": STAGE_OF[kind],
                        "what": "summary_merge",
                        "purpose": PURPOSE_OF[kind],
                        "round": merge_round,
                        "merge": number,
                        "merges": len(calls),
                        "documents": len(group),
                    }
                )
                return await self.merge(
                    kind, [documents[i] for i in group], reservation=reservation, tally=tally
                )

        merged = iter(
            await _all_or_nothing([one_merge(number, group) for number, group in enumerate(calls, 1)])
        )
        return [next(merged) if len(group) > 1 else documents[group.start] for group in groups]

    async def summarize_chunk(
        self,
        kind: SummaryKind,
        material: str,
        previous: SummaryDocument | None,
        *,
        chunk_index: int = 1,
        chunks: int = 1,
        reservation: CallReservation | None = None,
        tally: CallTally | None = None,
    ) -> SummaryDocument:
        """One chunk: first attempt, and on a retryable failure exactly one retry from the same input."""
        previous_body = render_body(previous) if previous is not None else None

        def prompt(retry: bool) -> SummaryPrompt:
            return build_summary_prompt(
                kind,
                material,
                previous_body=previous_body,
                retry=retry,
                chunk=chunk_index,
                chunks=chunks,
                instructions=self.instructions,
            )

        return await self._call_with_retry(kind, prompt, reservation=reservation, tally=tally)

    async def merge(
        self,
        kind: SummaryKind,
        documents: Sequence[SummaryDocument],
        *,
        reservation: CallReservation | None = None,
        tally: CallTally | None = None,
    ) -> SummaryDocument:
        """One merge call over two or more valid ``documents`` (in material order), with the same
        first attempt, one retry and validation as a chunk."""
        bodies = [render_body(document) for document in documents]

        def prompt(retry: bool) -> SummaryPrompt:
            return build_merge_prompt(kind, bodies, retry=retry, instructions=self.instructions)

        return await self._call_with_retry(kind, prompt, reservation=reservation, tally=tally)

    async def _call_with_retry(
        self,
        kind: SummaryKind,
        prompt: Callable[[bool], SummaryPrompt],
        *,
        reservation: CallReservation | None,
        tally: CallTally | None,
    ) -> SummaryDocument:
        try:
            return await self._attempt(kind, prompt(False), retry=False, reservation=reservation, tally=tally)
        except (SummaryToolCall, SummaryCallCap):
            raise  # never retried: a tool call is a policy breach, the cap is the cap
        except SummaryError:
            pass  # empty / truncated / invalid / too long: the one retry below, from the same input
        return await self._attempt(kind, prompt(True), retry=True, reservation=reservation, tally=tally)

    async def _attempt(
        self,
        kind: SummaryKind,
        prompt: SummaryPrompt,
        *,
        retry: bool,
        reservation: CallReservation | None,
        tally: CallTally | None,
    ) -> SummaryDocument:
        cap = RETRY_OUTPUT_TOKENS if retry else FIRST_OUTPUT_TOKENS
        call = ProviderCall(
            model=self.model,
            messages=prompt.messages,
            max_output_tokens=cap,
            purpose=PURPOSE_OF[kind],
            request_id=self.request_id,
            system=prompt.system,
            tools=[],
            job_id=self.job_id,
        )

        def take() -> None:
            self.budget.take(reservation)
            self.attempts_made += 1
            if tally is not None:
                tally.calls += 1

        try:
            result = await run_call(
                self.provider,
                call,
                recorder=self.recorder,
                deadline=self.deadline,
                before_attempt=take,
                clock=self.clock,
                sleep=self.sleep,
            )
        except ContextOverflow as exc:
            if exc.prompt_tokens is not None:
                await self._sample(prompt_estimate(prompt.system, prompt.messages), exc.prompt_tokens)
            raise
        if result.usage.reported:
            await self._sample(prompt_estimate(prompt.system, prompt.messages), result.usage.input_tokens)
        return judge_reply(result, cap)

    async def _sample(self, estimate: int, prompt_tokens: int) -> None:
        if self.on_sample is not None:
            await self.on_sample(self.model, estimate, prompt_tokens)


def prompt_estimate(system: str | None, messages: Sequence[dict[str, Any]]) -> int:
    """A summary call's estimate as sent: its system prompt plus its messages (envelopes included)."""
    return estimate_system(system) + estimate_messages(messages)


def _chunk_event(kind: SummaryKind, chunk: int, chunks: int) -> dict[str, Any]:
    return {
        "stage": STAGE_OF[kind],
        "what": "summary_chunk",
        "purpose": PURPOSE_OF[kind],
        "chunk": chunk,
        "chunks": chunks,
    }


def worst_piece_tokens(documents: int) -> int:
    """The largest a merge call's document can be: a body at the 2200-token limit, plus its tag."""
    return BODY_TOKEN_LIMIT + estimate_text(merge_piece(max(documents, 1), ""))


def judge_reply(result: CallResult, max_output_tokens: int) -> SummaryDocument:
    """Turn one finished call into a valid document or the failure it is.

    Order matters: a tool call is fatal whatever else came; a reply cut at its cap is ``truncated``
    even when no text survived (a thinking model can spend the whole cap thinking); then empty, then
    the strict parse, then the body size.
    """
    if result.tool_calls or result.stop_reason == "tool_calls":
        name = result.tool_calls[0].name if result.tool_calls else "(unnamed)"
        raise SummaryToolCall(tool_name=name)
    if result.stop_reason in _TRUNCATED or result.raw_stop_reason in _TRUNCATED:
        raise SummaryTruncated(
            max_output_tokens=max_output_tokens, stop_reason=result.stop_reason or "length"
        )
    if not result.text.strip():
        raise SummaryEmpty(thinking_only=bool(result.reasoning.strip()))
    document = parse_summary_document(result.text)
    check_body_size(document)
    return document


__all__ = [
    "PURPOSE_OF",
    "STAGE_OF",
    "CallReservation",
    "CallTally",
    "ProgressCallback",
    "SampleCallback",
    "SummaryCallBudget",
    "SummaryPlan",
    "SummaryRunner",
    "judge_reply",
    "prompt_estimate",
    "worst_piece_tokens",
]
