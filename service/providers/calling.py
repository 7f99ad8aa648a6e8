"""The calling policy shared by summary calls and answers (SPEC §7, §8; docs/providers.md, "Calling
policy"): it records **every attempt** with the usage the provider reported for it, and retries nothing
but a rate limit: the rest is the caller's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from service.providers.base import (
    CallUsage,
    Finish,
    Provider,
    ProviderCall,
    ProviderError,
    ProviderTimeout,
    RateLimited,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    UsageReport,
)

log = logging.getLogger(__name__)

# Waits between rate-limit retries when the provider sends no Retry-After, one per retry: a rate limit
# is retried as many times (SPEC §7: twice at most).
DEFAULT_BACKOFF_S: tuple[float, ...] = (1.0, 2.0)

CallStatus = Literal["ok", "failed", "cancelled"]
_CUT_AT_CAP = frozenset({"length", "max_tokens"})


@dataclass
class CallResult:
    """What one successful call produced."""

    text: str
    reasoning: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    stop_reason: str | None = None
    raw_stop_reason: str | None = None
    usage: CallUsage = field(default_factory=CallUsage)

    @property
    def truncated(self) -> bool:
        """Whether the reply was cut at its output cap: SPEC §3's ``length``, or a ``max_tokens`` stop
        (Anthropic's raw value, or any server's that an adapter passes through unmapped)."""
        return self.stop_reason in _CUT_AT_CAP or self.raw_stop_reason in _CUT_AT_CAP

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt tokens the provider reported for the call; None when it reported no usage."""
        return self.usage.input_tokens if self.usage.reported else None


@dataclass(frozen=True)
class CallRecord:
    """One provider call attempt (SPEC §3 ``usage.calls``): the usage the provider reported (zeros,
    ``reported=False``, if none) and its wall time, from sending the request to its last event or error."""

    purpose: str
    model: str
    status: CallStatus
    usage: CallUsage
    latency_ms: int = 0


class CallRecorder(Protocol):
    """Receives one record per provider call attempt."""

    async def record_call(self, call: CallRecord) -> None: ...


async def run_call(
    provider: Provider,
    call: ProviderCall,
    *,
    recorder: CallRecorder,
    deadline: float,
    on_text: Callable[[str], Awaitable[None]] | None = None,
    before_attempt: Callable[[], Awaitable[None]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> CallResult:
    """Run ``call`` under the calling policy (docs/providers.md, "Calling policy"). ``deadline``: an
    absolute ``clock()`` value bounding every attempt; ``before_attempt`` is awaited before each one and
    may raise to refuse it (the summary call cap); text deltas go to ``on_text``."""
    attempts = 0
    while True:
        remaining = deadline - clock()
        if remaining <= 0:
            raise ProviderTimeout(f"the deadline passed before {call.purpose} call attempt {attempts + 1}")
        if before_attempt is not None:
            await before_attempt()
        attempts += 1
        try:
            return await _attempt(
                provider, replace(call, timeout_s=remaining), recorder=recorder, on_text=on_text
            )
        except RateLimited as exc:
            exc.attempts = attempts
            if exc.quota_exhausted or attempts > len(DEFAULT_BACKOFF_S):  # its retries are used up
                raise
            if exc.after_output and on_text is not None:
                # Text streamed to the client cannot be taken back, so a partial reply is never retried
                # (SPEC 7: that would append a second reply): a stream that broke (SPEC 8
                # provider_error), not a limit "still refused after up to two waits".
                raise ProviderError(
                    f"the reply broke off after it had begun: {exc.message}",
                    status=exc.status,
                    usage=exc.usage,
                    after_output=True,
                ) from exc
            wait = DEFAULT_BACKOFF_S[attempts - 1] if exc.retry_after_s is None else exc.retry_after_s
            if clock() + wait >= deadline:
                raise  # waiting would use up the request's time: give up now, with the real cause
            await sleep(wait)


async def _attempt(
    provider: Provider,
    call: ProviderCall,
    *,
    recorder: CallRecorder,
    on_text: Callable[[str], Awaitable[None]] | None,
) -> CallResult:
    """One provider call (``call.timeout_s`` is the time left), recorded exactly once whatever happens."""
    # The attempt's running state, so that a failure still records the usage seen so far.
    text: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[ToolCall] = []
    usage: CallUsage | None = None
    finish: Finish | None = None
    started = time.monotonic()

    async def record(status: CallStatus, reported: CallUsage | None) -> None:
        # Written even when this task is cancelled meanwhile: parallel calls that pass one deadline
        # together each record their end while the first failure cancels the rest (SPEC 7: every
        # call has its usage entry). A cancel waits for the write, then holds.
        write = asyncio.ensure_future(
            recorder.record_call(
                CallRecord(
                    purpose=call.purpose,
                    model=call.model or provider.default_model,
                    status=status,
                    usage=reported if reported is not None else CallUsage(reported=False),
                    latency_ms=round((time.monotonic() - started) * 1000),
                )
            )
        )
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            while not write.done():  # a second cancel waits for it too (the write is bounded by the
                with contextlib.suppress(asyncio.CancelledError):  # statement timeout)
                    await asyncio.shield(write)
            if not write.cancelled() and write.exception() is not None:
                log.warning("a cancelled call's usage could not be recorded: %r", write.exception())
            raise

    try:
        async with asyncio.timeout(call.timeout_s):
            # Closed (with its HTTP response) on the way out, not whenever it is garbage-collected.
            async with contextlib.aclosing(provider.stream(call)) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        text.append(event.text)
                        if on_text is not None:
                            await on_text(event.text)
                    elif isinstance(event, ReasoningDelta):
                        reasoning.append(event.text)
                    elif isinstance(event, ToolCall):
                        tool_calls.append(event)
                    elif isinstance(event, UsageReport):
                        # Reports are cumulative: the last one is the call's usage.
                        usage = event.usage
                    elif isinstance(event, Finish):
                        finish = event
    except TimeoutError as exc:
        await record("failed", usage)
        message = f"{call.purpose} call did not finish within {call.timeout_s:.1f}s"
        raise ProviderTimeout(message, usage=usage) from exc
    except asyncio.CancelledError:
        await record("cancelled", usage)
        raise
    except ProviderError as exc:
        if exc.usage is None:
            exc.usage = usage
        # A reply that had begun (text, or a tool call: SPEC 7 retries neither) failed part-way.
        exc.after_output = bool(text or tool_calls)
        await record("failed", exc.usage)
        raise
    except Exception:
        await record("failed", usage)
        raise

    await record("ok", usage)
    return CallResult(
        text="".join(text),
        reasoning="".join(reasoning),
        tool_calls=tool_calls,
        stop_reason=finish.stop_reason if finish else None,
        raw_stop_reason=finish.raw_stop_reason if finish else None,
        usage=usage or CallUsage(reported=False),
    )
