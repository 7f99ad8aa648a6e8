"""Session settings in a real pipeline run against the scripted server (SPEC §11.2): the summary
instructions reach every summary call after the built-in prompt and never the answer call; the model
choice shows in ``usage.calls[].model``; the session's window and output cap sit between the request's
and the snapshot's / service's."""

from __future__ import annotations

import json
import uuid
from typing import Any

from service.config import Settings
from service.providers import build_provider
from service.providers.base import Provider
from service.store.db import Database
from service.store.models import SessionRow
from service.summary.prompts import SummaryKind, summary_system_prompt
from tests.factories import add_history, add_snapshot, admit, make_session, scripted_settings
from tests.pipeline.conftest import run_one
from tests.scripted_provider import RecordedRequest, ScriptedServer

INSTRUCTIONS = "Always keep ticket numbers like JIRA-1234 and every file path verbatim."
SNAPSHOT_SYSTEM = "You are the main coding agent of the billing service."


async def set_settings(db: Database, session_id: uuid.UUID, **values: Any) -> None:
    async with db.sessions() as session, session.begin():
        row = await session.get(SessionRow, session_id)
        assert row is not None
        row.settings = values


def big_snapshot(messages: int, bytes_each: int) -> dict[str, Any]:
    out = []
    for i in range(messages):
        role = "user" if i % 2 == 0 else "assistant"
        out.append({"role": role, "content": f"message {i}: " + ("lorem ipsum " * (bytes_each // 12))})
    return {"taken_at": "2026-11-29T09:00:00Z", "system": SNAPSHOT_SYSTEM, "messages": out}


def system_of(body: dict[str, Any]) -> str | None:
    first = body["messages"][0]
    return str(first["content"]) if first["role"] == "system" else None


async def test_instructions_go_with_every_summary_call_after_the_built_in_prompt_and_never_the_answer(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await set_settings(db, sid, summary_instructions=INSTRUCTIONS)
    await add_history(db, sid, [(f"question {i}?", f"answer {i}.") for i in range(1, 25)])  # > 20: a fold
    await add_snapshot(db, sid, "big", big_snapshot(40, 3000))  # compaction in a 32000 window
    rid = await admit(
        db, sid, "what now?", snapshot_id="big", options={"context_window": 32000, "max_output_tokens": 1024}
    )

    ran = await run_one(db, model_settings, provider, rid)

    assert ran.outcome.status == "succeeded", ran.row.error
    qa_calls, context_calls = server.requests("qa_summary"), server.requests("context_summary")
    assert qa_calls and context_calls
    kinds: list[tuple[SummaryKind, list[RecordedRequest]]] = [("qa", qa_calls), ("context", context_calls)]
    for kind, calls in kinds:
        for call in calls:
            system = system_of(call.body)
            assert system is not None and system.startswith(summary_system_prompt(kind))  # built-in whole
            assert system.index(INSTRUCTIONS) > len(summary_system_prompt(kind))  # and after it
    answer = server.requests("answer")[0].body
    assert system_of(answer) == SNAPSHOT_SYSTEM  # the snapshot's own system prompt, unchanged
    assert INSTRUCTIONS not in json.dumps(answer, ensure_ascii=False)


async def test_a_changed_instruction_does_not_reuse_a_context_summary_made_under_another(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await add_snapshot(db, sid, "big", big_snapshot(40, 3000))
    options = {"context_window": 32000, "max_output_tokens": 1024}
    first = await admit(db, sid, "one?", snapshot_id="big", options=options)
    assert (await run_one(db, model_settings, provider, first)).row.context_info["context_summary"][
        "cache"
    ] == "miss"
    await set_settings(db, sid, summary_instructions=INSTRUCTIONS)
    second = await admit(db, sid, "two?", snapshot_id="big", options=options)
    assert (await run_one(db, model_settings, provider, second)).row.context_info["context_summary"][
        "cache"
    ] == "miss"
    third = await admit(db, sid, "three?", snapshot_id="big", options=options)
    assert (await run_one(db, model_settings, provider, third)).row.context_info["context_summary"][
        "cache"
    ] == "hit"


def models_by_purpose(usage: dict[str, Any]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for call in usage["calls"]:
        found.setdefault(call["purpose"], set()).add(call["model"])
    return found


async def test_session_models_are_used_and_shown_per_call(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await set_settings(db, sid, summary_model="cheap-summarizer", answer_model="session-answerer")
    await add_history(db, sid, [(f"q{i}", f"a{i}") for i in range(1, 23)])
    rid = await admit(db, sid, "which model?")
    ran = await run_one(db, model_settings, provider, rid)
    assert ran.outcome.status == "succeeded", ran.row.error
    assert models_by_purpose(ran.row.usage) == {
        "qa_summary": {"cheap-summarizer"},
        "answer": {"session-answerer"},
    }
    assert ran.row.model == "session-answerer"
    assert {r.body["model"] for r in server.requests("qa_summary")} == {"cheap-summarizer"}
    assert {r.body["model"] for r in server.requests("answer")} == {"session-answerer"}
    # The request's own model wins over the session's answer model; the summary model stays.
    own = await admit(db, sid, "and now?", options={"model": "request-model"})
    again = await run_one(db, model_settings, provider, own)
    assert models_by_purpose(again.row.usage)["answer"] == {"request-model"}


async def test_without_session_models_summaries_use_the_summary_setting_then_the_answer_model(
    db: Database, database_url: str, server: ScriptedServer
) -> None:
    for summary_model, expected in (("service-summarizer", "service-summarizer"), (None, "request-model")):
        settings = scripted_settings(database_url, server.base_url, summary_model=summary_model)
        built = build_provider(settings)
        try:
            sid = await make_session(db, f"p-{expected}")
            await add_history(db, sid, [(f"q{i}", f"a{i}") for i in range(1, 23)])
            rid = await admit(db, sid, "q?", options={"model": "request-model"})
            ran = await run_one(db, settings, built, rid)
        finally:
            await built.aclose()
        assert models_by_purpose(ran.row.usage) == {"qa_summary": {expected}, "answer": {"request-model"}}


async def test_session_window_and_output_cap_sit_between_the_request_and_the_snapshot(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await set_settings(db, sid, context_window=50000, max_output_tokens=3000)
    await add_snapshot(db, sid, "s", {"system": "sys", "messages": [], "context_window": 90000})
    plain = await run_one(db, model_settings, provider, await admit(db, sid, "q1", snapshot_id="s"))
    assert plain.row.context_info["window"] == 50000 and plain.row.context_info["max_output_tokens"] == 3000
    assert server.requests("answer")[-1].body["max_tokens"] == 3000  # a local base_url gets max_tokens
    own = await admit(
        db, sid, "q2", snapshot_id="s", options={"context_window": 40000, "max_output_tokens": 2000}
    )
    mine = await run_one(db, model_settings, provider, own)
    assert mine.row.context_info["window"] == 40000 and mine.row.context_info["max_output_tokens"] == 2000
    await set_settings(db, sid)
    fallback = await run_one(db, model_settings, provider, await admit(db, sid, "q3", snapshot_id="s"))
    assert fallback.row.context_info["window"] == 90000  # the snapshot's, once the session has none
