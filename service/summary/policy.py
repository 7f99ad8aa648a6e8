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
Chunks are updates of the running summary, which is always the last *valid* document: a failure raises,
so a failed partial summary can never become the input of the next call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from service.budget import (
    FIRST_OUTPUT_TOKENS,
    MIN_CHUNK_CAPACITY,
    RETRY_OUTPUT_TOKENS,
    Calibration,
    chunk_pieces,
    estimate_messages,
    estimate_system,
    summary_capacity,
)
from service.providers.base import ContextOverflow, Provider, ProviderCall, Purpose
from service.providers.calling import CallRecorder, CallResult, run_call
from service.summary.document import SummaryDocument, check_body_size, parse_summary_document, render_body
from service.summary.errors import (
    SummaryCallCap,
    SummaryEmpty,
    SummaryError,
    SummaryToolCall,
    SummaryTruncated,
)
from service.summary.prompts import SummaryKind, build_summary_prompt, summary_prompt_reserve

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
    compaction, so retries and rate-limit attempts of either count against the same cap.
    """

    def __init__(self, max_calls: int) -> None:
        if max_calls < 0:
            raise ValueError("max_calls must be >= 0")
        self.max_calls = max_calls
        self.calls_made = 0

    @property
    def remaining(self) -> int:
        """Calls still allowed."""
        return self.max_calls - self.calls_made

    def take(self) -> None:
        """Count one call about to be made; raise :class:`SummaryCallCap` instead if none is left.

        Raising *before* the call is what guarantees the (cap + 1)-th call is never sent.
        """
        if self.calls_made >= self.max_calls:
            raise SummaryCallCap(calls_made=self.calls_made, calls_needed=1, max_calls=self.max_calls)
        self.calls_made += 1

    def require(self, calls_needed: int) -> None:
        """Fail now if a plan already needs more calls than remain (before any of them is spent)."""
        if calls_needed > self.remaining:
            raise SummaryCallCap(
                calls_made=self.calls_made, calls_needed=calls_needed, max_calls=self.max_calls
            )


def utc_now_iso() -> str:
    """Wall-clock time as ISO 8601 UTC with microseconds (the default ``SummaryRunner.now``)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class SummaryRunner:
    """Everything a side request's summary calls share.

    ``deadline`` is an absolute ``clock()`` value (the request's deadline, as for ``run_call``).
    ``window`` / ``safety_margin`` are the summariser model's window numbers; chunk capacity is derived
    from them. ``on_progress`` receives one event dict per chunk.

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
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    now: Callable[[], str] = utc_now_iso
    calibration: Calibration | None = None
    on_sample: SampleCallback | None = None
    # Attempts made through this runner (for context_info "calls"); the budget counts the same.
    attempts_made: int = field(default=0, init=False)

    def capacity(self, kind: SummaryKind) -> int:
        """Material tokens one call may carry, reserving the retry's output (8192) and prompt."""
        return summary_capacity(
            self.window,
            summary_prompt_reserve(kind),
            self.safety_margin,
            RETRY_OUTPUT_TOKENS,
            calibration=self.calibration,
        )

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

    async def summarize(
        self,
        kind: SummaryKind,
        chunks: Sequence[str],
        previous: SummaryDocument | None,
        *,
        check_cap: bool = True,
        progress_offset: int = 0,
        progress_total: int | None = None,
    ) -> SummaryDocument:
        """Summarise ``chunks`` in order, each as an update of the running summary.

        ``previous`` is the summary the first chunk updates (None: start fresh). ``check_cap`` runs
        :meth:`SummaryCallBudget.require` for one call per chunk first; a caller that already required
        a larger plan passes False. ``progress_offset`` / ``progress_total`` number the progress events
        when this is one part of a larger plan (several Q&A batches). Returns the last valid document;
        raises the first failure.
        """
        if not chunks:
            if previous is None:
                raise ValueError("nothing to summarise")
            return previous
        if check_cap:
            self.budget.require(len(chunks))
        running = previous
        total = len(chunks)
        for index, chunk in enumerate(chunks, start=1):
            if self.on_progress is not None:
                await self.on_progress(
                    {
                        "stage": STAGE_OF[kind],
                        "what": "summary_chunk",
                        "purpose": PURPOSE_OF[kind],
                        "chunk": progress_offset + index,
                        "chunks": progress_total if progress_total is not None else total,
                    }
                )
            running = await self.summarize_chunk(kind, chunk, running, chunk_index=index, chunks=total)
        assert running is not None
        return running

    async def summarize_chunk(
        self,
        kind: SummaryKind,
        material: str,
        previous: SummaryDocument | None,
        *,
        chunk_index: int = 1,
        chunks: int = 1,
    ) -> SummaryDocument:
        """One chunk: first attempt, and on a retryable failure exactly one retry from the same input."""
        previous_body = render_body(previous) if previous is not None else None
        try:
            return await self._attempt(
                kind, material, previous_body, retry=False, chunk=chunk_index, chunks=chunks
            )
        except (SummaryToolCall, SummaryCallCap):
            raise  # never retried: a tool call is a policy breach, the cap is the cap
        except SummaryError:
            pass  # empty / truncated / invalid / too long: the one retry below
        return await self._attempt(
            kind, material, previous_body, retry=True, chunk=chunk_index, chunks=chunks
        )

    async def _attempt(
        self,
        kind: SummaryKind,
        material: str,
        previous_body: str | None,
        *,
        retry: bool,
        chunk: int,
        chunks: int,
    ) -> SummaryDocument:
        prompt = build_summary_prompt(
            kind, material, previous_body=previous_body, retry=retry, chunk=chunk, chunks=chunks
        )
        cap = RETRY_OUTPUT_TOKENS if retry else FIRST_OUTPUT_TOKENS
        call = ProviderCall(
            model=self.model,
            messages=prompt.messages,
            max_output_tokens=cap,
            purpose=PURPOSE_OF[kind],
            request_id=self.request_id,
            system=prompt.system,
            tools=[],
        )

        def take() -> None:
            self.budget.take()
            self.attempts_made += 1

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
    "ProgressCallback",
    "SampleCallback",
    "SummaryCallBudget",
    "SummaryRunner",
    "judge_reply",
    "prompt_estimate",
    "utc_now_iso",
]
