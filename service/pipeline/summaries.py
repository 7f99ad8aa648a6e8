"""The summary runner of a request: one per concurrent summary (a fold and a compaction may run at
once), all sharing the request's call budget, ledger, deadline and window numbers."""

from __future__ import annotations

from service.pipeline.prepare import Prepared
from service.pipeline.runtime import RequestRuntime
from service.summary.runner import SummaryRunner

# The material variant of a summary of masked groups (SPEC §6.8), part of its cache key: a change to the
# masking rules bumps it, so no summary of differently masked material is reused.
MASKED_MATERIAL = "masked-1"


def summary_runner(rt: RequestRuntime, prepared: Prepared) -> SummaryRunner:
    """A fresh runner (its own ``attempts_made``) on the request's shared budget and recorder; its
    context summaries are of masked material when the session masks tool results (SPEC §6.8)."""
    return SummaryRunner(
        provider=rt.deps.provider,
        model=prepared.models.summary,
        request_id=rt.request_id,
        recorder=rt.recorder,
        deadline=rt.deadline,
        budget=rt.budget,
        window=prepared.plan.window,
        safety_margin=prepared.plan.safety_margin,
        on_progress=rt.progress,
        clock=rt.deps.clock,
        parallelism=rt.deps.settings.summary_parallelism,
        instructions=prepared.summary_instructions,
        calibration=rt.summary_calibration,
        on_sample=rt.book.sample,
        material_variant=MASKED_MATERIAL if prepared.mask_tool_results else None,
    )
