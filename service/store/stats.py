"""Deployment-wide numbers for ``/metrics``, read at scrape time (no tenant data leaves here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

_STATUS_SQL = text(
    """
    SELECT status, COALESCE(error->>'code', '') AS code, count(*) AS n
    FROM side_question_requests WHERE deleted_at IS NULL GROUP BY 1, 2
    """
)

_CALLS_SQL = text(
    """
    SELECT COALESCE(c->>'purpose', '') AS purpose, COALESCE(c->>'status', '') AS status, count(*) AS n
    FROM side_question_requests r, jsonb_array_elements(COALESCE(r.usage->'calls', '[]'::jsonb)) c
    WHERE r.deleted_at IS NULL AND jsonb_typeof(c) = 'object'
    GROUP BY 1, 2
    """
)

_LATENCY_SQL = text(
    """
    SELECT COALESCE(c->>'purpose', '') AS purpose, (c->>'latency_ms')::float8 / 1000.0 AS seconds
    FROM side_question_requests r, jsonb_array_elements(COALESCE(r.usage->'calls', '[]'::jsonb)) c
    WHERE r.deleted_at IS NULL AND jsonb_typeof(c) = 'object'
      AND jsonb_typeof(c->'latency_ms') = 'number'
    """
)


# Drift of the answer call per stored request: provider prompt tokens / our estimate of what was sent
# (context_info.provider_prompt_tokens and estimate.total, written together by the pipeline).
_DRIFT_SQL = text(
    """
    SELECT COALESCE(r.model, '') AS model,
           (r.context_info->>'provider_prompt_tokens')::float8
             / (r.context_info->'estimate'->>'total')::float8 AS ratio
    FROM side_question_requests r
    WHERE r.deleted_at IS NULL
      AND jsonb_typeof(r.context_info->'provider_prompt_tokens') = 'number'
      AND jsonb_typeof(r.context_info->'estimate'->'total') = 'number'
      AND (r.context_info->'estimate'->>'total')::float8 > 0
    """
)

_CALIBRATION_SQL = text(
    "SELECT provider, model, samples, sum_estimate, sum_provider FROM sidequest_calibration ORDER BY 1, 2"
)


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


async def read_request_stats(session: AsyncSession) -> RequestStats:
    """Run the scrape queries."""
    return RequestStats(
        by_status=[(r.status, r.code, int(r.n)) for r in await session.execute(_STATUS_SQL)],
        calls=[(r.purpose, r.status, int(r.n)) for r in await session.execute(_CALLS_SQL)],
        latencies=[(r.purpose, float(r.seconds)) for r in await session.execute(_LATENCY_SQL)],
        drift=[(r.model, float(r.ratio)) for r in await session.execute(_DRIFT_SQL)],
        calibration=[
            (r.provider, r.model, int(r.samples), int(r.sum_estimate), int(r.sum_provider))
            for r in await session.execute(_CALIBRATION_SQL)
        ],
    )
