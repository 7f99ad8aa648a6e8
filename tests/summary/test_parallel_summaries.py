"""Parallel summaries with a merge (SPEC §6.3) over real HTTP: overlap, the in-flight limit, the previous
summary with the first chunk only, merge order, merge rounds, the merge retry, the plan checked against
the cap, cancellation on a failure, calls vs chunks, and two summaries of one request at once.

Overlap is proven by the scripted server's gate (held until N requests are in flight at the same time)
and its in-flight log, never by wall-clock thresholds.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from service.budget import (
    FIRST_OUTPUT_TOKENS,
    RETRY_OUTPUT_TOKENS,
    CutPlan,
    estimate_messages,
    estimate_system,
    group_messages,
    plan_cut,
    safety_margin,
)
from service.budget.prepared import prepare_snapshot
from service.providers.base import ProviderError
from service.summary.context import compact_snapshot
from service.summary.document import SummaryDocument
from service.summary.errors import SummaryCallCap, SummaryInvalid, SummaryToolCall
from service.summary.material import QAPair
from service.summary.policy import SummaryCallBudget
from service.summary.rolling import fold_qa
from service.summary.runner import SummaryPlan
from tests.scripted_provider import RecordedRequest, Step, Usage
from tests.summary.conftest import RunnerFactory
from tests.summary.helpers import (
    MemoryRecorder,
    RespondingServer,
    is_chunk,
    is_merge,
    material_of,
    merge_parts_of,
    merging_summariser,
    output_cap_of,
    parallel_summariser,
    previous_of,
    prompt_of,
    summary_json,
)

PART = re.compile(r"part-(\d+)")


def chunks_of(count: int) -> list[str]:
    return [
        f"### Side question #{i}\nQ: what about part-{i}?\nA: FACT: fact {i}\n" for i in range(1, count + 1)
    ]


def part_number(request: RecordedRequest) -> int:
    """Which chunk a chunk request carried (its ``part-N`` marker)."""
    match = PART.search(material_of(request))
    assert match is not None
    return int(match.group(1))


def decisions_of(body: str) -> list[str]:
    return re.findall(r"^- (fact \d+)$", body, re.MULTILINE)


async def test_chunks_run_at_once_and_one_merge_joins_their_documents_in_order(
    server: RespondingServer, make_runner: RunnerFactory, recorder: MemoryRecorder
) -> None:
    server.respond("qa_summary", parallel_summariser)
    # No chunk is answered until all four are in flight: an ordered run would time the gate out.
    server.gate(4, is_chunk)
    progress: list[dict[str, Any]] = []
    runner = make_runner(parallelism=4, progress=progress)

    document = await runner.summarize("qa", chunks_of(4), None)

    assert server.gate_timeouts == 0
    assert server.peak_in_flight(is_chunk) == 4
    requests = server.requests("qa_summary")
    chunk_requests = [r for r in requests if is_chunk(r)]
    (merge,) = [r for r in requests if is_merge(r)]
    assert requests[-1] is merge  # the merge starts only once every chunk's document exists
    assert sorted(part_number(r) for r in chunk_requests) == [1, 2, 3, 4]
    assert all(previous_of(r) is None for r in chunk_requests)
    # The merge carries the four documents in chunk order, whatever order the chunks finished in.
    assert [decisions_of(body) for body in merge_parts_of(merge)] == [[f"fact {i}"] for i in range(1, 5)]
    assert output_cap_of(merge) == FIRST_OUTPUT_TOKENS
    assert merge.purpose == "qa_summary" and merge.request_id == runner.request_id
    assert "tools" not in merge.body
    assert merge.body["messages"][0] == chunk_requests[0].body["messages"][0]  # same system prompt
    assert document.decisions == ("fact 1", "fact 2", "fact 3", "fact 4")

    assert runner.budget.calls_made == runner.attempts_made == 5
    assert [c.status for c in recorder.calls] == ["ok"] * 5
    chunk_events = [p for p in progress if p["what"] == "summary_chunk"]
    assert [(p["chunk"], p["chunks"]) for p in chunk_events] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert progress[-1] == {
        "stage": "organizing_history",
        "what": "summary_merge",
        "purpose": "qa_summary",
        "round": 1,
        "merge": 1,
        "merges": 1,
        "documents": 4,
    }


async def test_at_most_parallelism_calls_are_in_flight(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    def slow(request: RecordedRequest) -> Step:
        return parallel_summariser(request).with_delay(before_s=0.05)

    server.respond("context_summary", slow)
    server.gate(2, is_chunk)  # two really do overlap…
    runner = make_runner(parallelism=2)
    document = await runner.summarize("context", chunks_of(6), None)
    assert server.gate_timeouts == 0
    assert server.peak_in_flight() == 2  # …and never a third
    assert len([r for r in server.requests() if is_chunk(r)]) == 6
    assert document.decisions == tuple(f"fact {i}" for i in range(1, 7))


async def test_the_previous_summary_goes_with_the_first_chunk_only(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("context_summary", parallel_summariser)
    previous = SummaryDocument(objective="Fix the pool", state="started", decisions=("fact 0",))
    runner = make_runner(parallelism=4)
    document = await runner.summarize("context", chunks_of(3), previous)
    by_part = {part_number(r): r for r in server.requests() if is_chunk(r)}
    assert "- fact 0" in (previous_of(by_part[1]) or "")
    assert previous_of(by_part[2]) is None and previous_of(by_part[3]) is None
    assert "This is part 1 of 3" in prompt_of(by_part[1]) and "This is part 3 of 3" in prompt_of(by_part[3])
    # The earlier conclusion survives: the first chunk kept it, the merge kept the first part first.
    assert document.decisions == ("fact 0", "fact 1", "fact 2", "fact 3")


BIG = "x" * 1900  # three of these make a document of about 1950 tokens: two fit a merge call, three do not


def big_summariser(request: RecordedRequest) -> Step:
    """Chunks give near-limit documents; merges keep each part's facts and drop the padding."""
    if is_merge(request):
        facts = [fact for body in merge_parts_of(request) for fact in decisions_of(body)]
        return Step.text(summary_json(state="merged", decisions=facts))
    number = part_number(request)
    return Step.text(summary_json(state=f"part {number}", decisions=[f"fact {number}"], risks=[BIG] * 3))


