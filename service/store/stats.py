"""Deployment-wide numbers for ``/metrics``, read at scrape time (no tenant data leaves here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession

from service.store import queries


@dataclass
class RequestStats:
    """Stored (not cleared) requests by status and error code, their provider calls and latencies."""

    by_status: list[tuple[str, str, int]] = field(default_factory=list)
    calls: list[tuple[str, str, int]] = field(default_factory=list)
    latencies: list[tuple[str, float]] = field(default_factory=list)
    # (model, provider prompt tokens / estimate) of each answered request.
    drift: list[tuple[str, float]] = field(default_factory=list)
    # (provider, model, samples, Σ estimate, Σ provider) calibration counters.
    calibration: list[tuple[str, str, int, int, int]] = field(default_factory=list)


async def read_request_stats(tx: AsyncSession) -> RequestStats:
    return RequestStats(
        by_status=[(r.status, r.code, int(r.n)) for r in await tx.execute(queries.requests_by_status)],
        calls=[(r.purpose, r.status, int(r.n)) for r in await tx.execute(queries.request_calls)],
        latencies=[(r.purpose, float(r.seconds)) for r in await tx.execute(queries.request_call_latencies)],
        drift=[(r.model, float(r.ratio)) for r in await tx.execute(queries.answer_drift)],
        calibration=[
            (r.provider, r.model, int(r.samples), int(r.sum_estimate), int(r.sum_provider))
            for r in await tx.execute(queries.all_calibrations)
        ],
    )


@dataclass(frozen=True)
class JobStats:
    """``/metrics``: background jobs by kind and outcome, their calls and tokens."""

    by_outcome: list[tuple[str, str, int]]
    calls: list[tuple[str, str, int]]
    tokens: list[tuple[str, str, int]]


async def read_job_stats(tx: AsyncSession) -> JobStats:
    return JobStats(
        by_outcome=[(r.kind, r.status, int(r.n)) for r in await tx.execute(queries.job_outcomes)],
        calls=[(r.kind, r.status, int(r.n)) for r in await tx.execute(queries.job_calls)],
        tokens=[(r.kind, r.direction, int(r.n)) for r in await tx.execute(queries.job_tokens)],
    )
