"""The compaction ladder on real PostgreSQL through the scripted model (SPEC §6.2, §6.8–§6.10):
what reaches the summary calls and the answer call, masking on and off."""

from __future__ import annotations

import json
from typing import Any

from service.budget.masking import ELIDED_PREFIX
from service.budget.trail import TRAIL_HEADING
from service.config import Settings
from service.providers.base import Provider
from service.store.db import Database
from tests.factories import add_snapshot, admit, make_session, tool_session
from tests.pipeline.conftest import run_one
from tests.scripted_provider import ScriptedServer


def snapshot(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"taken_at": "2026-12-01T10:00:00Z", "system": "main agent", "messages": messages}


def _text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


async def test_a_request_that_masking_alone_fits_makes_no_summary_call(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    # 30 groups of ~2000 tokens (~60k) against a 32000-token window: masked, each group is ~60 tokens.
    sid = await make_session(db)
    await add_snapshot(db, sid, "s1", snapshot(tool_session(30)))
    rid = await admit(
        db, sid, "which module computes value_3?", snapshot_id="s1", options={"context_window": 32000}
    )

    ran = await run_one(db, model_settings, provider, rid)

    assert ran.outcome.status == "succeeded", ran.row.error
    assert server.requests("context_summary") == []
    info = ran.row.context_info
    assert info["summary_calls"] == 0 and info["context_summary"]["used"] is False
    assert info["estimate"]["total"] <= info["input_budget"]
    fidelity = info["fidelity"]
    assert fidelity["tier"] == "masked" and fidelity["summarized_messages"] == 0
    sent = server.requests("answer")[0].body["messages"]
    stubs = [m for m in sent if ELIDED_PREFIX in _text(m)]
    # Oldest first: the first result is masked, the newest (the recent 8000 tokens) verbatim.
    first_result = next(m for m in sent if m.get("tool_call_id") == "t0")
    assert first_result["content"].startswith(ELIDED_PREFIX) and "value_29 = compute(29)" in _text(sent)
    assert fidelity["masked_messages"] == len(stubs)
    assert fidelity["verbatim_messages"] + fidelity["masked_messages"] == 120
    # Every file read is still named in the prompt.
    assert all(f"/src/mod_{n}.py" in _text(sent) for n in range(30))
    assert fidelity["artifacts"] == {"total": 30, "in_prompt": 30}
    masked = [e for e in ran.of("progress") if e.get("what") == "context_masked"]
    assert (
        masked
        and masked[0]["tier"] == "masked"
        and masked[0]["payload_bytes"] == fidelity["masked_payload_bytes"]
    )


async def test_tier_two_summarises_the_masked_form_and_carries_the_trail(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    # 300 groups: masked they are still ~25k tokens, over a ~12k budget: the oldest are summarised.
    sid = await make_session(db)
    await add_snapshot(db, sid, "s1", snapshot(tool_session(300, payload_bytes=2000)))
    options = {"context_window": 16000, "max_output_tokens": 2048}
    rid = await admit(db, sid, "what did the agent read first?", snapshot_id="s1", options=options)

    ran = await run_one(db, model_settings, provider, rid)

    assert ran.outcome.status == "succeeded", ran.row.error
    material = _text([r.body for r in server.requests("context_summary")])
    assert ELIDED_PREFIX in material  # the summarised groups went in their masked form
    assert "inner_0 = 1" not in material
    sent = server.requests("answer")[0].body["messages"]
    summary_turn = _text(sent[1])  # after the system message
    assert TRAIL_HEADING in summary_turn
    trail = sent[1]["content"].split(TRAIL_HEADING)[1].strip().splitlines()
    # Bounded to the most recently used 64 of the summarised groups' reads, the newest last.
    last_read = (ran.row.context_info["context_summary"]["summarized_messages"] - 1) // 4
    assert len(trail) == 64 and trail[-1] == f"- Read: /src/mod_{last_read}.py"
    info = ran.row.context_info
    fidelity = info["fidelity"]
    assert (
        fidelity["tier"] == "summary"
        and fidelity["summarized_messages"] == info["context_summary"]["summarized_messages"]
    )
    assert fidelity["artifacts"]["total"] == 300
    carried = sum(f"/src/mod_{n}.py" in _text(sent) for n in range(300))
    assert fidelity["artifacts"]["in_prompt"] == carried
    # The memory keeps the trail with the summary (SPEC §6.9: cached with it).
    second = await admit(db, sid, "and then?", snapshot_id="s1", options=options)
    again = await run_one(db, model_settings, provider, second)
    assert again.row.context_info["context_summary"]["cache"] == "hit"
    assert _text(server.requests("answer")[1].body["messages"][1]) == summary_turn


async def test_mask_tool_results_false_sends_the_prompt_of_before_masking(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    messages = tool_session(30)
    sid = await make_session(db, settings={"mask_tool_results": False})
    await add_snapshot(db, sid, "s1", snapshot(messages))
    rid = await admit(
        db, sid, "which module computes value_3?", snapshot_id="s1", options={"context_window": 32000}
    )

    ran = await run_one(db, model_settings, provider, rid)

    assert ran.outcome.status == "succeeded", ran.row.error
    info = ran.row.context_info
    kept = info["context_summary"]["kept_messages"]
    assert info["context_summary"]["used"] is True and kept > 0
    sent = server.requests("answer")[0].body["messages"]
    assert ELIDED_PREFIX not in _text(sent) and TRAIL_HEADING not in _text(sent)
    assert ELIDED_PREFIX not in _text([r.body for r in server.requests("context_summary")])
    # The summary turn, its acknowledgement, then the newest messages exactly as the main session had
    # them: the tool results' whole bodies, never a stub.
    kept_results = [m for m in sent if m.get("role") == "tool"]
    originals = [
        b["content"]
        for m in messages[-kept:]
        if isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_result"
    ]
    assert [m["content"] for m in kept_results] == originals
    assert info["fidelity"]["tier"] == "summary" and info["fidelity"]["masked_messages"] == 0


async def test_a_grown_snapshot_starts_with_the_same_masked_prefix(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    first_messages = tool_session(30)
    await add_snapshot(db, sid, "s1", snapshot(first_messages))
    await add_snapshot(db, sid, "s2", snapshot(first_messages + tool_session(5, start=30)))
    options = {"context_window": 32000}
    first = await admit(db, sid, "which module computes value_3?", snapshot_id="s1", options=options)
    await run_one(db, model_settings, provider, first)
    second = await admit(db, sid, "and value_33?", snapshot_id="s2", options=options)
    ran = await run_one(db, model_settings, provider, second)

    assert ran.outcome.status == "succeeded", ran.row.error
    one, two = (r.body["messages"] for r in server.requests("answer"))
    masked_prefix = [m for m in one if ELIDED_PREFIX in _text(m)]
    last_masked = one.index(masked_prefix[-1])
    # Byte for byte: a provider's prefix cache built by the first answer serves the second.
    assert _text(two[: last_masked + 1]) == _text(one[: last_masked + 1])
    assert server.requests("context_summary") == []
