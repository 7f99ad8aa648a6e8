"""Budget planning benchmark: one full preparation plan for a large snapshot, pure CPU.

Run: ``.venv/bin/python benchmarks/bench_budget.py [--runs 50]``

The input is a synthetic 200000-token snapshot (2000 messages: user turns, assistant tool calls,
tool results and assistant replies, mixed Chinese and English) plus 1000 successful side Q&A
groups with no rolling summary yet (the worst case: all but the replay window is folded). One plan
is everything the pure kernel does before a model call:

normalise → estimate per message → group → estimate system/tools → window → estimate Q&A →
replay selection → segment meter + pressure → cut plan → render the summarised groups → chunk them.

Building the snapshot dict (JSON parsing, database reads) is not timed: it is not budget work.
Rendering uses the summary package's real renderer (``service.summary.material.render_messages``,
what the pipeline chunks); it is timed because chunking needs rendered text, and reported apart
("CPU without renderer") because it is not kernel code. A minimal stand-in renderer would
produce 8 % less text at half the cost, and so understate a real plan. Results go to
docs/benchmarks.md ("Budget planning").
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from service.budget import (
    CutPlan,
    QAItem,
    chunk_pieces,
    envelope_tokens,
    estimate_message,
    estimate_system,
    estimate_text,
    estimate_tools,
    group_messages,
    normalize_snapshot,
    plan_cut,
    plan_window,
    pressure,
    resolve_output_cap,
    resolve_window,
    select_replay,
    summary_capacity,
)
from service.budget.meter import SegmentEstimate
from service.summary.material import render_messages

TARGET_MESSAGES = 2000
TARGET_TOKENS = 200_000
QA_GROUPS = 1000
SUMMARY_PROMPT_TOKENS = 1500  # instructions + previous summary of one summary call

ENGLISH = (
    "the build failed because the cache key ignores the lockfile so we rerun the suite with a clean "
    "checkout and compare the timings against yesterday before touching the scheduler again"
).split()
CHINESE = (
    "我们需要检查数据库连接池的配置并且确认每个工作进程在重启之后都能重新获得租约然后再继续处理队列中的请求"
)


def _sentence(rng: random.Random, target_bytes: int) -> str:
    """Mixed English / Chinese prose of roughly ``target_bytes`` UTF-8 bytes."""
    parts: list[str] = []
    size = 0
    while size < target_bytes:
        if rng.random() < 0.5:
            word = rng.choice(ENGLISH) + " "
        else:
            start = rng.randrange(len(CHINESE) - 6)
            word = CHINESE[start : start + rng.randint(2, 6)] + "，"
        parts.append(word)
        size += len(word.encode("utf-8"))
        if rng.random() < 0.08:
            parts.append("\n")
            size += 1
    return "".join(parts)


def build_snapshot(openai_style: bool, scale: float, seed: int = 7) -> dict[str, Any]:
    """A snapshot of 2000 messages in units of user → tool call → tool result → reply."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = []
    for unit in range(TARGET_MESSAGES // 4):
        call_id = f"call_{unit}"
        arguments = {"path": f"src/module_{unit % 37}.py", "pattern": _sentence(rng, 30)}
        result = _sentence(rng, int(600 * scale))
        messages.append({"role": "user", "content": _sentence(rng, int(120 * scale))})
        if openai_style:
            messages.append(
                {
                    "role": "assistant",
                    "content": _sentence(rng, int(60 * scale)),
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": "grep",
                                "arguments": json.dumps(arguments, ensure_ascii=False),
                            },
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            messages.append(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": _sentence(rng, int(60 * scale))},
                        {"type": "tool_use", "id": call_id, "name": "grep", "input": arguments},
                    ],
                }
            )
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}],
                }
            )
        messages.append({"role": "assistant", "content": _sentence(rng, int(300 * scale))})
    tools = [
        {
            "name": "grep",
            "description": "Search files for a pattern. 在文件中搜索。",
            "input_schema": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "pattern": {"type": "string"}},
                "required": ["pattern"],
            },
        }
    ]
    if openai_style:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool["description"],
                    "parameters": tool["input_schema"],
                },
            }
            for tool in tools
        ]
    return {
        "system": "You are the main coding agent. 你是主代理。\n" + _sentence(rng, 3000),
        "tools": tools,
        "messages": messages,
        "context_window": 200_000,
        "max_output_tokens": 32_000,
    }


def build_qa(seed: int = 11) -> list[tuple[int, str]]:
    """1000 successful side Q&A groups (ordinal, rendered question + answer)."""
    rng = random.Random(seed)
    return [
        (
            ordinal,
            "Q: " + _sentence(rng, rng.randint(100, 400)) + "\nA: " + _sentence(rng, rng.randint(400, 3000)),
        )
        for ordinal in range(1, QA_GROUPS + 1)
    ]


