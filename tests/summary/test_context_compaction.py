"""Context compaction over real HTTP: chunking a 300 000-character snapshot, and the content-keyed cache
(hit / miss / prefix reuse) counted in provider calls."""

from __future__ import annotations

import itertools
from typing import Any

from service.budget import (
    RETRY_OUTPUT_TOKENS,
    CutPlan,
    estimate_messages,
    estimate_system,
    estimate_text,
    group_messages,
    plan_cut,
    safety_margin,
)
from service.budget.prepared import PreparedSnapshot, prepare_snapshot
from service.summary.context import compact_snapshot
from service.summary.document import render_summary
from service.summary.material import render_messages
from service.summary.prompts import PROMPT_VERSION, build_answer_request
from tests.summary.conftest import MODEL, RunnerFactory
from tests.summary.helpers import (
    RespondingServer,
    material_of,
    merging_summariser,
    output_cap_of,
    previous_of,
)

CHINESE = "我们需要先修复数据库连接池的超时问题，然后再检查缓存层是否在高并发下丢失写入。"
CODE = (
    "def handle_{i}(request: Request) -> Response:\n"
    "    payload = json.loads(request.body)  # 解析请求\n"
    "    if payload.get('retry', 0) > {i}:\n"
    "        raise TimeoutError('pool exhausted at step {i}')\n"
    "    return Response(status=200, body=json.dumps({{'ok': True, 'n': {i}}}))\n"
)


def mixed_snapshot(target_chars: int = 300_000) -> list[dict[str, Any]]:
    """A transcript of Chinese prose, tool calls and code results, ``target_chars`` long in total.

    Group 3 is one huge tool result (larger than a whole chunk) so chunking must also split inside a
    group, at line boundaries. The first user message carries a fact to find again later.
    """
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "FACT: 连接池上限是 64。请修复超时问题。\n" + CHINESE * 20}
    ]
    huge = "".join(CODE.format(i=i) + CHINESE + "\n" for i in range(700))
    i = 0
    chars = len(messages[0]["content"])
    while chars < target_chars:
        tool_id = f"t{i}"
        body = huge if i == 1 else "".join(CODE.format(i=i * 10 + k) for k in range(6))
        turn: list[dict[str, Any]] = [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": CHINESE * 3},
                    {
                        "type": "tool_use",
                        "id": tool_id,
                        "name": "read_file",
                        "input": {"path": f"src/m{i}.py"},
                    },
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": body}]},
        ]
        for message in turn:
            chars += sum(len(b.get("text", "")) + len(str(b.get("content", ""))) for b in message["content"])
        messages.extend(turn)
        i += 1
    messages.append({"role": "assistant", "content": [{"type": "text", "text": "好的，超时问题已修复。"}]})
    messages.append({"role": "user", "content": "现在运行测试。"})
    return messages


def _chars(messages: list[dict[str, Any]]) -> int:
    total = 0
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            total += len(content)
        else:
            total += sum(len(b.get("text", "")) + len(str(b.get("content", ""))) for b in content)
    return total


async def test_a_300k_character_chinese_and_code_snapshot_is_summarised_chunk_by_chunk(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("context_summary", merging_summariser)
    messages = mixed_snapshot()
    assert _chars(messages) >= 300_000
    groups = group_messages(messages)
    plan = plan_cut(groups)
    assert isinstance(plan, CutPlan)
    window = 48_000
    progress: list[dict[str, Any]] = []
    runner = make_runner(window=window, progress=progress)
    capacity = runner.capacity("context")

    prepared = prepare_snapshot({"messages": messages})
    result = await compact_snapshot(
        runner, "snap-1", prepared, plan.summarize_until, [], "2026-11-29T10:00:00Z"
    )

    requests = server.requests("context_summary")
    assert result.cache == "miss"
    assert result.chunks == len(requests) == result.calls >= 4
    assert runner.budget.calls_made == len(requests) <= 12
    materials = [material_of(r) for r in requests]
    # Every chunk fits one call: the material within capacity, and the whole prompt with the retry's
    # output cap within the window less its margin.
    for request, material in zip(requests, materials, strict=True):
        assert estimate_text(material) <= capacity
        system = request.body["messages"][0]["content"]
        user = request.body["messages"][1:]
        assert estimate_system(system) + estimate_messages(
            user
        ) + RETRY_OUTPUT_TOKENS <= window - safety_margin(window)
        assert output_cap_of(request) == 2048
    # All material covered, in order, nothing lost or duplicated, no character split.
    assert "".join(materials) == render_messages(messages[: plan.summarize_until])
    # The huge tool result (messages 3-4, larger than a whole chunk) was cut inside, at a line end.
    whole = "".join(materials)
    huge_start = whole.index("[message 3 ")
    huge_end = whole.index("[message 5 ")
    assert huge_end - huge_start > capacity  # more characters than a chunk holds tokens (and bytes)
    boundaries = [sum(len(m) for m in materials[: k + 1]) for k in range(len(materials) - 1)]
    inside = [b for b in boundaries if huge_start < b < huge_end]
    assert inside and all(whole[b - 1] == "\n" for b in inside)
    # Each chunk is an update of the running summary returned by the chunk before it.
    assert previous_of(requests[0]) is None
    for earlier, later in itertools.pairwise(requests):
        previous = previous_of(later) or ""
        assert f"Summarised {len(material_of(earlier))} more characters." in previous
        assert "连接池上限是 64" in previous
    assert "连接池上限是 64" in result.document.decisions[0]
    assert [p["chunk"] for p in progress if p.get("what") == "summary_chunk"] == list(
        range(1, len(requests) + 1)
    )
    assert all(p["chunks"] == len(requests) for p in progress if p.get("what") == "summary_chunk")
    # What to cache: validated, keyed by the summarised prefix's content.
    assert result.new_entry is not None
    assert result.new_entry.key == prepared.cache_key(plan.summarize_until, MODEL, PROMPT_VERSION)
    assert result.new_entry.covered_messages == plan.summarize_until
    # And the compacted answer prompt: summary first, then the kept messages unchanged.
    answer = build_answer_request(
        question="连接池上限是多少？",
        messages=messages[plan.summarize_until :],
        context_summary=render_summary(result.document, result.provenance),
    )
    assert "连接池上限是 64" in answer.messages[0]["content"][0]["text"]
    assert answer.estimate.total < estimate_messages(messages)


def _small_snapshot(n_turns: int, tag: str = "") -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"FACT: the task id is T-{tag or 'main'}"}]
    for i in range(n_turns):
        messages.append({"role": "assistant", "content": f"step {i}{tag}: " + "x" * 3000})
        messages.append({"role": "user", "content": f"ok {i}{tag}: " + "y" * 3000})
    return messages


