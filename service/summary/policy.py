"""The summary call policy (SPEC §6.3): one call, its one retry, under the per-request call cap
(docs/summaries.md, "The call policy"). Every provider attempt is counted *before* it goes out, so the
call after the last allowed one is never made.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from service.budget import (
    MIN_CHUNK_CAPACITY,
    Calibration,
    chunk_pieces,
    summary_capacity,
    summary_output_caps,
)
from service.providers.base import ContextOverflow, Provider, ProviderCall, ProviderError, Purpose
from service.providers.calling import CallRecorder, CallResult, run_call
from service.summary.document import (
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
from service.summary.prompts import (
    SummaryKind,
    SummaryPrompt,
    build_merge_prompt,
    build_summary_prompt,
    prompt_version,
    summary_prompt_reserve,
)
from service.vocabulary import Stage, utc_iso

PURPOSE_OF: dict[SummaryKind, Purpose] = {"qa": "qa_summary", "context": "context_summary"}
STAGE_OF: dict[SummaryKind, Stage] = {"qa": Stage.ORGANIZING_HISTORY, "context": Stage.COMPACTING_CONTEXT}

# A calibration sample (SPEC §5.1): model, the request's estimate as sent, the reported prompt tokens
# (None when the provider reported none; the sink then records nothing).
SampleCallback = Callable[[str, int, int | None], Awaitable[None]]


class SummaryCallBudget:
    """The per-request summary call cap (``SIDEQUEST_MAX_SUMMARY_CALLS``), shared by the Q&A fold and
    the compaction of one side request, which may run at the same time: every method is synchronous,
    and each plan reserves its calls first (docs/summaries.md, "Two summaries of one request at once")."""

    def __init__(self, max_calls: int) -> None:
        if max_calls < 0:
            raise ValueError("max_calls must be >= 0")
        self.max_calls = max_calls
        self.calls_made = 0
        self.reserved = 0  # calls promised to running plans and not yet made

    @property
    def remaining(self) -> int:
        """Calls still allowed and not promised to a running plan."""
        return self.max_calls - self.calls_made - self.reserved

    def take(self, reservation: CallReservation | None = None) -> None:
        """Count one call about to be made, out of ``reservation`` while it has calls left, else out of
        what no plan holds (a retry beyond its plan); raise :class:`SummaryCallCap` if none is left."""
        if reservation is not None and reservation.left > 0:
            if reservation.budget is not self:
                raise ValueError("the reservation belongs to another budget")
            reservation.left -= 1
            self.reserved -= 1
        else:
            self.require()
        self.calls_made += 1

    def require(self, calls_needed: int = 1) -> None:
        """Fail now if a plan already needs more calls than remain (before any of them is spent)."""
        if calls_needed > self.remaining:
            raise SummaryCallCap(
                calls_made=self.calls_made,
                calls_needed=calls_needed,
                max_calls=self.max_calls,
                calls_reserved=self.reserved,
            )

    def reserve(self, calls_needed: int) -> CallReservation:
        """:meth:`require` the plan's calls and hold them for it until it releases the rest (``with
        budget.reserve(n) as reservation:``, the reservation passed to ``take``)."""
        self.require(calls_needed)
        self.reserved += calls_needed
        return CallReservation(self, calls_needed)


@dataclass
class CallReservation:
    """Calls a plan holds in a :class:`SummaryCallBudget`; :meth:`release` returns those not made."""

    budget: SummaryCallBudget
    left: int

    def release(self) -> None:
        """Give back the calls not made (idempotent)."""
        self.budget.reserved -= self.left
        self.left = 0

    def __enter__(self) -> CallReservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclass
class SummaryCaller:
    """Everything a side request's summary calls share, and one call with its retry. ``deadline``: an
    absolute ``time.monotonic()`` value (as for ``run_call``); ``window`` / ``safety_margin``: the
    summary ``model``'s; ``on_sample`` receives one calibration sample per attempt (SPEC §5.1)."""

    provider: Provider
    model: str
    request_id: str
    recorder: CallRecorder
    deadline: float
    budget: SummaryCallBudget
    window: int
    safety_margin: int
    # A background job's id (SPEC §6.6): its calls carry X-Sidequest-Job-Id instead of a request id.
    job_id: str | None = None
    now: Callable[[], str] = utc_iso  # a summary's created_at
    # The session's summary instructions (SPEC §11.2), in every summary and merge prompt.
    instructions: str | None = None
    calibration: Calibration | None = None
    on_sample: SampleCallback | None = None
    # Awaited before each attempt goes out (a background job counts its calls as they start, so a
    # clear that cancels it mid-call reports the call in flight too: SPEC §6.6 memory events).
    on_attempt: Callable[[], Awaitable[None]] | None = None
    # What the summarised material is (SPEC §6.8: ``MASKED_MATERIAL`` when it is the masked form):
    # part of the cache key, since a summary of masked groups must not stand for one of the raw ones.
    material_variant: str | None = None
    # Attempts made through this caller (for context_info "calls"); the budget counts the same. Two
    # summaries of one request that run at once each have their own caller on the one budget.
    attempts_made: int = field(default=0, init=False)

    def output_caps(self, kind: SummaryKind) -> tuple[int, int]:
        """The (first attempt, retry) output caps: 2048 and 8192, smaller only in a window too small."""
        return summary_output_caps(
            self.window, summary_prompt_reserve(kind, self.instructions), self.safety_margin
        )

    def capacity(self, kind: SummaryKind) -> int:
        """Material tokens one call (a chunk's, or a merge call's documents) may carry, reserving the
        retry's output and the larger of the two prompts."""
        return summary_capacity(
            self.window,
            summary_prompt_reserve(kind, self.instructions),
            self.safety_margin,
            self.output_caps(kind)[1],
            calibration=self.calibration,
        )

    @property
    def prompt_version(self) -> str:
        """The prompt version of these calls (instructions and material included), for cache keys."""
        base = prompt_version(self.instructions)
        return base if self.material_variant is None else f"{base}+{self.material_variant}"

    def chunk(self, kind: SummaryKind, pieces: Sequence[str]) -> list[str]:
        """Pack material ``pieces`` (one per group) into chunks that each fit one call; ContextOverflow
        when the window leaves no room for material at all (no summary call could succeed)."""
        capacity = self.capacity(kind)
        if capacity < MIN_CHUNK_CAPACITY:
            raise ContextOverflow(
                f"a {self.window}-token window leaves no room for summary material once the retry's "
                f"{self.output_caps(kind)[1]}-token output, the prompt and the safety margin are reserved"
            )
        return chunk_pieces(pieces, capacity)

    def chunk_prompt(
        self, kind: SummaryKind, material: str, previous: SummaryDocument | None, chunk: int, chunks: int
    ) -> Callable[..., SummaryPrompt]:
        """The prompt of chunk ``chunk`` of ``chunks`` (``retry=`` picks the attempt): an update of
        ``previous`` when given."""
        return functools.partial(
            build_summary_prompt,
            kind,
            material,
            previous_body=render_body(previous) if previous is not None else None,
            chunk=chunk,
            chunks=chunks,
            instructions=self.instructions,
        )

    def merge_prompt(
        self, kind: SummaryKind, documents: Sequence[SummaryDocument]
    ) -> Callable[..., SummaryPrompt]:
        """The prompt of one merge call over two or more valid ``documents`` (in material order)."""
        bodies = [render_body(document) for document in documents]
        return functools.partial(build_merge_prompt, kind, bodies, instructions=self.instructions)

    async def call(
        self,
        kind: SummaryKind,
        prompt: Callable[..., SummaryPrompt],
        *,
        reservation: CallReservation | None,
    ) -> SummaryDocument:
        """One chunk or merge call: the first attempt, and on a retryable failure exactly one retry
        from the same input."""

        async def take() -> None:  # before every attempt, rate-limit retries included
            self.budget.take(reservation)
            self.attempts_made += 1
            if self.on_attempt is not None:
                await self.on_attempt()

        async def attempt(retry: bool) -> SummaryDocument:
            sent = prompt(retry=retry)
            cap = self.output_caps(kind)[1 if retry else 0]
            call = ProviderCall(
                model=self.model,
                messages=sent.messages,
                max_output_tokens=cap,
                purpose=PURPOSE_OF[kind],
                request_id=self.request_id,
                system=sent.system,
                job_id=self.job_id,
            )
            try:
                result = await run_call(
                    self.provider,
                    call,
                    recorder=self.recorder,
                    deadline=self.deadline,
                    before_attempt=take,
                )
            except ProviderError as exc:
                # An overflow may state the prompt's count; another failure may have reported usage (§5.1).
                tokens = exc.prompt_tokens if isinstance(exc, ContextOverflow) else exc.reported_prompt_tokens
                await self._sample(sent, tokens)
                raise
            await self._sample(sent, result.prompt_tokens)
            return judge_reply(result, cap)

        try:
            return await attempt(retry=False)
        except (SummaryToolCall, SummaryCallCap):
            raise  # never retried: a tool call is a policy breach, the cap is the cap
        except SummaryError:
            pass  # empty / truncated / invalid / too long: the one retry below, from the same input
        return await attempt(retry=True)

    async def _sample(self, prompt: SummaryPrompt, prompt_tokens: int | None) -> None:
        if self.on_sample is not None and prompt_tokens is not None:
            await self.on_sample(self.model, prompt.tokens(), prompt_tokens)


def judge_reply(result: CallResult, max_output_tokens: int) -> SummaryDocument:
    """Turn one finished call into a valid document or the failure it is, judged in the order of
    docs/summaries.md (a reply cut at its cap is ``truncated`` even when no text survived: a thinking
    model can spend the whole cap thinking)."""
    if result.tool_calls or result.stop_reason == "tool_calls":
        raise SummaryToolCall(tool_name=result.tool_calls[0].name if result.tool_calls else "(unnamed)")
    if result.truncated:
        raise SummaryTruncated(
            max_output_tokens=max_output_tokens, stop_reason=result.stop_reason or "length"
        )
    if not result.text.strip():
        raise SummaryEmpty(thinking_only=bool(result.reasoning.strip()))
    document = parse_summary_document(result.text)
    check_body_size(document)
    return document
