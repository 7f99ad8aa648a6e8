"""``/metrics`` (Prometheus text format). No tenant data: no parent ids, no tenant labels.

Two kinds of numbers:

- this process's: requests admitted (counter), open SSE subscribers (gauge), and the admission
  CALLs it sent with the admissions they carried (their ratio is the mean group-commit batch,
  ``service.store.admission_batch``);
- the deployment's, read from PostgreSQL at scrape time so every API process reports the same
  truth whichever worker process did the work: requests by status, terminal requests by status and
  error code, provider calls by purpose and status, summary calls, and provider latency (a
  histogram over the per-call ``latency_ms`` the worker records in ``usage.calls``, when present),
  background jobs by kind and status with their calls and tokens. Cleared requests are excluded.
- calibration (SPEC 5.1): the ratio in use per (provider, model) and its sample count, and a drift
  histogram per model: for each answered request, provider prompt tokens ÷ our estimate of what was
  sent (1.0 = the estimate was exact; 1.5 = the tokenizer counts 50 % more than we estimate).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from service.budget import Calibration
from service.store.db import Database
from service.store.jobs import JobStats, read_job_stats
from service.store.stats import read_request_stats
from service.vocabulary import TERMINAL, Status

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
SCRAPE_TIMEOUT_S = 5.0
# Drift ratio buckets: the clamp range of the calibration ratio (0.5–2.0) finely around 1, then out.
DRIFT_BUCKETS = (0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0)


def _gauge(name: str, help_text: str, labels: Sequence[str], rows: Iterable[Sequence[Any]]) -> Metric:
    """A gauge family; each row is its label values followed by its value."""
    family = GaugeMetricFamily(name, help_text, labels=list(labels))
    for *values, n in rows:
        family.add_metric([str(v) for v in values], float(n))
    return family


def _histogram(
    name: str, help_text: str, label: str, observed: Iterable[tuple[str, float]], bounds: Sequence[float]
) -> Metric:
    """A histogram family with one series per label value, from its observations."""
    family = HistogramMetricFamily(name, help_text, labels=[label])
    per_label: dict[str, list[float]] = {}
    for value, observation in observed:
        per_label.setdefault(value, []).append(observation)
    for value, observations in sorted(per_label.items()):
        buckets = [(str(b), float(sum(1 for o in observations if o <= b))) for b in bounds]
        buckets.append(("+Inf", float(len(observations))))
        family.add_metric([value], buckets, sum_value=sum(observations))
    return family


class DatabaseSnapshot:
    """The numbers read from PostgreSQL for one scrape."""

    def __init__(self) -> None:
        self.by_status: list[tuple[str, str, int]] = []
        self.calls: list[tuple[str, str, int]] = []
        self.latencies: list[tuple[str, float]] = []
        self.jobs = JobStats([], [], [])
        self.drift: list[tuple[str, float]] = []
        self.calibration: list[tuple[str, str, int, int, int]] = []
        self.ok = False


async def read_database(db: Database) -> DatabaseSnapshot:
    """Run the scrape queries (bounded by SCRAPE_TIMEOUT_S); ``ok`` False when they failed."""
    snap = DatabaseSnapshot()
    try:
        async with asyncio.timeout(SCRAPE_TIMEOUT_S), db.sessions() as session:
            stats = await read_request_stats(session)
            snap.jobs = await read_job_stats(session)
        snap.by_status, snap.calls, snap.latencies = stats.by_status, stats.calls, stats.latencies
        snap.drift, snap.calibration = stats.drift, stats.calibration
        snap.ok = True
    except Exception as exc:  # metrics must answer even while the database does not
        log.warning("metrics: database read failed: %s", type(exc).__name__)
    return snap


class _SnapshotCollector(Collector):
    """Turns the last DatabaseSnapshot (set just before generate_latest) into metric families."""

    def __init__(self, subscribers: Callable[[], int], *, calibration_on: bool = True) -> None:
        self.snapshot = DatabaseSnapshot()
        self._subscribers = subscribers
        self._calibration_on = calibration_on
        self.batches: tuple[int, int, int] = (0, 0, 0)  # admission CALLs, admissions, fallbacks

    def collect(self) -> Iterable[Metric]:
        snap = self.snapshot
        yield _gauge(
            "sidequest_database_up", "1 when the scrape could read PostgreSQL", (), [(int(snap.ok),)]
        )
        yield _gauge(
            "sidequest_sse_subscribers", "Open SSE streams in this API process", (), [(self._subscribers(),)]
        )
        for name, help_text, value in zip(
            (
                "sidequest_admission_calls",
                "sidequest_admission_call_admissions",
                "sidequest_admission_batch_fallbacks",
            ),
            (
                "Admission CALLs this API process committed",
                "Admissions those CALLs carried",
                "Admission batches that failed and were sent again one by one",
            ),
            self.batches,
            strict=True,
        ):
            family = CounterMetricFamily(name, help_text)
            family.add_metric([], float(value))
            yield family
        if not snap.ok:
            # Nothing was read: the families below are left out rather than written as zeros,
            # which would read as real values ("0 running") while the database is away; alert on
            # sidequest_database_up instead.
            return

        statuses: dict[str, int] = dict.fromkeys(Status, 0)
        terminal: dict[tuple[str, str], int] = {}
        for status, code, n in snap.by_status:
            statuses[status] = statuses.get(status, 0) + n
            if status in TERMINAL:
                terminal[(status, code)] = terminal.get((status, code), 0) + n
        yield _gauge("sidequest_requests", "Stored requests by status", ("status",), statuses.items())
        yield _gauge(
            "sidequest_requests_queued", "Requests waiting for a worker", (), [(statuses[Status.QUEUED],)]
        )
        yield _gauge(
            "sidequest_requests_running",
            "Requests running now (all workers)",
            (),
            [(statuses[Status.RUNNING],)],
        )
        yield _gauge(
            "sidequest_requests_terminal",
            "Stored terminal requests by status and error code (code empty on success)",
            ("status", "code"),
            [(status, code, n) for (status, code), n in sorted(terminal.items())],
        )
        yield _gauge(
            "sidequest_provider_calls", "Provider calls of stored requests", ("purpose", "status"), snap.calls
        )
        summary_total = sum(n for purpose, _, n in snap.calls if purpose in ("qa_summary", "context_summary"))
        yield _gauge("sidequest_summary_calls", "Summary calls of stored requests", (), [(summary_total,)])
        yield _histogram(
            "sidequest_provider_latency_seconds",
            "Provider call latency of stored requests",
            "purpose",
            snap.latencies,
            LATENCY_BUCKETS_S,
        )
        yield from _calibration_families(snap, self._calibration_on)
        yield from _job_families(snap)


def _calibration_families(snap: DatabaseSnapshot, calibration_on: bool) -> Iterable[Metric]:
    ratio = GaugeMetricFamily(
        "sidequest_calibration_ratio",
        "Calibration ratio in use (provider / estimate, clamped 0.5-2.0; 1.0 below 5 samples "
        "or with SIDEQUEST_CALIBRATION=off)",
        labels=["provider", "model"],
    )
    samples = GaugeMetricFamily(
        "sidequest_calibration_samples", "Calibration samples recorded", labels=["provider", "model"]
    )
    for provider, model, count, estimate_sum, provider_sum in snap.calibration:
        calibration = Calibration(samples=count, estimate_sum=estimate_sum, provider_sum=provider_sum)
        # SPEC §5.1: calibration off uses the raw estimate, "ratio reported as 1.0".
        ratio.add_metric([provider, model], calibration.ratio if calibration_on else 1.0)
        samples.add_metric([provider, model], float(count))
    yield ratio
    yield samples
    yield _histogram(
        "sidequest_prompt_drift_ratio",
        "Answer calls: provider prompt tokens / estimated prompt tokens (raw estimate, uncalibrated)",
        "model",
        snap.drift,
        DRIFT_BUCKETS,
    )


def _job_families(snap: DatabaseSnapshot) -> Iterable[Metric]:
    """Background summary jobs (SPEC §6.6): by kind and outcome, their calls and tokens."""
    yield _gauge(
        "sidequest_background_jobs",
        "Background summary jobs by kind and status",
        ("kind", "status"),
        snap.jobs.by_outcome,
    )
    yield _gauge(
        "sidequest_background_calls",
        "Provider calls of background jobs by kind and call status",
        ("kind", "status"),
        snap.jobs.calls,
    )
    yield _gauge(
        "sidequest_background_tokens",
        "Tokens reported for background jobs' calls by kind and direction",
        ("kind", "direction"),
        snap.jobs.tokens,
    )


class Metrics:
    """One registry per app (no process-global state, so tests can build many apps)."""

    def __init__(self, subscribers: Callable[[], int], *, calibration_on: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.admitted = Counter(
            "sidequest_requests_admitted",
            "Requests admitted by this API process",
            registry=self.registry,
        )
        self._collector = _SnapshotCollector(subscribers, calibration_on=calibration_on)
        self.registry.register(self._collector)

    async def render(self, db: Database) -> bytes:
        """The exposition text, with fresh database numbers."""
        self._collector.snapshot = await read_database(db)
        batcher = db.admissions
        self._collector.batches = (batcher.calls, batcher.admissions, batcher.fallbacks)
        return generate_latest(self.registry)
