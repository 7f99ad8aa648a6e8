"""``context_info`` (SPEC §3): what went into a side answer, as one typed model.

The pipeline fills it in as the request is prepared (and stores it with every stage change), the API
describes records with it (OpenAPI), and archives carry it. One model, so a field added for one of
them is there for all three. Every field has a default: a record that was never prepared has ``{}``.
Extra keys are allowed, so an older or newer worker's metadata never turns a read into a 500.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.vocabulary import Stage

MadeBy = Literal["request", "background"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class EstimateInfo(_Open):
    """The estimate per segment (SPEC §5), never back-filled from the provider's count."""

    system: int = 0
    tools: int = 0
    context: int = 0
    qa_summary: int = 0
    qa_raw: int = 0
    question: int = 0
    envelope: int = 0
    total: int = 0


class QASummaryInfo(_Open):
    """The rolling Q&A summary this request used."""

    used: bool = False
    # The first ordinal the summary covers (extra field): after a clear, ordinals go on counting, so
    # a summary made since covers #first–#through, not #1–#through.
    first_ordinal: int | None = None
    covered_through_ordinal: int | None = None
    updated: bool = False
    calls: int = 0
    made_by: MadeBy | None = Field(
        default=None, description="Who made the summary used: a request (this or an earlier) or a job."
    )
    waited_ms: int = Field(default=0, description="Time spent waiting for a background job.")


class ContextSummaryInfo(_Open):
    """The context summary (compacted main context) this request used."""

    used: bool = False
    cache: Literal["hit", "prefix", "miss", "none"] = "none"
    summarized_messages: int = 0
    kept_messages: int = 0
    calls: int = 0
    chunks: int = Field(default=0, description="Material chunks (a merge call is a call, not a chunk).")
    made_by: MadeBy | None = None
    waited_ms: int = 0


class CalibrationInfo(_Open):
    """The estimator's calibration as it stood when the request was prepared (SPEC §5.1)."""

    ratio: float = 1.0
    samples: int = 0
    applied: bool = False


class ArtifactsInfo(_Open):
    """The snapshot's distinct artifacts (SPEC §6.8: what a person names a tool call by)."""

    total: int = 0
    in_prompt: int = Field(default=0, description="Those whose text the answer request carries.")


class FidelityInfo(_Open):
    """What of the snapshot reached the model (SPEC §6.10)."""

    tier: Literal["none", "masked", "summary"] = "none"
    verbatim_messages: int = 0
    masked_messages: int = 0
    masked_payload_bytes: int = 0
    summarized_messages: int = 0
    artifacts: ArtifactsInfo = Field(default_factory=ArtifactsInfo)


class ContextInfo(_Open):
    """Budget metadata of a request (SPEC §3)."""

    stage: str | None = None
    window: int | None = None
    max_output_tokens: int | None = None
    safety_margin: int | None = None
    input_budget: int | None = None
    estimate: EstimateInfo | None = None
    pressure: Literal["normal", "tight", "critical"] | None = None
    replayed_groups: int | None = None
    replayed_ordinals: list[int] | None = None
    qa_summary: QASummaryInfo | None = None
    context_summary: ContextSummaryInfo | None = None
    summary_calls: int | None = None
    overflow_retries: int | None = None
    provider_prompt_tokens: int | None = None
    drift: int | float | None = None
    calibration: CalibrationInfo | None = None
    fidelity: FidelityInfo | None = None
    attempt: int | None = None

    @classmethod
    def starting(cls, attempt: int) -> ContextInfo:
        """The metadata of a request a worker just claimed."""
        return cls(
            stage=Stage.PREPARING,
            replayed_groups=0,
            qa_summary=QASummaryInfo(),
            context_summary=ContextSummaryInfo(),
            summary_calls=0,
            overflow_retries=0,
            attempt=attempt,
        )

    def to_json(self) -> dict[str, Any]:
        """The stored / wire form (every declared field, extras kept)."""
        return self.model_dump(mode="json")
