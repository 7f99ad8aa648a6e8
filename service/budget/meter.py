"""Segment meter, pressure and drift (SPEC §5, ``context_info.estimate`` / ``pressure`` / ``drift``).

The estimate is kept per segment and never back-filled from the provider's reported total: the
provider's prompt tokens are reported beside it (:func:`prompt_drift`), so a wrong estimator shows
up as drift instead of disappearing into a corrected number.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Final

PRESSURE_NORMAL: Final = "normal"
PRESSURE_TIGHT: Final = "tight"
PRESSURE_CRITICAL: Final = "critical"

# Reaching a threshold enters it (docs/budget.md "The numbers").
TIGHT_PERCENT: Final = 75
CRITICAL_PERCENT: Final = 90


@dataclass(frozen=True)
class SegmentEstimate:
    """Estimated tokens per prompt segment (SPEC ``context_info.estimate``): ``context`` the main
    snapshot's messages (or its summary plus kept messages), ``qa_summary`` the rolling Q&A summary,
    ``qa_raw`` the replayed Q&A, ``question`` the final turn's own text, ``envelope`` every message's
    overhead; contents are counted without envelope, so no token is counted twice."""

    system: int = 0
    tools: int = 0
    context: int = 0
    qa_summary: int = 0
    qa_raw: int = 0
    question: int = 0
    envelope: int = 0

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def as_dict(self) -> dict[str, int]:
        """The segments plus ``"total"``, as SPEC ``context_info.estimate``."""
        return {**asdict(self), "total": self.total}


def pressure(total: int, input_budget: int | None) -> str:
    """``normal``, ``tight`` (≥ 75 % of the budget) or ``critical`` (≥ 90 %), in integer arithmetic (no
    float rounding at the edges); with an unknown or non-positive budget nothing is fine: ``critical``."""
    if input_budget is None or input_budget <= 0:
        return PRESSURE_CRITICAL
    scaled = total * 100
    if scaled >= input_budget * CRITICAL_PERCENT:
        return PRESSURE_CRITICAL
    if scaled >= input_budget * TIGHT_PERCENT:
        return PRESSURE_TIGHT
    return PRESSURE_NORMAL


def prompt_drift(estimated_total: int, provider_prompt_tokens: int | None) -> int | None:
    """Provider prompt tokens minus our estimate (positive: we estimated too low); None when the
    provider reported nothing (unreported usage is recorded as 0, not a huge over-estimate)."""
    if provider_prompt_tokens is None or provider_prompt_tokens <= 0:
        return None
    return provider_prompt_tokens - estimated_total
