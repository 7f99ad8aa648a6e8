"""Calibration through the pipeline (SPEC 5.1): a scripted model whose tokenizer counts 1.5× our estimate.

The scripted server computes what it "counts" from the body it received — ``factor`` × the same
bytes-÷-3 estimate of every text on the wire (``wire_estimate``) — and answers with an overflow when
that count does not fit the window, as a real provider would. Samples go to PostgreSQL; a new
Database reads them back.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from service.budget import (
    Calibration,
    normalize_snapshot,
    plan_window,
    resolve_output_cap,
    resolve_window,
)
from service.config import Settings
from service.providers.base import Provider
from service.store import calibration as store
from service.store.db import Database, connect
from service.summary.prompts import build_answer_request
from tests.factories import add_snapshot, admit, make_session
from tests.pipeline.conftest import Ran, run_one
from tests.scripted_provider import VALID_SUMMARY, ScriptedServer, Step, Usage, wire_estimate

WINDOW = 60_000
OUTPUT_CAP = 1024


def counting(
    factor: float, *, window: int | None = None, reported: bool = True, summary: bool = False
) -> Callable[[dict[str, Any]], Step]:
    """A responder whose tokenizer counts ``factor`` × our estimate (and overflows past ``window``)."""

    def respond(body: dict[str, Any]) -> Step:
        real = math.ceil(factor * wire_estimate(body))
        limit = (
            None
            if window is None
            else window - int(body.get("max_tokens") or body.get("max_completion_tokens") or 0)
        )
        if limit is not None and real > limit:
            return Step.overflow()
        usage = Usage(real, 5) if reported else None
        return Step.valid_summary(usage=usage) if summary else Step.text("Calibrated answer.", usage=usage)

    return respond


async def counters(db: Database, model: str = "scripted-model") -> Calibration:
    async with db.sessions() as session:
        return await store.load_calibration(session, "openai", model)


async def ask(
    db: Database,
    settings: Settings,
    provider: Provider,
    session_id: uuid.UUID,
    question: str = "q?",
    **kw: Any,
) -> Ran:
    rid = await admit(db, session_id, question, **kw)
    ran = await run_one(db, settings, provider, rid)
    assert ran.outcome.status == "succeeded", ran.row.error
    return ran


async def warm_up(
    db: Database, settings: Settings, provider: Provider, calls: int = 5, **kw: Any
) -> list[Ran]:
    sid = await make_session(db, f"warm-{uuid.uuid4().hex[:6]}")
    return [await ask(db, settings, provider, sid, f"warm-up question {i}?", **kw) for i in range(calls)]


async def test_ratio_is_neutral_below_five_samples_then_about_1_5(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    server.respond_with("answer", counting(1.5))
    runs = await warm_up(db, model_settings, provider, calls=6)
    infos = [r.row.context_info["calibration"] for r in runs]
    # As they stood when each request was prepared: before its own call added a sample.
    assert [i["samples"] for i in infos] == [0, 1, 2, 3, 4, 5]
    assert all(i == {"ratio": 1.0, "samples": i["samples"], "applied": False} for i in infos[:5])
    assert infos[5]["applied"] is True
    assert abs(infos[5]["ratio"] - 1.5) < 0.03
    stored = await counters(db)
    assert stored.samples == 6
    # Each sample is the answer request's estimate as sent against the reported prompt tokens.
    assert stored.estimate_sum == sum(r.row.context_info["estimate"]["total"] for r in runs)
    assert stored.provider_sum == sum(r.row.context_info["provider_prompt_tokens"] for r in runs)
    # estimate.* stays raw: calibration is never written into a segment.
    for ran in runs:
        estimate = ran.row.context_info["estimate"]
        assert estimate["total"] == sum(v for k, v in estimate.items() if k != "total")
        assert ran.row.context_info["provider_prompt_tokens"] > estimate["total"]


def big_snapshot() -> dict[str, Any]:
    """8 groups of ~5000 tokens each: ~40 000 raw tokens, ~60 000 at 1.5×."""
    messages: list[dict[str, Any]] = []
    for i in range(8):
        messages.append({"role": "user", "content": f"step {i}: " + "u" * 3000})
        messages.append({"role": "assistant", "content": f"done {i}: " + "a" * 12000})
    return {"system": "You are the main agent.", "messages": messages, "context_window": WINDOW}


def raw_fit(snapshot: dict[str, Any], question: str) -> tuple[int, int]:
    """(raw estimate of the uncompacted answer request, input budget) for this snapshot."""
    normalized = normalize_snapshot(snapshot)
    request = build_answer_request(
        question=question, system=normalized.system, messages=normalized.messages, tools=normalized.tools
    )
    window = resolve_window(None, WINDOW, None)
    plan = plan_window(window, resolve_output_cap(OUTPUT_CAP, 8192, None))
    return request.estimate.total, plan.input_budget


async def test_a_request_that_fits_raw_but_not_calibrated_is_compacted_before_it_is_sent(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    server.respond_with("answer", counting(1.5, window=WINDOW))
    server.respond_with("context_summary", counting(1.5, summary=True))
    await warm_up(db, model_settings, provider)
    sid = await make_session(db, "big")
    snapshot = big_snapshot()
    raw, budget = raw_fit(snapshot, "what happened?")
    assert raw <= budget < Calibration(5, 1000, 1500).apply(raw)  # fits raw, not calibrated
    await add_snapshot(db, sid, "s-big", snapshot)

    ran = await ask(
        db,
        model_settings,
        provider,
        sid,
        "what happened?",
        snapshot_id="s-big",
        options={"max_output_tokens": OUTPUT_CAP},
    )

    info = ran.row.context_info
    assert info["calibration"]["applied"] is True and info["calibration"]["samples"] == 5
    assert info["input_budget"] == budget
    assert "compacting_context" in ran.stages()
    assert info["context_summary"]["used"] is True
    # Compacted before it was sent: one answer call, no overflow, no retry.
    assert info["overflow_retries"] == 0
    answers = [c for c in ran.row.usage["calls"] if c["purpose"] == "answer"]
    assert [c["status"] for c in answers] == ["ok"]
    assert info["provider_prompt_tokens"] <= WINDOW - OUTPUT_CAP


async def test_without_calibration_the_same_request_overflows_first(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    settings = model_settings.model_copy(update={"calibration": "off"})
    server.respond_with("answer", counting(1.5, window=WINDOW))
    server.respond_with("context_summary", counting(1.5, summary=True))
    await warm_up(db, settings, provider)
    sid = await make_session(db, "big-off")
    await add_snapshot(db, sid, "s-big", big_snapshot())

    ran = await ask(
        db,
        settings,
        provider,
        sid,
        "what happened?",
        snapshot_id="s-big",
        options={"max_output_tokens": OUTPUT_CAP},
    )

    info = ran.row.context_info
    # Off: raw estimate, ratio reported as 1.0, applied false, nothing learnt.
    assert info["calibration"] == {"ratio": 1.0, "samples": 0, "applied": False}
    assert (await counters(db)).samples == 0
    assert info["overflow_retries"] == 1
    answers = [c for c in ran.row.usage["calls"] if c["purpose"] == "answer"]
    assert [c["status"] for c in answers] == ["failed", "ok"]


async def test_counters_are_per_model(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    server.respond_with("answer", counting(1.5))
    await warm_up(db, model_settings, provider)
    sid = await make_session(db, "other-model")
    ran = await ask(db, model_settings, provider, sid, options={"model": "other-model"})
    assert ran.row.context_info["calibration"] == {"ratio": 1.0, "samples": 0, "applied": False}
    assert (await counters(db, "other-model")).samples == 1
    assert (await counters(db)).samples == 5


async def test_counters_survive_a_restart(
    db: Database, database_url: str, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    server.respond_with("answer", counting(1.5))
    await warm_up(db, model_settings, provider)
    before = await counters(db)
    # A new engine (a new process's view): the counters are read back from PostgreSQL.
    fresh = connect(database_url, pool_size=2)
    try:
        assert await counters(fresh) == before
        sid = await make_session(fresh, "after-restart")
        ran = await ask(fresh, model_settings, provider, sid)
    finally:
        await fresh.dispose()
    info = ran.row.context_info["calibration"]
    assert info["samples"] == 5 and info["applied"] is True
    assert abs(info["ratio"] - before.ratio) < 1e-3


async def test_unreported_usage_adds_no_sample(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    server.respond_with("answer", counting(1.5, reported=False))
    runs = await warm_up(db, model_settings, provider, calls=2)
    assert all(r.row.context_info["provider_prompt_tokens"] is None for r in runs)
    assert (await counters(db)).samples == 0
    async with db.sessions() as session:
        rows = (await session.execute(text("SELECT count(*) FROM sidequest_calibration"))).scalar_one()
    assert rows == 0


async def test_a_failed_call_that_reported_its_prompt_tokens_is_a_sample(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    """SPEC §5.1: every call whose usage reports prompt tokens adds a sample — a failed one too: a
    broken answer stream that had reported 222 prompt tokens is one."""
    from tests.scripted_provider import Step, Usage

    server.script("answer", Step.error_after_partial("half an ans", usage=Usage(222, 2)))
    sid = await make_session(db, "broken")
    ran = await run_one(db, model_settings, provider, await admit(db, sid, "q?"))
    assert ran.row.error is not None and ran.row.error["code"] == "provider_error"
    stored = await counters(db)
    assert stored.samples == 1 and stored.provider_sum == 222
    assert stored.estimate_sum == ran.row.context_info["estimate"]["total"]


async def test_ratio_is_clamped_at_2(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    server.respond_with("answer", counting(3.0))
    await warm_up(db, model_settings, provider)
    sid = await make_session(db, "clamped")
    ran = await ask(db, model_settings, provider, sid)
    info = ran.row.context_info["calibration"]
    assert info == {"ratio": 2.0, "samples": 5, "applied": True}
    raw = await counters(db)
    assert raw.provider_sum / raw.estimate_sum > 2.5  # the counters keep the truth; the ratio is clamped


async def test_summary_calls_are_samples_too(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    from tests.factories import add_history

    server.respond_with("answer", counting(1.5))
    server.respond_with("qa_summary", counting(1.5, summary=True))
    sid = await make_session(db, "folded")
    await add_history(db, sid, [(f"question {i}?", f"answer {i}.") for i in range(1, 22)])
    ran = await ask(db, model_settings, provider, sid, "and now?")
    assert ran.row.context_info["qa_summary"]["calls"] == 1
    # One sample for the summary call (its prompt as sent), one for the answer.
    stored = await counters(db)
    assert stored.samples == 2
    summary_body = server.requests("qa_summary")[0].body
    answer_estimate = ran.row.context_info["estimate"]["total"]
    assert abs((stored.estimate_sum - answer_estimate) - wire_estimate(summary_body)) <= 2


async def test_an_overflow_that_states_the_real_count_is_a_sample_and_sizes_the_retry(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    """SPEC 5.1: "your request has N input tokens" is a sample, and the retry shrinks to fit N."""
    sid = await make_session(db, "stated")
    snapshot = big_snapshot()
    raw, budget = raw_fit(snapshot, "what happened?")
    assert raw <= budget  # it fits by our estimate: only the provider's count says otherwise
    stated = raw * 3 // 2  # the tokenizer counts 1.5× what we estimate
    body = {
        "error": {
            "message": f"This model's maximum context length is {WINDOW} tokens. However, your request has "
            f"{stated} input tokens. Please reduce the length of the input messages.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    server.script("answer", Step.overflow(body), Step.text("Shrunk answer.", usage=Usage(1000, 5)))
    await add_snapshot(db, sid, "s-stated", snapshot)

    ran = await ask(
        db,
        model_settings,
        provider,
        sid,
        "what happened?",
        snapshot_id="s-stated",
        options={"max_output_tokens": OUTPUT_CAP},
    )

    info = ran.row.context_info
    assert info["overflow_retries"] == 1
    answers = [c["status"] for c in ran.row.usage["calls"] if c["purpose"] == "answer"]
    assert answers == ["failed", "ok"]
    # The stated count is a sample: the estimate as sent against it; then the shrink's summary
    # call and the retry are samples of their own.
    summaries = [c for c in ran.row.usage["calls"] if c["purpose"] != "answer"]
    stored = await counters(db)
    assert stored.samples == 2 + len(summaries)
    assert stored.provider_sum == stated + 1000 + sum(c["input_tokens"] for c in summaries)
    # …and the retry was sized to fit it: at the stated ratio, the retry's estimate fits the budget.
    retry_estimate = info["estimate"]["total"]
    assert retry_estimate * stated // raw <= budget


async def test_a_retry_after_a_stated_count_fits_even_when_its_new_summary_is_larger(
    db: Database, model_settings: Settings, provider: Provider, server: ScriptedServer
) -> None:
    """SPEC 5.1: the retry shrinks to fit the stated count, not by a guess — also when the request was
    compacted already and the summary of the longer old part comes back larger than the one it had
    (sized by the old summary, the retry would go over by the difference)."""
    sid = await make_session(db, "stated-again")
    messages: list[dict[str, Any]] = []
    for i in range(50):
        messages.append({"role": "user", "content": f"step {i}: " + "u" * 1500})
        messages.append({"role": "assistant", "content": f"done {i}: " + "a" * 1500})
    snapshot = {"system": "You are the main agent.", "messages": messages, "context_window": 40_000}
    await add_snapshot(db, sid, "s-big", snapshot)
    options = {"max_output_tokens": OUTPUT_CAP}
    first = await ask(db, model_settings, provider, sid, "warm?", snapshot_id="s-big", options=options)
    assert first.row.context_info["context_summary"]["used"] is True
    larger = {**VALID_SUMMARY, "state": "The agent refactored the parser. " * 40}
    server.script("context_summary", Step.valid_summary(larger))
    stated = 40_000
    message = (
        "This model's maximum context length is 40000 tokens. "
        f"However, your messages resulted in {stated} tokens."
    )
    body = {"error": {"message": message, "type": "x", "code": "context_length_exceeded"}}
    server.script("answer", Step.overflow(body), Step.text("Shrunk answer."))
    ran = await ask(db, model_settings, provider, sid, "again?", snapshot_id="s-big", options=options)
    info = ran.row.context_info
    assert info["overflow_retries"] == 1
    before = next(p["estimate_before"] for p in ran.of("progress") if p.get("estimate_before"))
    assert info["estimate"]["total"] * stated // before <= info["input_budget"]
