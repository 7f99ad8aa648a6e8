"""Pydantic models for every request and response body of SPEC §3 (they also make /openapi.json).

Response models are deliberately permissive where the worker owns the content (usage calls,
context_info, error detail): every SPEC field is described, extra fields are allowed, so a newer
worker never turns a read into a 500.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from service.config import OUTPUT_CAP_MAX, OUTPUT_CAP_MIN
from service.store.archive import NO_NUL_PATTERN, OPENAPI_REFS, STORABLE_JSON, STORABLE_OBJECT

Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]

# PostgreSQL text cannot hold NUL, and a lone surrogate cannot be encoded as UTF-8: both would
# otherwise fail deep in the driver, so they are refused as input errors up front.
_FORBIDDEN = "NUL characters and unpaired surrogates are not allowed"
NO_NUL: dict[str, Any] = {"pattern": NO_NUL_PATTERN}
# Open JSON (content blocks, tool schemas, extra keys) without NUL at any depth: the recursive
# definitions live in the OpenAPI components (service/store/archive.py: storable_json_defs; the app
# adds them), so the schema says what the snapshot routes refuse (422 invalid_snapshot).
_STORABLE_JSON: dict[str, Any] = {"$ref": OPENAPI_REFS + STORABLE_JSON}
_STORABLE_OBJECT: dict[str, Any] = {"$ref": OPENAPI_REFS + STORABLE_OBJECT}
_OPEN_NO_NUL: dict[str, Any] = {"propertyNames": NO_NUL, "additionalProperties": _STORABLE_JSON}
NulFreeText = Annotated[str, Field(json_schema_extra=NO_NUL)]
NulFreeObject = Annotated[dict[str, Any], WithJsonSchema(_STORABLE_OBJECT)]


def check_text(value: str) -> str:
    """Refuse text PostgreSQL cannot store."""
    if "\x00" in value:
        raise ValueError(_FORBIDDEN)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(_FORBIDDEN) from None
    return value


def _check_optional_text(value: str | None) -> str | None:
    return None if value is None else check_text(value)


# ---------------------------------------------------------------- snapshots


class SnapshotTool(BaseModel):
    """A tool schema of the main session (Anthropic style; OpenAI function tools accepted too)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_OPEN_NO_NUL)

    name: NulFreeText | None = None
    description: NulFreeText | None = None
    input_schema: NulFreeObject | None = None


class SnapshotMessage(BaseModel):
    """One message of the main session, Anthropic or OpenAI style."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_OPEN_NO_NUL)

    role: NulFreeText
    content: NulFreeText | list[NulFreeObject] | None = None


class Snapshot(BaseModel):
    """The main session's context (never modified by Sidequest)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_OPEN_NO_NUL)

    snapshot_id: Annotated[str, Field(min_length=1, max_length=500, json_schema_extra=NO_NUL)] | None = Field(
        default=None, description="Store the inline snapshot under this id (default: its content hash)."
    )
    taken_at: NulFreeText | None = None
    system: NulFreeText | list[NulFreeObject] | None = None
    tools: list[SnapshotTool] | None = None
    messages: list[SnapshotMessage] = Field(default_factory=list)
    context_window: Annotated[int, Field(ge=1, le=100_000_000)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=100_000_000)] | None = None

    _text = field_validator("snapshot_id")(_check_optional_text)


class SnapshotStored(BaseModel):
    """A stored snapshot (never its content)."""

    snapshot_id: str
    content_hash: str = Field(description="SHA-256 of the key-sorted compact JSON.")
    token_estimate: int
    size_bytes: int
    created_at: Timestamp
    created: bool = Field(description="False when the same content was already stored under this id.")


# ---------------------------------------------------------------- questions


class QuestionIn(BaseModel):
    """POST body: a question with a snapshot reference, an inline snapshot, or neither."""

    # snapshot_id and snapshot exclude each other (an inline snapshot names itself).
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "not": {
                "required": ["snapshot_id", "snapshot"],
                "properties": {"snapshot_id": {"type": "string"}, "snapshot": {"type": "object"}},
            }
        },
    )

    question: str = Field(
        min_length=1, description="At most 64 KiB of UTF-8 (65536 bytes).", json_schema_extra=NO_NUL
    )
    snapshot_id: Annotated[str, Field(min_length=1, max_length=500, json_schema_extra=NO_NUL)] | None = None
    snapshot: Snapshot | None = None
    model: Annotated[str, Field(min_length=1, max_length=200, json_schema_extra=NO_NUL)] | None = None
    context_window: Annotated[int, Field(ge=1024, le=10_000_000)] | None = None
    max_output_tokens: Annotated[int, Field(ge=OUTPUT_CAP_MIN, le=OUTPUT_CAP_MAX)] | None = None
    main_max_output_tokens: Annotated[int, Field(ge=1, le=10_000_000)] | None = None

    _question = field_validator("question")(check_text)
    _texts = field_validator("snapshot_id", "model")(_check_optional_text)


