"""/metrics: Prometheus text, deployment numbers from PostgreSQL, no tenant data."""

from __future__ import annotations

import uuid

from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

from service.store.db import Database
from service.store.models import RequestRow
from tests.api.conftest import StartServer
from tests.api.helpers import ask


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


async def test_metrics_report_admissions_statuses_calls_latency_and_subscribers(
    start_server: StartServer, db: Database
) -> None:
    server = await start_server()  # its own: the subscriber count must see only this test's stream
    async with server.client() as client:
        first = await ask(client, "secret-parent-id")
        await ask(client, "secret-parent-id")
        usage = {
            "input_tokens": 10,
            "output_tokens": 5,
            "reasoning_tokens": 0,
            "cached_tokens": 0,
            "calls": [
                {"purpose": "qa_summary", "status": "ok", "latency_ms": 300},
                {"purpose": "answer", "status": "failed", "latency_ms": 1500},
            ],
        }
        async with db.sessions() as tx:
            await tx.execute(
                update(RequestRow)
                .where(RequestRow.id == uuid.UUID(first["id"]))
                .values(status="failed", error={"code": "timeout", "message": "m", "detail": {}}, usage=usage)
            )
            await tx.commit()
        async with client.stream("GET", "/v1/sessions/secret-parent-id/events") as stream:
            assert stream.status_code == 200
            text = (await client.get("/metrics")).text
        values = _samples(text)
        assert values[("sidequest_requests_admitted_total", ())] == 2
        # Two questions asked one after the other: two CALLs, one admission each.
        assert values[("sidequest_admission_calls_total", ())] == 2
        assert values[("sidequest_admission_call_admissions_total", ())] == 2
        assert values[("sidequest_admission_batch_fallbacks_total", ())] == 0
        assert values[("sidequest_requests_queued", ())] == 1
        assert values[("sidequest_requests_running", ())] == 0
        assert values[("sidequest_requests_terminal", (("code", "timeout"), ("status", "failed")))] == 1
        assert values[("sidequest_summary_calls", ())] == 1
        assert values[("sidequest_provider_calls", (("purpose", "answer"), ("status", "failed")))] == 1
        assert (
            values[("sidequest_provider_latency_seconds_bucket", (("le", "0.5"), ("purpose", "qa_summary")))]
            == 1
        )
        assert (
            values[("sidequest_provider_latency_seconds_bucket", (("le", "1.0"), ("purpose", "answer")))] == 0
        )
        assert values[("sidequest_provider_latency_seconds_count", (("purpose", "answer"),))] == 1
        assert values[("sidequest_sse_subscribers", ())] == 1
        assert values[("sidequest_database_up", ())] == 1
        assert "secret-parent-id" not in text and "default" not in text


async def test_numbers_the_database_did_not_give_are_left_out_not_zero() -> None:
    """While PostgreSQL is away a scrape reads nothing: database_up 0, and no "0 running" that would
    read as a real value; what this process counts itself is still there."""
    from service.api.metrics import Metrics
    from service.store.db import connect
    from tests.net import free_port

    db = connect(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/nothing")
    try:
        values = _samples((await Metrics(lambda: 3).render(db)).decode())
    finally:
        await db.dispose()
    assert values[("sidequest_database_up", ())] == 0
    assert values[("sidequest_sse_subscribers", ())] == 3
    assert ("sidequest_admission_calls_total", ()) in values
    left = {name for name, _ in values if not name.startswith("sidequest_requests_admitted")}
    assert not any(
        name.startswith(("sidequest_requests", "sidequest_provider", "sidequest_jobs")) for name in left
    )
