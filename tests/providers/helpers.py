"""Small helpers shared by the provider tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.providers.base import (
    CallUsage,
    Finish,
    Provider,
    ProviderCall,
    ProviderEvent,
    Purpose,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    UsageReport,
)
from service.providers.calling import CallRecord


def make_call(
    *,
    purpose: Purpose = "answer",
    messages: list[dict[str, Any]] | None = None,
    system: str | None = "You are terse.",
    tools: list[dict[str, Any]] | None = None,
    max_output_tokens: int = 512,
    model: str = "scripted-model",
    timeout_s: float = 10.0,
    request_id: str = "2f0e4f0a-0000-4000-8000-000000000001",
) -> ProviderCall:
    return ProviderCall(
        model=model,
        messages=messages if messages is not None else [{"role": "user", "content": "What is 2+2?"}],
        max_output_tokens=max_output_tokens,
        purpose=purpose,
        request_id=request_id,
        system=system,
        tools=tools or [],
        timeout_s=timeout_s,
    )


@dataclass
class Collected:
    """Everything one stream yielded, split by kind."""

    events: list[ProviderEvent]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TextDelta))

    @property
    def text_deltas(self) -> list[str]:
        return [e.text for e in self.events if isinstance(e, TextDelta)]

    @property
    def reasoning(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, ReasoningDelta))

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [e for e in self.events if isinstance(e, ToolCall)]

    @property
    def usages(self) -> list[CallUsage]:
        return [e.usage for e in self.events if isinstance(e, UsageReport)]

    @property
    def finish(self) -> Finish:
        assert isinstance(self.events[-1], Finish), self.events
        return self.events[-1]


async def collect(provider: Provider, call: ProviderCall) -> Collected:
    return Collected([event async for event in provider.stream(call)])


@dataclass
class ListRecorder:
    """A CallRecorder that keeps every attempt in a list."""

    calls: list[CallRecord] = field(default_factory=list)

    async def record_call(self, call: CallRecord) -> None:
        self.calls.append(call)