class ErrorInfo(BaseModel):
    """A request's error (SPEC §8 codes)."""

    model_config = ConfigDict(extra="allow")

    code: str
    message: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


class UsageCall(BaseModel):
    """One provider call's usage."""

    model_config = ConfigDict(extra="allow")

    purpose: str | None = None
    model: str | None = None
    status: str | None = Field(default=None, description="ok | failed | cancelled")
    reported: bool | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None
    cached_tokens: int | None = None


class Usage(BaseModel):
    """Cumulative usage of a request, every provider call included."""

    model_config = ConfigDict(extra="allow")

    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    calls: list[UsageCall] = Field(default_factory=list)


class ContextInfo(BaseModel):
    """Budget metadata of a request (SPEC §3); empty until a worker prepares it."""

    model_config = ConfigDict(extra="allow")

    stage: str | None = None
    window: int | None = None
    max_output_tokens: int | None = None
    safety_margin: int | None = None
    input_budget: int | None = None
    estimate: dict[str, Any] | None = None
    pressure: str | None = Field(default=None, description="normal | tight | critical")
    replayed_groups: int | None = None
    replayed_ordinals: list[int] | None = None
    qa_summary: dict[str, Any] | None = None
    context_summary: dict[str, Any] | None = None
    summary_calls: int | None = None
    overflow_retries: int | None = None
    provider_prompt_tokens: int | None = None
    drift: int | float | None = None


Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class RequestRecord(BaseModel):
    """One side request."""

    id: str = Field(json_schema_extra={"format": "uuid"})
    parent_id: str
    ordinal: int
    question: str
    status: Status
    stage: str | None
    answer: str | None
    truncated: bool
    stop_reason: str | None
    error: ErrorInfo | None
    usage: Usage
    context_info: ContextInfo
    model: str | None
    snapshot_id: str | None
    attempt: int
    clear_version: int
    created_at: Timestamp
    started_at: Timestamp | None
    finished_at: Timestamp | None
    pinned: bool = Field(default=False, description="Pinned for the next hand-off (SPEC §11.1).")


class HistoryPage(BaseModel):
    """A page of history in ascending ordinal."""

    items: list[RequestRecord]
    has_more: bool
    next_before: int | None = Field(description="Pass as `before` for the next (older) page; null when none.")


# ---------------------------------------------------------------- sessions


class Counts(BaseModel):
    """Visible requests by status."""

    queued: int
    running: int
    succeeded: int
    failed: int
    cancelled: int


class QaSummaryOverview(BaseModel):
    """Coverage of the rolling Q&A summary."""

    covered_through_ordinal: int | None
    tokens: int | None
    updated_at: str | None


class ContextSummaryOverview(BaseModel):
    """One cached context summary (keyed by the content hash of the summarised prefix)."""

    key: str | None
    snapshot_id: str | None
    covered_messages: int | None
    tokens: int | None
    created_at: str | None


class MemoryOverview(BaseModel):
    """What the session remembers, without the documents."""

    qa_summary: QaSummaryOverview | None
    context_summaries: list[ContextSummaryOverview]


class SessionOut(BaseModel):
    """A session."""

    parent_id: str
    clear_version: int
    next_ordinal: int
    counts: Counts
    memory: MemoryOverview
    created_at: Timestamp
    updated_at: Timestamp


class Cleared(BaseModel):
    """The result of a clear."""

    parent_id: str
    clear_version: int
    next_ordinal: int
    cleared_requests: int
    cancelled_requests: int


# ---------------------------------------------------------------- misc


class StreamToken(BaseModel):
    """A signed token for one event stream (use as `?token=` on `url`)."""

    token: str
    expires_at: Timestamp
    url: str


class ErrorDetail(BaseModel):
    """The inside of an error body."""

    code: str
    message: str
    detail: dict[str, Any]


class ErrorBody(BaseModel):
    """Every error: `{"error": {"code", "message", "detail"}}`."""

    error: ErrorDetail