def plan(
    snapshot: Mapping[str, Any], qa: Sequence[tuple[int, str]], stages: dict[str, float]
) -> dict[str, Any]:
    """One full budget plan; adds each stage's seconds to ``stages``."""
    clock = time.thread_time
    t0 = clock()
    normalized = normalize_snapshot(snapshot)
    t1 = clock()
    message_tokens = [estimate_message(message) for message in normalized.messages]
    groups = group_messages(normalized.messages, message_tokens=message_tokens)
    system_tokens = estimate_system(normalized.system)
    tools_tokens = estimate_tools(normalized.tools)
    # Per-message estimates include the envelope; the context segment is their content only.
    context_tokens = sum(message_tokens) - envelope_tokens(len(normalized.messages))
    t2 = clock()
    window = resolve_window(None, normalized.context_window, None)
    output_cap = resolve_output_cap(None, 8192, normalized.max_output_tokens)
    window_plan = plan_window(window, output_cap)
    items = [QAItem(ordinal, estimate_text(text)) for ordinal, text in qa]
    replay = select_replay(items, None, window_plan.input_budget)
    t3 = clock()
    estimate = SegmentEstimate(
        system=system_tokens,
        tools=tools_tokens,
        context=context_tokens,
        qa_summary=600,
        qa_raw=replay.replay_tokens,  # the replay window's estimate, already summed by select_replay
        question=estimate_text("顺便问一下：what is blocking the release?"),
        envelope=envelope_tokens(len(normalized.messages) + 1),
    )
    level = pressure(estimate.total, window_plan.input_budget)
    cut = plan_cut(groups)
    t4 = clock()
    chunks: list[str] = []
    pieces: list[str] = []
    if isinstance(cut, CutPlan):
        messages = normalized.messages
        pieces = [
            render_messages(messages[group.start : group.end], group.start)
            for group in groups[: cut.summarized_groups]
        ]
    t5 = clock()
    if pieces:
        capacity = summary_capacity(window, SUMMARY_PROMPT_TOKENS, window_plan.safety_margin)
        chunks = chunk_pieces(pieces, capacity)
    t6 = clock()
    stages["normalize"] += t1 - t0
    stages["estimate+group"] += t2 - t1
    stages["window+replay"] += t3 - t2
    stages["meter+cut"] += t4 - t3
    stages["render"] += t5 - t4
    stages["chunk"] += t6 - t5
    return {
        "messages": len(normalized.messages),
        "groups": len(groups),
        "estimate": estimate.total,
        "pressure": level,
        "input_budget": window_plan.input_budget,
        "replayed": len(replay.replay),
        "folded": len(replay.fold),
        "fold_batches": len(replay.fold_batches),
        "cut": cut,
        "chunks": len(chunks),
    }


def _scale_for_target() -> float:
    """Scale text sizes so that the snapshot's messages estimate close to TARGET_TOKENS."""
    probe = build_snapshot(openai_style=False, scale=1.0)
    tokens = sum(estimate_message(message) for message in probe["messages"])
    return TARGET_TOKENS / tokens


def _summary(values: list[float]) -> str:
    """min / median / p95 / max of millisecond values."""
    ordered = sorted(values)
    p95 = ordered[max(0, int(len(ordered) * 0.95) - 1)]
    return (
        f"min {ordered[0]:.2f} ms, median {statistics.median(ordered):.2f} ms,"
        f" p95 {p95:.2f} ms, max {ordered[-1]:.2f} ms"
    )


def measure(name: str, run: Callable[[dict[str, float]], dict[str, Any]], runs: int) -> None:
    """Time ``runs`` plans after 3 warm-up runs and print wall-clock and CPU-time distributions.

    CPU time (``time.thread_time``) is what a plan costs; wall-clock time also counts the time the
    process waited for a core, which on a shared 2-core machine can dominate.
    """
    stage_names = ("normalize", "estimate+group", "window+replay", "meter+cut", "render", "chunk")
    stages = dict.fromkeys(stage_names, 0.0)
    for _ in range(3):
        run(dict(stages))
    wall: list[float] = []
    cpu: list[float] = []
    kernel_cpu: list[float] = []
    result: dict[str, Any] = {}
    for _ in range(runs):
        gc.collect()  # start each run with the same heap, outside the timed region
        render_before = stages["render"]
        start_wall, start_cpu = time.perf_counter(), time.thread_time()
        result = run(stages)
        cpu_ms = (time.thread_time() - start_cpu) * 1000
        wall.append((time.perf_counter() - start_wall) * 1000)
        cpu.append(cpu_ms)
        kernel_cpu.append(cpu_ms - (stages["render"] - render_before) * 1000)
    cut = result["cut"]
    cut_text = (
        f"summarise {cut.summarize_until} msgs ({cut.gross_removed_tokens} tok), keep {cut.kept_messages}"
        if isinstance(cut, CutPlan)
        else f"refused: {cut.reason}"
    )
    print(f"\n== {name} ==")
    print(
        f"messages {result['messages']}, groups {result['groups']}, estimate {result['estimate']} tokens,"
        f" input budget {result['input_budget']}, pressure {result['pressure']}"
    )
    print(
        f"replay {result['replayed']} groups, fold {result['folded']} in {result['fold_batches']} batches;"
        f" cut: {cut_text}; {result['chunks']} chunk(s)"
    )
    print(f"per plan, CPU time:             {_summary(cpu)}")
    print(f"per plan, CPU without renderer: {_summary(kernel_cpu)}")
    print(f"per plan, wall clock:           {_summary(wall)}")
    print("stage means (CPU): " + ", ".join(f"{k} {v / runs * 1000:.2f} ms" for k, v in stages.items()))


def main() -> None:
    """Build the inputs, run both snapshot styles, print the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    scale = _scale_for_target()
    qa = build_qa()
    print(
        f"python {sys.version.split()[0]} on {platform.machine()} ({platform.system()}),"
        f" {args.runs} runs each; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    for style in ("anthropic", "openai"):
        snapshot = build_snapshot(openai_style=style == "openai", scale=scale)
        measure(
            f"{style}-style snapshot, {len(snapshot['messages'])} raw messages, {QA_GROUPS} Q&A groups",
            functools.partial(plan, snapshot, qa),
            args.runs,
        )


if __name__ == "__main__":
    main()
