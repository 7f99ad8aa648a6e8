"""The rolling Q&A summary over real HTTP: updates, not rewrites, so group 1 survives 50 groups."""

from __future__ import annotations

import pytest

from service.budget import QAItem, estimate_text, select_replay
from service.summary.material import QAPair, render_qa_pair
from service.summary.prompts import build_answer_request
from service.summary.rolling import StoredQASummary, fold_qa
from tests.summary.conftest import RunnerFactory
from tests.summary.helpers import RespondingServer, material_of, merging_summariser, previous_of

FACT = "the staging database listens on port 5433"


def _pair(ordinal: int) -> QAPair:
    if ordinal == 1:
        return QAPair(
            1, "Which port does the staging database use?", f"FACT: {FACT}.", "2026-11-29T09:00:00Z"
        )
    # Long answers, so that 20 of them fill the replay window and older ones must be folded.
    return QAPair(ordinal, f"What does step {ordinal} do?", f"Step {ordinal} " + "runs checks. " * 60)


async def test_a_fact_from_group_1_survives_50_groups_into_the_answer_prompt(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("qa_summary", merging_summariser)
    history: list[QAPair] = []
    stored: StoredQASummary | None = None
    input_budget = 40_000  # replay limit min(40000 / 4, 16000) = 10000 tokens
    folds = 0
    for ordinal in range(1, 51):
        # Request `ordinal` sees every earlier successful Q&A: replay the newest, fold the rest.
        items = [QAItem(p.ordinal, estimate_text(render_qa_pair(p))) for p in history]
        covered = stored.covered_through_ordinal if stored is not None else None
        plan = select_replay(items, covered, input_budget)
        by_ordinal = {p.ordinal: p for p in history}
        batches = [[by_ordinal[o] for o in batch] for batch in plan.fold_batches]
        if batches:
            runner = make_runner()
            stored = await fold_qa(runner, stored, batches, "2026-11-29T10:00:00Z")
            folds += 1
            assert stored is not None and stored.covered_through_ordinal == plan.fold[-1]
            assert runner.budget.calls_made == 1
        replayed = [by_ordinal[o] for o in plan.replay]
        history.append(_pair(ordinal))

    assert stored is not None
    assert folds >= 25  # the summary was updated many times after group 1 went into it
    requests = server.requests("qa_summary")
    assert len(requests) == folds
    first_with_fact = next(i for i, r in enumerate(requests) if FACT in material_of(r))
    # Group 1 was material exactly once; every later fold got it only through the previous summary.
    assert all(FACT not in material_of(r) for r in requests[first_with_fact + 1 :])
    assert all(FACT in (previous_of(r) or "") for r in requests[first_with_fact + 1 :])
    assert stored.first_ordinal == 1
    assert stored.provenance.source == f"side Q&A ordinals 1–{stored.covered_through_ordinal}"
    assert 1 not in {p.ordinal for p in replayed}

    request = build_answer_request(
        question="Remind me, which port was staging on?",
        qa_summary=stored.rendered(),
        replayed=replayed,
        context_time="2026-11-29T10:00:00Z",
    )
    final_text = "\n".join(b["text"] for b in request.messages[-1]["content"] if b["type"] == "text")
    assert FACT in final_text
    assert "side Q&A ordinals 1–" in final_text
    assert "not new tool evidence" in final_text
    assert request.estimate.qa_summary == estimate_text(
        "Summary of earlier side questions and answers:\n" + stored.rendered()
    )


async def test_pairs_already_covered_are_not_folded_again(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("qa_summary", merging_summariser)
    first = await fold_qa(make_runner(), None, [[_pair(1), _pair(2)]], None)
    assert first is not None and first.covered_through_ordinal == 2
    same = await fold_qa(make_runner(), first, [[_pair(1), _pair(2)]], None)
    assert same is first
    assert len(server.requests("qa_summary")) == 1
    later = await fold_qa(make_runner(), first, [[_pair(2), _pair(3)]], None)
    assert later is not None and later.covered_through_ordinal == 3 and later.first_ordinal == 1
    assert "#2" not in material_of(server.requests("qa_summary")[-1])
    assert await fold_qa(make_runner(), None, [], None) is None
    with pytest.raises(ValueError, match="ascending"):
        await fold_qa(make_runner(), None, [[_pair(3), _pair(2)]], None)


async def test_several_batches_are_planned_against_the_cap_then_folded_in_order(
    server: RespondingServer, make_runner: RunnerFactory
) -> None:
    server.respond("qa_summary", merging_summariser)
    progress: list[dict[str, object]] = []
    batches = [[_pair(o) for o in range(1, 21)], [_pair(o) for o in range(21, 31)]]
    stored = await fold_qa(make_runner(progress=progress), None, batches, "2026-11-29T10:00:00Z")
    assert stored is not None and stored.covered_through_ordinal == 30
    first, second = server.requests("qa_summary")
    assert previous_of(first) is None and FACT in (previous_of(second) or "")
    assert [(p["chunk"], p["chunks"]) for p in progress] == [(1, 2), (2, 2)]
    assert all(p["purpose"] == "qa_summary" and p["stage"] == "organizing_history" for p in progress)
    assert StoredQASummary.from_json(stored.to_json()) == stored

    from service.summary.errors import SummaryCallCap

    before = len(server.requests())
    with pytest.raises(SummaryCallCap) as caught:
        await fold_qa(make_runner(max_calls=1), None, batches, None)
    assert caught.value.detail["calls_needed"] == 2
    assert len(server.requests()) == before
