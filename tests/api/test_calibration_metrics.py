"""/metrics for calibration (SPEC 5.1): the ratio per model and a drift histogram."""

from __future__ import annotations

import uuid

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

from service.api.metrics import Metrics
from service.store import calibration as store
from service.store.db import Database
from service.store.models import RequestRow
from service.store.stats import JobStats, RequestStats
from tests.api.conftest import Server
from tests.api.helpers import ask


async def test_metrics_report_the_calibration_ratio_and_drift(server: Server, db: Database) -> None:
    async with db.sessions() as tx, tx.begin():
        for _ in range(5):
            await store.add_sample(tx, "openai", "gpt-x", 1000, 1500)
        await store.add_sample(tx, "openai", "gpt-y", 1000, 1200)
    async with server.client() as client:
        first = await ask(client, "metrics-parent")
        second = await ask(client, "metrics-parent")
        for rid, prompt in ((first["id"], 120), (second["id"], 200)):
            async with db.sessions() as tx:
                await tx.execute(
                    update(RequestRow)
                    .where(RequestRow.id == uuid.UUID(rid))
                    .values(
                        model="gpt-x",
                        context_info={"estimate": {"total": 100}, "provider_prompt_tokens": prompt},
                    )
                )
                await tx.commit()
        text = (await client.get("/metrics")).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("sidequest_calibration_ratio", (("model", "gpt-x"), ("provider", "openai")))] == 1.5
    # One sample only: the ratio is not in use yet.
    assert samples[("sidequest_calibration_ratio", (("model", "gpt-y"), ("provider", "openai")))] == 1.0
    assert samples[("sidequest_calibration_samples", (("model", "gpt-x"), ("provider", "openai")))] == 5
    drift = "sidequest_prompt_drift_ratio"
    assert samples[(f"{drift}_count", (("model", "gpt-x"),))] == 2
    assert samples[(f"{drift}_bucket", (("le", "1.25"), ("model", "gpt-x")))] == 1  # 1.2
    assert samples[(f"{drift}_bucket", (("le", "2.0"), ("model", "gpt-x")))] == 2  # and 2.0
    assert abs(samples[(f"{drift}_sum", (("model", "gpt-x"),))] - 3.2) < 1e-9


def test_with_calibration_off_the_ratio_in_use_is_reported_as_one() -> None:
    # SPEC 5.1: SIDEQUEST_CALIBRATION=off uses the raw estimate, "ratio reported as 1.0"; the samples
    # are still counted (they are what a later "on" would use).
    rows = [("openai", "gpt-x", 5, 1000 * 5, 1500 * 5)]
    for on, expected in ((True, 1.5), (False, 1.0)):
        metrics = Metrics(lambda: 0, calibration_on=on)
        metrics.snapshot = (RequestStats(calibration=rows), JobStats([], [], []))
        values = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
            for s in family.samples
        }
        labels = (("model", "gpt-x"), ("provider", "openai"))
        assert values[("sidequest_calibration_ratio", labels)] == expected
        assert values[("sidequest_calibration_samples", labels)] == 5
