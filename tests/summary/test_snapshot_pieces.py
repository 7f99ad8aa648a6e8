"""A prepared snapshot's transcript pieces (service.summary.context.snapshot_pieces): each group's
messages rendered as the summary's material, each group rendered at most once per snapshot, and
rendered ahead of time in slices (warm_snapshot_pieces) without holding the event loop."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from service.budget.prepared import PreparedSnapshot, prepare_snapshot
from service.summary import context
from service.summary.context import snapshot_pieces, warm_snapshot_pieces
from service.summary.material import render_messages


def _prepared(turns: int = 100) -> PreparedSnapshot:
    messages: list[dict[str, Any]] = []
    for i in range(turns):
        messages += [
            {"role": "user", "content": f"step {i}: read module_{i}.py"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": f"t{i}", "name": "read", "input": {"path": f"m{i}"}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": f"x = {i}"}],
            },
        ]
    return prepare_snapshot({"messages": messages})


def _rendered(prepared: PreparedSnapshot, start: int, end: int) -> list[str]:
    """Each group within ``[start, end)`` rendered from its messages."""
    groups = [g for g in prepared.groups if g.start >= start and g.end <= end]
    return [render_messages(prepared.messages[g.start : g.end], g.start) for g in groups]


@pytest.fixture
def renders(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The start of every group rendered, in order."""
    rendered: list[int] = []
    piece = context._piece

    def counting(messages: Any, group: Any) -> str:
        rendered.append(group.start)
        return piece(messages, group)

    monkeypatch.setattr(context, "_piece", counting)
    return rendered


def test_the_pieces_are_the_groups_in_the_range_rendered(renders: list[int]) -> None:
    prepared = _prepared()
    for start, end in ((0, len(prepared.messages)), (0, 120), (30, 120), (299, 300)):
        assert snapshot_pieces(prepared, start, end) == _rendered(prepared, start, end)


def test_each_group_is_rendered_once_per_snapshot(renders: list[int]) -> None:
    prepared = _prepared()
    snapshot_pieces(prepared, 0, 150)
    first = len(renders)
    snapshot_pieces(prepared, 0, 150)
    assert len(renders) == first  # all reused
    snapshot_pieces(prepared, 0, 300)
    assert sorted(renders) == sorted({g.start for g in prepared.groups})  # the rest, once each
    # Another preparation of the same content has its own memo (it is per preparation).
    other = _prepared()
    snapshot_pieces(other, 0, 3)
    assert len(renders) == len(prepared.groups) + 2  # its first two groups: messages 0, then 1–2


async def test_warming_renders_every_group_in_slices_and_lets_other_tasks_run(renders: list[int]) -> None:
    prepared = _prepared()
    ticks: list[int] = []

    async def other_task() -> None:
        while True:
            ticks.append(len(renders))  # how many groups were rendered when this task ran
            await asyncio.sleep(0)

    ticker = asyncio.ensure_future(other_task())
    try:
        await warm_snapshot_pieces(prepared, slice_groups=16)
    finally:
        ticker.cancel()
    assert sorted(renders) == [g.start for g in prepared.groups]
    # The other task ran between slices: never more than one slice rendered between two of its turns.
    steps = [b - a for a, b in itertools.pairwise(ticks)]
    assert steps and max(steps) <= 16 and len(ticks) >= len(prepared.groups) // 16
    before = len(renders)
    pieces = snapshot_pieces(prepared, 0, len(prepared.messages))
    assert len(renders) == before  # nothing rendered twice
    assert pieces == _rendered(prepared, 0, len(prepared.messages))


async def test_warming_after_a_partial_render_renders_only_the_rest(renders: list[int]) -> None:
    prepared = _prepared()
    snapshot_pieces(prepared, 0, 60)
    already = len(renders)
    await warm_snapshot_pieces(prepared)
    assert len(renders) == len(prepared.groups) and len(set(renders)) == len(renders)
    assert already > 0
