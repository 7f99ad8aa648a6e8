"""SPEC §7 and §8, provider failures: classification, rate-limit retries, overflow retries.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.contract.helpers import (
    SNAPSHOT,
    ask,
    events_of,
    new_parent,
    parse_utc,
    read_stream,
    wait_for,
)
from tests.scripted_provider import STREAM_OVERFLOW_ERROR, STREAM_SERVER_ERROR, ScriptedServer, Step


async def test_provider_http_500_fails_with_provider_error_status_and_message(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.server_error(500))
    record = await ask(client, new_parent())
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "provider_error"
    assert done["error"]["detail"]["status"] == 500
    assert "server had an error" in done["error"]["detail"]["message"]
    calls = done["usage"]["calls"]
    assert len(calls) == 1 and calls[0]["status"] == "failed" and calls[0]["reported"] is False
    _, stream = await read_stream(client, f"/v1/questions/{record['id']}/events")
    events = events_of(stream)
    assert events[-2].json()["status"] == "failed"
    assert events[-1].event == "error" and events[-1].json()["code"] == "provider_error"
    assert events[-1].json()["detail"] == done["error"]["detail"]


@pytest.mark.parametrize(
    ("step", "code"),
    [
        (Step.model_not_found(), "model_unavailable"),
        (Step.tool_call("grep", arguments='{"pattern": "x"}'), "answer_tool_call"),
    ],
    ids=["model_not_found", "tool_call"],
)
async def test_answer_failures_get_their_spec_code(
    client: httpx.AsyncClient, scripted: ScriptedServer, step: Step, code: str
) -> None:
    scripted.script("answer", step)
    done = await wait_for(client, (await ask(client, new_parent(), snapshot=SNAPSHOT))["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == code, done["error"]


async def test_overflow_before_output_is_retried_once_after_shrinking(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    # A long earlier answer: replayed verbatim at first, folded into the (short) Q&A summary to shrink.
    scripted.script("answer", Step.text("A long earlier answer about invoices. " * 150))
    earlier = await ask(client, parent, "An earlier side question?", snapshot=SNAPSHOT)
    await wait_for(client, earlier["id"])
    scripted.script("answer", Step.overflow())
    record = await ask(client, parent, "Now it overflows?", snapshot=SNAPSHOT)
    done = await wait_for(client, record["id"])
    assert done["status"] == "succeeded", done["error"]
    calls = [r for r in scripted.requests("answer") if r.request_id == record["id"]]
    assert len(calls) == 2
    assert done["context_info"]["overflow_retries"] == 1
    assert [c["status"] for c in done["usage"]["calls"] if c["purpose"] == "answer"] == ["failed", "ok"]
    # The replayed Q&A was folded into the rolling summary, which the session now shows.
    assert done["context_info"]["qa_summary"]["used"] is True
    memory = (await client.get(f"/v1/sessions/{parent}")).json()["memory"]
    assert memory["qa_summary"]["covered_through_ordinal"] == 1
    assert memory["qa_summary"]["tokens"] > 0
    parse_utc(memory["qa_summary"]["updated_at"])


async def test_overflow_that_cannot_shrink_fails_with_context_overflow_at_once(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", Step.overflow(), Step.overflow())
    record = await ask(client, new_parent(), "Nothing to shrink?")
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "context_overflow", done["error"]
    assert len([r for r in scripted.requests("answer") if r.request_id == record["id"]]) == 1


async def test_rate_limits_are_retried_twice_then_rate_limited_and_quota_is_not_retried(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    scripted.script("answer", *[Step.rate_limited(retry_after="0")] * 3)
    record = await ask(client, new_parent())
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed" and done["error"]["code"] == "rate_limited", done["error"]
    assert done["error"]["detail"]["status"] == 429 and done["error"]["detail"]["attempts"] == 3
    assert len([r for r in scripted.requests("answer") if r.request_id == record["id"]]) == 3
    assert [c["status"] for c in done["usage"]["calls"]] == ["failed"] * 3

    scripted.script("answer", Step.rate_limited(retry_after="0"), Step.text("Third time lucky."))
    recovered = await wait_for(client, (await ask(client, new_parent()))["id"])
    assert recovered["status"] == "succeeded" and recovered["answer"] == "Third time lucky."
    assert [c["status"] for c in recovered["usage"]["calls"]] == ["failed", "ok"]

    scripted.script("answer", Step.quota_exhausted())
    quota = await ask(client, new_parent())
    done = await wait_for(client, quota["id"])
    assert done["error"]["code"] == "rate_limited", done["error"]
    assert len([r for r in scripted.requests("answer") if r.request_id == quota["id"]]) == 1


_TPM_TOO_LARGE = {
    "error": {
        "message": "Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, "
        "Requested 45000. The input or output tokens must be reduced in order to run successfully.",
        "type": "tokens",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}
_MAX_TOKENS_CAP = {
    "error": {
        "message": "max_tokens is too large: 50000. This model supports at most 16384 completion tokens, "
        "whereas you provided 50000.",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": None,
    }
}
_OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}


@pytest.mark.parametrize(
    ("steps", "code", "calls"),
    [
        ([Step.rate_limited(status=413, body=_TPM_TOO_LARGE, retry_after="0")] * 3, "rate_limited", 3),
        ([Step.rate_limited(status=529, body=_OVERLOADED, retry_after="0")] * 3, "rate_limited", 3),
        ([Step.http_error(400, _MAX_TOKENS_CAP)], "provider_error", 1),
        ([Step.http_error(400, {"error": {"message": "The model `x` does not exist"}})],
         "model_unavailable", 1),
    ],
    ids=["413_tpm_is_a_rate_limit", "529_is_a_rate_limit", "max_tokens_cap_is_a_provider_error", "model_400"],
)  # fmt: skip
async def test_overflow_look_alikes_are_classified_as_spec_says(
    client: httpx.AsyncClient, scripted: ScriptedServer, steps: list[Step], code: str, calls: int
) -> None:
    scripted.script("answer", *steps)
    record = await ask(client, new_parent(), snapshot=SNAPSHOT)
    done = await wait_for(client, record["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == code, done["error"]
    assert len([r for r in scripted.requests("answer") if r.request_id == record["id"]]) == calls
    assert done["context_info"]["overflow_retries"] == 0


async def test_an_overflow_inside_the_stream_is_retried_but_a_partial_reply_never_is(
    client: httpx.AsyncClient, scripted: ScriptedServer
) -> None:
    parent = new_parent()
    scripted.script("answer", Step.text("A long earlier answer about invoices. " * 150))
    await wait_for(client, (await ask(client, parent, "Earlier?", snapshot=SNAPSHOT))["id"])

    scripted.script("answer", Step.overflow_in_stream())
    retried = await ask(client, parent, "Overflow in the stream?", snapshot=SNAPSHOT)
    done = await wait_for(client, retried["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["context_info"]["overflow_retries"] == 1
    assert len([r for r in scripted.requests("answer") if r.request_id == retried["id"]]) == 2

    for step in (
        Step.error_after_partial("Half an ans", error=STREAM_SERVER_ERROR),
        Step.error_after_partial("Half"),
    ):
        scripted.script("answer", step)
        broken = await ask(client, new_parent(), "Breaks midway?")
        failed = await wait_for(client, broken["id"])
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "provider_error", failed["error"]
        assert len([r for r in scripted.requests("answer") if r.request_id == broken["id"]]) == 1
    scripted.script("answer", Step.error_after_partial("Half", error=STREAM_OVERFLOW_ERROR))
    partial = await ask(client, new_parent(), "Overflow after some text?")
    failed = await wait_for(client, partial["id"])
    assert failed["status"] == "failed" and failed["context_info"]["overflow_retries"] == 0
    assert len([r for r in scripted.requests("answer") if r.request_id == partial["id"]]) == 1