async def test_documents_that_do_not_fit_one_merge_call_are_merged_in_rounds(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("qa_summary", big_summariser)
    window = 16_500  # a merge call takes two documents at the body limit, not three
    progress: list[dict[str, Any]] = []
    runner = make_runner(window=window, parallelism=4, progress=progress)
    assert runner.plan("qa", 4) == SummaryPlan(chunks=4, parallel=True, merge_calls=3)

    document = await runner.summarize("qa", chunks_of(4), None)

    merges = [r for r in server.requests() if is_merge(r)]
    assert len(merges) == 3 and runner.budget.calls_made == 7
    first_round = sorted(merges[:2], key=lambda r: decisions_of(merge_parts_of(r)[0]))
    assert [[decisions_of(b) for b in merge_parts_of(r)] for r in first_round] == [
        [["fact 1"], ["fact 2"]],
        [["fact 3"], ["fact 4"]],
    ]
    assert [decisions_of(b) for b in merge_parts_of(merges[2])] == [
        ["fact 1", "fact 2"],
        ["fact 3", "fact 4"],
    ]
    assert document.decisions == ("fact 1", "fact 2", "fact 3", "fact 4")
    for merge in merges:  # each merge prompt, with the retry's output cap, fits the window less its margin
        system = merge.body["messages"][0]["content"]
        assert estimate_system(system) + estimate_messages(
            merge.body["messages"][1:]
        ) + RETRY_OUTPUT_TOKENS <= window - safety_margin(window)
    merge_events = [(p["round"], p["documents"]) for p in progress if p["what"] == "summary_merge"]
    assert merge_events == [(1, 2), (1, 2), (2, 2)]


async def test_a_window_too_small_to_merge_two_documents_keeps_the_ordered_update(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("qa_summary", merging_summariser)
    runner = make_runner(window=16_000, parallelism=4)
    assert runner.plan("qa", 3) == SummaryPlan(chunks=3, parallel=False)
    await runner.summarize("qa", chunks_of(3), None)
    requests = server.requests()
    assert not any(is_merge(r) for r in requests)
    assert [previous_of(r) is None for r in requests] == [True, False, False]


async def test_an_invalid_merge_reply_gets_the_one_retry_from_the_same_documents(
    server: RespondingServer, make_runner: RunnerFactory, recorder: MemoryRecorder
) -> None:
    merges = 0

    def responder(request: RecordedRequest) -> Step:
        nonlocal merges
        if is_merge(request):
            merges += 1
            if merges == 1:
                return Step.invalid_summary()
        return parallel_summariser(request)

    server.respond("context_summary", responder)
    runner = make_runner(parallelism=4)
    document = await runner.summarize("context", chunks_of(3), None)
    first, retry = [r for r in server.requests() if is_merge(r)]
    assert output_cap_of(first) == FIRST_OUTPUT_TOKENS and output_cap_of(retry) == RETRY_OUTPUT_TOKENS
    assert merge_parts_of(retry) == merge_parts_of(first)
    assert "under 600 tokens" in prompt_of(retry) and "under 600 tokens" not in prompt_of(first)
    assert "Hope it helps" not in prompt_of(retry)  # the invalid reply is never fed back
    assert document.decisions == ("fact 1", "fact 2", "fact 3")
    assert runner.budget.calls_made == 5  # 3 chunks + the merge + its retry
    assert len(recorder.calls) == 5


async def test_a_merge_failing_twice_fails_with_its_error(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    def responder(request: RecordedRequest) -> Step:
        return Step.invalid_summary() if is_merge(request) else parallel_summariser(request)

    server.respond("qa_summary", responder)
    with pytest.raises(SummaryInvalid):
        await make_runner(parallelism=4).summarize("qa", chunks_of(2), None)
    assert len([r for r in server.requests() if is_merge(r)]) == 2  # one retry, never a loop


async def test_the_whole_plan_is_checked_against_the_cap_before_any_call(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    runner = make_runner(max_calls=12, parallelism=4)
    assert runner.plan("context", 12) == SummaryPlan(chunks=12, parallel=False)  # 12 + 1 merge > 12
    assert runner.plan("context", 11) == SummaryPlan(chunks=11, parallel=True, merge_calls=1)
    with pytest.raises(SummaryCallCap) as caught:
        await runner.summarize("context", [f"chunk {i}" for i in range(13)], None)
    # Not even the cheapest plan (one call per chunk, in order) fits: nothing is spent.
    assert caught.value.detail == {"calls_made": 0, "calls_needed": 13, "max_calls": 12}
    assert server.requests() == []
    assert runner.budget.reserved == 0 and runner.budget.remaining == 12


async def test_a_parallel_plan_over_the_cap_falls_back_to_the_ordered_update(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("qa_summary", merging_summariser)
    runner = make_runner(max_calls=3, parallelism=4)
    document = await runner.summarize("qa", chunks_of(3), None)
    requests = server.requests()
    assert len(requests) == 3 and not any(is_merge(r) for r in requests)
    assert [previous_of(r) is None for r in requests] == [True, False, False]
    assert document.decisions == ("fact 1", "fact 2", "fact 3")


HANG_WITH_USAGE = Step(content="partial", hangs=True, usage=Usage(40, 3), usage_first=True)


@pytest.mark.parametrize(
    ("failing", "error", "status"),
    [(Step.server_error(500), ProviderError, "failed"), (Step.tool_call("grep"), SummaryToolCall, "ok")],
    ids=["provider_error", "tool_call"],
)
async def test_a_failing_chunk_cancels_the_calls_in_flight_and_keeps_their_usage(
    failing: Step,
    error: type[Exception],
    status: str,
    server: RespondingServer,
    make_runner: RunnerFactory,
    recorder: MemoryRecorder,
) -> None:
    # The failure comes only once all four are in flight (the gate), and a moment later, so the usage
    # the hanging calls sent first has reached the client before they are cancelled.
    late_failure = failing.with_delay(before_s=0.5)
    server.respond("qa_summary", lambda r: late_failure if part_number(r) == 2 else HANG_WITH_USAGE)
    server.gate(4, is_chunk)
    runner = make_runner(parallelism=4)
    with pytest.raises(error):
        await runner.summarize("qa", chunks_of(4), None)
    assert server.gate_timeouts == 0
    assert len(server.requests()) == 4  # no retry, no merge: a failed chunk is never merged
    statuses = sorted(c.status for c in recorder.calls)
    assert statuses == sorted([status, "cancelled", "cancelled", "cancelled"])
    cancelled = [c for c in recorder.calls if c.status == "cancelled"]
    assert all(c.usage.reported and c.usage.input_tokens == 40 for c in cancelled)
    assert runner.budget.calls_made == 4 and runner.budget.reserved == 0
    await asyncio.sleep(0.05)
    assert server.in_flight(is_chunk) == 0  # the hanging requests were really abandoned


async def test_a_context_compaction_counts_material_chunks_and_every_call(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    merges = 0

    def responder(request: RecordedRequest) -> Step:
        nonlocal merges
        if is_merge(request):
            merges += 1
            if merges == 1:
                return Step.truncated('{"objective": "cut')
            return Step.valid_summary()
        return Step.valid_summary()

    server.respond("context_summary", responder)
    text = "line of the transcript\n" * 300  # 12 × ~2300 tokens: several chunks in a 20 000 window
    messages: list[dict[str, Any]] = []
    for i in range(12):
        messages.append({"role": "user", "content": f"step {i}\n{text}"})
        messages.append({"role": "assistant", "content": f"done {i}"})
    cut = plan_cut(group_messages(messages))
    assert isinstance(cut, CutPlan)
    runner = make_runner(window=20_000, parallelism=4)
    result = await compact_snapshot(
        runner, "snap-1", prepare_snapshot({"messages": messages}), cut.summarize_until, [], None
    )
    chunk_requests = [r for r in server.requests() if is_chunk(r)]
    assert result.chunks == len(chunk_requests) >= 2
    assert result.calls == len(server.requests()) == result.chunks + 2  # one merge, and its one retry
    assert result.new_entry is not None


def _pair(ordinal: int) -> QAPair:
    return QAPair(ordinal, f"What about part-{ordinal}?", f"FACT: fact {ordinal}")


async def test_a_parallel_fold_summarises_every_batch_at_once_with_one_merge(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("qa_summary", parallel_summariser)
    progress: list[dict[str, Any]] = []
    runner = make_runner(parallelism=4, progress=progress)
    earlier = await fold_qa(make_runner(), None, [[_pair(1)]], None)
    folded = await fold_qa(runner, earlier, [[_pair(2)], [_pair(3)], [_pair(4)]], None)
    assert folded is not None and folded.covered_through_ordinal == 4 and folded.first_ordinal == 1
    assert folded.document.decisions == ("fact 1", "fact 2", "fact 3", "fact 4")
    requests = server.requests()[1:]
    assert len([r for r in requests if is_chunk(r)]) == 3 and len([r for r in requests if is_merge(r)]) == 1
    by_part = {part_number(r): r for r in requests if is_chunk(r)}
    assert "- fact 1" in (previous_of(by_part[2]) or "")  # the batches' previous summary: first chunk only
    assert previous_of(by_part[3]) is None and previous_of(by_part[4]) is None
    assert runner.attempts_made == 4
    assert [(p["chunk"], p["chunks"]) for p in progress if p["what"] == "summary_chunk"] == [
        (1, 3),
        (2, 3),
        (3, 3),
    ]
    assert [p["what"] for p in progress].count("summary_merge") == 1


async def test_a_fold_and_a_compaction_of_one_request_run_at_once_on_one_budget(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("qa_summary", parallel_summariser)
    server.respond("context_summary", parallel_summariser)
    # Both summaries' chunks (two each) are in flight at the same time before any is answered.
    server.gate(4, is_chunk)
    # A 30 000-token window takes about 17 000 tokens of material per call: each big message is a chunk.
    # Each on its own runner over the request's one budget, as the pipeline runs them.
    budget = SummaryCallBudget(12)
    fold_runner = make_runner(parallelism=4, window=30_000, budget=budget)
    runner = make_runner(parallelism=4, window=30_000, budget=budget)
    snapshot = [
        {"role": "user", "content": "part-1 FACT: fact 1\n" + "old context\n" * 3000},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "part-2 FACT: fact 2\n" + "more context\n" * 3000},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "now"},
    ]
    cut = plan_cut(group_messages(snapshot), recent_budget=10)
    assert isinstance(cut, CutPlan) and cut.summarize_until == 3, cut
    folded, compaction = await asyncio.gather(
        fold_qa(fold_runner, None, [[_pair(1)], [_pair(2)]], None),
        compact_snapshot(
            runner, "snap-1", prepare_snapshot({"messages": snapshot}), cut.summarize_until, [], None
        ),
    )
    assert server.gate_timeouts == 0
    qa = server.requests("qa_summary")
    context = server.requests("context_summary")
    assert fold_runner.attempts_made == len(qa) == 3
    assert compaction.calls == runner.attempts_made == len(context) == 3
    assert compaction.chunks == 2
    assert budget.calls_made == 6 and budget.reserved == 0
    assert folded is not None and folded.document.decisions == ("fact 1", "fact 2")


async def test_two_plans_that_together_exceed_the_cap_cannot_both_start(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("qa_summary", parallel_summariser)
    server.respond("context_summary", parallel_summariser)
    budget = SummaryCallBudget(5)
    runner = make_runner(parallelism=4, budget=budget)
    first, second = await asyncio.gather(
        runner.summarize("context", chunks_of(3), None),  # reserves 3 chunks + 1 merge
        runner.summarize("qa", chunks_of(2), None),  # needs 2 (ordered) with 1 left
        return_exceptions=True,
    )
    assert isinstance(first, SummaryDocument)
    assert isinstance(second, SummaryCallCap)
    assert second.detail == {"calls_made": 0, "calls_needed": 2, "max_calls": 5, "calls_reserved": 4}
    assert server.requests("qa_summary") == []
    assert budget.calls_made == 4 and budget.reserved == 0
