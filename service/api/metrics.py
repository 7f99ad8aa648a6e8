"""``/metrics`` (Prometheus text format), without tenant data (no parent ids, no tenant labels): this
process's numbers (admissions, open SSE streams, admission CALLs), and the deployment's, read from
PostgreSQL at scrape time so that every API process reports the same truth whichever worker did the work.
Every family and what it means: docs/api.md, "Metrics" (background jobs: operations.md)."""

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
from service.store.stats import JobStats, RequestStats, read_job_stats, read_request_stats
from service.vocabulary import TERMINAL, Status

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
SCRAPE_TIMEOUT_S = 5.0
# Drift ratio buckets: the clamp range of the calibration ratio (0.5–2.0) finely around 1, then out.
DRIFT_BUCKETS = (0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0)
# This process's admission batcher (service.store.admission_batch): its three counters, in order.
ADMISSION_COUNTERS = (
    ("sidequest_admission_calls", "Admission CALLs this API process committed"),
    ("sidequest_admission_call_admissions", "Admissions those CALLs carried"),
    ("sidequest_admission_batch_fallbacks", "Admission batches that failed and were sent again one by one"),
)


def _gauge(name: str, help_text: str, labels: Sequence[str], rows: Iterable[Sequence[Any]]) -> Metric:
    """A gauge family; each row is its label values followed by its value."""
    family = GaugeMetricFamily(name, help_text, labels=list(labels))
    for *values, n in rows:
        family.add_metric([str(v) for v in values], float(n))
    return family


def _scalar(name: str, help_text: str, value: float) -> Metric:
    return _gauge(name, help_text, (), [(value,)])


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


class Metrics(Collector):
    """One registry per app (no process-global state, so tests can build many apps); at each scrape it
    turns the numbers just read (:meth:`render`) into metric families."""

    def __init__(self, subscribers: Callable[[], int], *, calibration_on: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.admitted = Counter(
            "sidequest_requests_admitted",
            "Requests admitted by this API process",
            registry=self.registry,
        )
        # The numbers read from PostgreSQL for this scrape; None when the read failed.
        self.snapshot: tuple[RequestStats, JobStats] | None = None
        self._subscribers = subscribers
        self._calibration_on = calibration_on
        self.batches: tuple[int, int, int] = (0, 0, 0)  # admission CALLs, admissions, fallbacks
        self.registry.register(self)

    async def render(self, db: Database) -> bytes:
        """The exposition text, with fresh database numbers (read within SCRAPE_TIMEOUT_S)."""
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S), db.sessions() as tx:
                self.snapshot = (await read_request_stats(tx), await read_job_stats(tx))
        except Exception as exc:  # metrics must answer even while the database does not
            log.warning("metrics: database read failed: %s", type(exc).__name__)
            self.snapshot = None
        batcher = db.admissions
        self.batches = (batcher.calls, batcher.admissions, batcher.fallbacks)
        return generate_latest(self.registry)

    def collect(self) -> Iterable[Metric]:
        up = int(self.snapshot is not None)
        yield _scalar("sidequest_database_up", "1 when the scrape could read PostgreSQL", up)
        streams = self._subscribers()
        yield _scalar("sidequest_sse_subscribers", "Open SSE streams in this API process", streams)
        for (name, help_text), value in zip(ADMISSION_COUNTERS, self.batches, strict=True):
            yield CounterMetricFamily(name, help_text, value=value)
        if self.snapshot is None:
            # Nothing read: the families below are left out, as zeros would read as real values
            # ("0 running") while the database is away; alert on sidequest_database_up instead.
            return
        stats, jobs = self.snapshot

        statuses: dict[str, int] = dict.fromkeys(Status, 0)
        terminal: dict[tuple[str, str], int] = {}
        for status, code, n in stats.by_status:
            statuses[status] = statuses.get(status, 0) + n
            if status in TERMINAL:
                terminal[(status, code)] = terminal.get((status, code), 0) + n
        yield _gauge("sidequest_requests", "Stored requests by status", ("status",), statuses.items())
        queued, running = statuses[Status.QUEUED], statuses[Status.RUNNING]
        yield _scalar("sidequest_requests_queued", "Requests waiting for a worker", queued)
        yield _scalar("sidequest_requests_running", "Requests running now (all workers)", running)
        yield _gauge(
            "sidequest_requests_terminal",
            "Stored terminal requests by status and error code (code empty on success)",
            ("status", "code"),
            [(status, code, n) for (status, code), n in sorted(terminal.items())],
        )
        calls = stats.calls
        yield _gauge(
            "sidequest_provider_calls", "Provider calls of stored requests", ("purpose", "status"), calls
        )
        summary_total = sum(n for purpose, _, n in calls if purpose in ("qa_summary", "context_summary"))
        yield _scalar("sidequest_summary_calls", "Summary calls of stored requests", summary_total)
        yield _histogram(
            "sidequest_provider_latency_seconds",
            "Provider call latency of stored requests",
            "purpose",
            stats.latencies,
            LATENCY_BUCKETS_S,
        )
        yield from _calibration_families(stats, self._calibration_on)
        yield from _job_families(jobs)


def _calibration_families(stats: RequestStats, calibration_on: bool) -> Iterable[Metric]:
    ratio = GaugeMetricFamily(
        "sidequest_calibration_ratio",
        "Calibration ratio in use (provider / estimate, clamped 0.5-2.0; 1.0 below 5 samples "
        "or with SIDEQUEST_CALIBRATION=off)",
        labels=["provider", "model"],
    )
    samples = GaugeMetricFamily(
        "sidequest_calibration_samples", "Calibration samples recorded", labels=["provider", "model"]
    )
    for provider, model, count, estimate_sum, provider_sum in stats.calibration:
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
        stats.drift,
        DRIFT_BUCKETS,
    )


def _job_families(jobs: JobStats) -> Iterable[Metric]:
    """Background summary jobs (SPEC §6.6): by kind and outcome, their calls and tokens."""
    yield _gauge(
        "sidequest_background_jobs",
        "Background summary jobs by kind and status",
        ("kind", "status"),
        jobs.by_outcome,
    )
    yield _gauge(
        "sidequest_background_calls",
        "Provider calls of background jobs by kind and call status",
        ("kind", "status"),
        jobs.calls,
    )
    yield _gauge(
        "sidequest_background_tokens",
        "Tokens reported for background jobs' calls by kind and direction",
        ("kind", "direction"),
        jobs.tokens,
    )
