"""Fixtures for the summary tests: a scripted server on 127.0.0.1, the real OpenAI adapter, a runner."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from service.budget import safety_margin
from service.providers.openai_compat import OpenAIProvider
from service.summary.policy import SummaryCallBudget
from service.summary.runner import SummaryRunner
from tests.summary.helpers import MemoryRecorder, RespondingServer

MODEL = "scripted-model"


@pytest.fixture
def server() -> Iterator[RespondingServer]:
    running = RespondingServer()
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
async def provider(server: RespondingServer) -> AsyncIterator[OpenAIProvider]:
    adapter = OpenAIProvider(server.base_url, "test-key", default_model=MODEL)
    try:
        yield adapter
    finally:
        await adapter.aclose()


@pytest.fixture
def recorder() -> MemoryRecorder:
    return MemoryRecorder()


RunnerFactory = Callable[..., SummaryRunner]


@pytest.fixture
def make_runner(provider: OpenAIProvider, recorder: MemoryRecorder) -> RunnerFactory:
    """Build a runner: ``make_runner(max_calls=12, window=200_000, timeout_s=30, progress=list,
    parallelism=1, budget=None)`` (``budget``: share one SummaryCallBudget between runners)."""

    def build(
        *,
        max_calls: int = 12,
        window: int = 200_000,
        timeout_s: float = 30.0,
        progress: list[dict[str, Any]] | None = None,
        parallelism: int = 1,
        budget: SummaryCallBudget | None = None,
    ) -> SummaryRunner:
        async def on_progress(event: dict[str, Any]) -> None:
            if progress is not None:
                progress.append(event)

        clock_values = iter(f"2026-11-29T10:{i // 60:02d}:{i % 60:02d}Z" for i in range(10_000))
        return SummaryRunner(
            provider=provider,
            model=MODEL,
            request_id="7d1c1e0e-0000-4000-8000-000000000001",
            recorder=recorder,
            deadline=time.monotonic() + timeout_s,
            budget=budget if budget is not None else SummaryCallBudget(max_calls),
            window=window,
            safety_margin=safety_margin(window),
            on_progress=on_progress,
            parallelism=parallelism,
            now=lambda: next(clock_values),
        )

    return build