def _prepared(messages: list[dict[str, Any]]) -> PreparedSnapshot:
    return prepare_snapshot({"messages": messages})


def _until(messages: list[dict[str, Any]]) -> int:
    plan = plan_cut(group_messages(messages))
    assert isinstance(plan, CutPlan)
    return plan.summarize_until


async def test_the_same_content_costs_no_summary_call_the_second_time(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("context_summary", merging_summariser)
    messages = _small_snapshot(30)
    first = await compact_snapshot(make_runner(), "snap-a", _prepared(messages), _until(messages), [], None)
    assert first.cache == "miss" and first.calls == 1 and first.new_entry is not None
    calls = len(server.requests())

    # The same content under another snapshot id (and a deep copy): a hit, no provider call.
    import copy

    again = await compact_snapshot(
        make_runner(), "snap-b", _prepared(copy.deepcopy(messages)), _until(messages), [first.new_entry], None
    )
    assert again.cache == "hit" and again.calls == 0 and again.chunks == 0 and again.new_entry is None
    assert len(server.requests()) == calls
    assert again.document == first.document and render_summary(
        again.document, again.provenance
    ) == render_summary(first.document, first.provenance)


async def test_other_content_never_reuses_a_summary(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("context_summary", merging_summariser)
    messages = _small_snapshot(30)
    first = await compact_snapshot(make_runner(), "snap-a", _prepared(messages), _until(messages), [], None)
    assert first.new_entry is not None
    other = _small_snapshot(30, tag="-other")
    result = await compact_snapshot(
        make_runner(), "snap-c", _prepared(other), _until(other), [first.new_entry], None
    )
    assert result.cache == "miss" and result.calls == 1
    assert len(server.requests("context_summary")) == 2
    last = server.requests("context_summary")[-1]
    assert previous_of(last) is None
    assert "T-main" not in " ".join(result.document.decisions)
    assert "T--other" in " ".join(result.document.decisions)


async def test_an_extended_snapshot_reuses_the_common_prefix_and_summarises_only_the_new_messages(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("context_summary", merging_summariser)
    base = _small_snapshot(30)
    first = await compact_snapshot(make_runner(), "snap-1", _prepared(base), _until(base), [], None)
    assert first.new_entry is not None
    covered = first.new_entry.covered_messages

    extended = [
        *base,
        *[
            {
                "role": "assistant" if i % 2 == 0 else "user",
                "content": f"new {i}: FACT: more {i}\n" + " z" * 1500,
            }
            for i in range(12)
        ],
    ]
    until = _until(extended)
    assert until > covered
    progress: list[dict[str, Any]] = []
    prepared = _prepared(extended)
    result = await compact_snapshot(
        make_runner(progress=progress), "snap-2", prepared, until, [first.new_entry], None
    )

    assert result.cache == "prefix" and result.calls == 1
    last = server.requests("context_summary")[-1]
    assert len(server.requests("context_summary")) == 2
    # Only the new messages are material; the cached document is the previous summary.
    assert material_of(last) == render_messages(extended[covered:until], covered)
    assert "FACT: the task id is T-main" not in material_of(last)
    assert "the task id is T-main" in (previous_of(last) or "")
    assert "the task id is T-main" in result.document.decisions
    assert any(p.get("cache") == "prefix" for p in progress)
    assert result.new_entry is not None
    assert result.new_entry.key == prepared.cache_key(until, MODEL, PROMPT_VERSION)
    assert result.new_entry.provenance.message_range == (0, until)
