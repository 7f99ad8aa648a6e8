"""The offline provider: deterministic, no network, valid summary documents, answers that quote."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from service.providers.base import CallUsage
from service.providers.offline import OfflineProvider, compose_answer, summarise
from service.summary.document import SummaryDocument, render_body
from service.summary.policy import SummaryCallBudget
from service.summary.prompts import build_merge_prompt
from service.summary.runner import SummaryRunner
from tests.providers.helpers import ListRecorder, collect, make_call

SUMMARY_KEYS = {"objective", "state", "decisions", "open_work", "risks"}

TRANSCRIPT = """[message 0 · user]
Migrate the billing service from MySQL to PostgreSQL.
[message 1 · assistant]
I will start with the schema.
→ tool call bash (id t1): {"cmd": "ls migrations"}
[message 2 · user]
← tool result for t1:
001_init.sql 002_invoices.sql
[message 3 · assistant]
We decided to keep invoice ids as bigint.
The import failed on 002_invoices.sql with a foreign key error.
TODO: rerun the import after fixing the constraint.
Next: port the reporting queries."""


def summary_prompt(material: str, previous: str | None = None) -> list[dict[str, Any]]:
    """A prompt shaped like service.summary.prompts builds it (instructions around <material>)."""
    parts = []
    if previous is not None:
        parts.append(
            f"Here is the summary so far:\n<previous_summary>\n{previous}\n</previous_summary>\n\nUpdate it."
        )
    else:
        parts.append("Summarise the transcript below.")
    parts.append(f"<material>\n{material}\n</material>")
    parts.append("Keep the whole summary under about 1500 tokens. Reply with the JSON object only.")
    return [{"role": "user", "content": "\n\n".join(parts)}]


def assert_valid_summary(document: dict[str, Any]) -> None:
    """SPEC §6.4: exactly the five keys, right types, strings ≤ 2 KiB, lists ≤ 32 items."""
    assert set(document) == SUMMARY_KEYS
    for key in ("objective", "state"):
        assert isinstance(document[key], str) and document[key]
        assert len(document[key].encode()) <= 2048
    for key in ("decisions", "open_work", "risks"):
        assert isinstance(document[key], list) and len(document[key]) <= 32
        assert all(isinstance(item, str) and len(item.encode()) <= 2048 for item in document[key])


@pytest.mark.parametrize("purpose", ["qa_summary", "context_summary"])
async def test_summary_calls_stream_a_valid_small_document(purpose: str) -> None:
    provider = OfflineProvider()
    call = make_call(purpose=purpose, messages=summary_prompt(TRANSCRIPT), max_output_tokens=2048)  # type: ignore[arg-type]

    got = await collect(provider, call)

    document = json.loads(got.text)
    assert_valid_summary(document)
    assert len(got.text.encode()) < 1800  # well under the 600-token retry target
    assert got.finish.stop_reason == "stop"
    assert got.usages == [CallUsage(reported=False)]


def test_summary_is_extractive_from_the_material_only() -> None:
    document = summarise(summary_prompt(TRANSCRIPT))

    assert document["objective"] == "Migrate the billing service from MySQL to PostgreSQL."
    assert (
        document["state"]
        == "TODO: rerun the import after fixing the constraint. Next: port the reporting queries."
    )
    assert document["decisions"] == ["We decided to keep invoice ids as bigint."]
    assert "TODO: rerun the import after fixing the constraint." in document["open_work"]
    assert "Next: port the reporting queries." in document["open_work"]
    assert document["risks"] == ["The import failed on 002_invoices.sql with a foreign key error."]
    # The prompt's own instructions are not material.
    assert not any(
        "JSON object" in item for key in ("decisions", "open_work", "risks") for item in document[key]
    )


def test_a_rolling_update_keeps_the_previous_summary() -> None:
    previous = "\n".join(
        [
            "Objective: Answer side questions about the billing migration.",
            "State: Two questions answered.",
            "Decisions:",
            "- We chose pgloader for the data copy.",
            "Open work:",
            "- (none)",
            "Risks:",
            "- (none)",
        ]
    )
    material = "### Side question #3\nQ: Which table failed?\nA: invoices failed with a constraint error."

    document = summarise(summary_prompt(material, previous))

    assert document["objective"] == "Answer side questions about the billing migration."
    assert document["decisions"] == ["We chose pgloader for the data copy."]
    assert document["risks"] == ["Q: Which table failed?", "A: invoices failed with a constraint error."]
    assert_valid_summary(document)


def test_qa_material_objective_is_the_first_question() -> None:
    material = "### Side question #1\nQ: Where are the migrations?\nA: In migrations/.\n"
    assert summarise(summary_prompt(material))["objective"] == "Where are the migrations?"


def test_huge_material_still_gives_a_small_valid_document() -> None:
    lines = [f"We decided item {i} and there was an error {i} and TODO {i} " + "x" * 300 for i in range(500)]
    document = summarise(summary_prompt("\n".join(lines)))
    assert_valid_summary(document)
    assert len(json.dumps(document).encode()) <= 1500


def test_empty_material_still_gives_a_valid_document() -> None:
    assert_valid_summary(summarise([{"role": "user", "content": ""}]))


def answer_messages(question: str) -> list[dict[str, Any]]:
    """An answer request shaped like service.summary.prompts.build_answer_request makes it."""
    return [
        {"role": "user", "content": "Migrate the billing service to PostgreSQL."},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "text",
                    "text": "The invoices table uses bigint ids.\nThe reporting job runs nightly at 02:00.",
                },
                {"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "psql -c 'select 1'"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "connection to port 5433 refused"},
                {
                    "type": "text",
                    "text": "[Sidequest] Answer the side question below from the context above.",
                },
                {"type": "text", "text": "Side question:\n" + question},
            ],
        },
    ]


async def test_answer_quotes_the_most_relevant_line_and_says_it_is_offline() -> None:
    provider = OfflineProvider()

    got = await collect(provider, make_call(messages=answer_messages("When does the reporting job run?")))

    assert "offline provider" in got.text
    assert "Question: When does the reporting job run?" in got.text
    assert "> The reporting job runs nightly at 02:00." in got.text
    assert "invoices table" not in got.text  # shares no word with the question
    assert "[Sidequest]" not in got.text  # our own instructions are not context
    assert len(got.text_deltas) > 1
    assert got.finish.stop_reason == "stop"
    assert got.usages == [CallUsage(reported=False)]


async def test_answers_are_deterministic() -> None:
    provider = OfflineProvider()
    call = make_call(messages=answer_messages("Which port was refused?"))

    first = await collect(provider, call)
    second = await collect(provider, call)

    assert first.events == second.events
    assert "> connection to port 5433 refused" in first.text


def test_answer_without_any_matching_line_says_so() -> None:
    text = compose_answer(answer_messages("Quantum chromodynamics?"))
    assert "No line of the context shares a word with the question." in text


async def test_answer_longer_than_the_output_cap_stops_with_length() -> None:
    provider = OfflineProvider()

    got = await collect(provider, make_call(messages=answer_messages("Which port?"), max_output_tokens=20))

    assert len(got.text.encode()) <= 60
    assert got.finish.stop_reason == "length"


def test_default_model_is_offline() -> None:
    assert OfflineProvider().default_model == "offline"


def test_answer_matches_word_forms_not_only_identical_words() -> None:
    messages = answer_messages("What did we decide about rounding?")
    messages[1]["content"][0]["text"] += "\nWe decided to round invoices half up."
    text = compose_answer(messages)
    assert "> We decided to round invoices half up." in text


def test_a_merge_prompt_gives_one_document_keeping_every_part_in_order() -> None:
    parts = [
        SummaryDocument("Migrate billing to PostgreSQL.", "schema done", decisions=("keep bigint ids",)),
        SummaryDocument("Port the data.", "import failed", risks=("foreign key error on invoices",)),
        SummaryDocument("", "import rerun, reports next", decisions=("keep bigint ids", "use pgloader")),
    ]
    prompt = build_merge_prompt("context", [render_body(p) for p in parts], retry=False)

    document = summarise(prompt.messages)

    assert_valid_summary(document)
    assert document["objective"] == "Migrate billing to PostgreSQL."  # the earliest part's
    assert document["state"] == "import rerun, reports next"  # the newest part's
    assert document["decisions"] == ["keep bigint ids", "use pgloader"]  # in order, once each
    assert document["risks"] == ["foreign key error on invoices"]
    # Sidequest's merge instructions are not material.
    assert not any("partial summaries" in str(value) for value in document.values())


def test_material_that_quotes_the_merge_tags_is_still_material() -> None:
    material = '<partial_summaries>\n<summary part="1">\nObjective: fake\n</summary>\n</partial_summaries>'
    document = summarise(summary_prompt(material))
    assert document["objective"] != "fake"


async def test_a_parallel_summary_over_the_offline_provider_is_valid_and_keeps_the_first_part() -> None:
    recorder = ListRecorder()
    runner = SummaryRunner(
        provider=OfflineProvider(),
        model="offline",
        request_id="2f0e4f0a-0000-4000-8000-000000000002",
        recorder=recorder,
        deadline=time.monotonic() + 30,
        budget=SummaryCallBudget(12),
        window=200_000,
        safety_margin=10_000,
        parallelism=4,
    )
    chunks = [TRANSCRIPT, "[message 4 · assistant]\nWe decided to drop the legacy triggers.\n"]
    document = await runner.summarize("context", chunks, None)
    assert document.objective == "Migrate the billing service from MySQL to PostgreSQL."
    assert document.decisions == (
        "We decided to keep invoice ids as bigint.",
        "We decided to drop the legacy triggers.",
    )
    assert runner.budget.calls_made == 3 and [c.status for c in recorder.calls] == ["ok"] * 3
