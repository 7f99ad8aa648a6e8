"""Pydantic models for every request and response body of SPEC §3 (they also make /openapi.json). Response
models are deliberately permissive where the worker owns the content (usage calls, context_info, error
detail): every SPEC field is described, extra fields are allowed, so a newer worker never turns a read into
a 500."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
)
from typing_extensions import TypedDict

from service.archive.model import (
    NO_NUL,
    STORABLE_JSON_NAME,
    STORABLE_OBJECT_NAME,
    JsonInt,
    RequestedModelName,
    check_optional_text,
    check_text,
)
from service.archive.schema import OPENAPI_REFS
from service.budget.handoff import HANDOFF_MAX_TOKENS, HANDOFF_MIN_TOKENS
from service.context_info import ContextInfo
from service.vocabulary import (
    CONTEXT_WINDOW_MAX,
    CONTEXT_WINDOW_MIN,
    MAX_SNAPSHOT_ID_CHARS,
    OUTPUT_CAP_MAX,
    OUTPUT_CAP_MIN,
    OnBusy,
    Status,
)

Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]
MAX_INT32 = 2**31 - 1  # PostgreSQL's integer: ordinals, seqs

# Open JSON (content blocks, tool schemas, extra keys) without NUL at any depth: the recursive
# definitions live in the OpenAPI components (service/archive/schema.py: storable_json_defs; the app
# adds them), so the schema says what the snapshot routes refuse (422 invalid_snapshot).
_STORABLE_JSON: dict[str, Any] = {"$ref": OPENAPI_REFS + STORABLE_JSON_NAME}
_STORABLE_OBJECT: dict[str, Any] = {"$ref": OPENAPI_REFS + STORABLE_OBJECT_NAME}
_OPEN_NO_NUL: dict[str, Any] = {"propertyNames": NO_NUL, "additionalProperties": _STORABLE_JSON}
NulFreeText = Annotated[str, Field(json_schema_extra=NO_NUL)]
SnapshotId = Annotated[str, Field(min_length=1, max_length=MAX_SNAPSHOT_ID_CHARS, json_schema_extra=NO_NUL)]
NulFreeObject = Annotated[dict[str, Any], WithJsonSchema(_STORABLE_OBJECT)]


# The snapshot's items are TypedDicts, not models: pydantic validates them the same way and the schema
# is the same, but builds no model instance per message — the body of a 1600-message inline snapshot
# validated in 17 ms as models, 2 ms like this (the route only reads the parsed JSON).
class SnapshotTool(TypedDict):
    """A tool schema of the main session (Anthropic style; OpenAI function tools accepted too)."""

    __pydantic_config__ = ConfigDict(extra="allow", json_schema_extra=_OPEN_NO_NUL)  # type: ignore[misc]

    name: NotRequired[NulFreeText | None]
    description: NotRequired[NulFreeText | None]
    input_schema: NotRequired[NulFreeObject | None]


class SnapshotMessage(TypedDict):
    """One message of the main session, Anthropic or OpenAI style."""

    __pydantic_config__ = ConfigDict(extra="allow", json_schema_extra=_OPEN_NO_NUL)  # type: ignore[misc]

    role: NulFreeText
    content: NotRequired[NulFreeText | list[NulFreeObject] | None]


class Snapshot(BaseModel):
    """The main session's context (never modified by Sidequest)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_OPEN_NO_NUL)

    snapshot_id: SnapshotId | None = Field(
        default=None, description="Store the inline snapshot under this id (default: its content hash)."
    )
    taken_at: NulFreeText | None = None
    system: NulFreeText | list[NulFreeObject] | None = None
    tools: list[SnapshotTool] | None = None
    messages: list[SnapshotMessage] = Field(default_factory=list)
    context_window: Annotated[JsonInt, Field(ge=1, le=100_000_000)] | None = None
    max_output_tokens: Annotated[JsonInt, Field(ge=1, le=100_000_000)] | None = None

    _text = field_validator("snapshot_id")(check_optional_text)


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
    snapshot_id: SnapshotId | None = None
    snapshot: Snapshot | None = None
    model: RequestedModelName | None = None
    context_window: Annotated[JsonInt, Field(ge=CONTEXT_WINDOW_MIN, le=CONTEXT_WINDOW_MAX)] | None = None
    max_output_tokens: Annotated[JsonInt, Field(ge=OUTPUT_CAP_MIN, le=OUTPUT_CAP_MAX)] | None = None
    main_max_output_tokens: Annotated[JsonInt, Field(ge=1, le=10_000_000)] | None = None
    on_busy: OnBusy | None = Field(
        default=None,
        description="While the session has queued or running requests (SPEC 11.2): enqueue behind "
        "them, reject (409 session_busy), or interrupt (cancel them, code superseded). "
        "Default: the session's setting, else enqueue.",
    )

    _question = field_validator("question")(check_text)
    _texts = field_validator("snapshot_id", "model")(check_optional_text)


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


class RequestRecord(BaseModel):
    """One side request."""

    id: str = Field(json_schema_extra={"format": "uuid"})
    parent_id: str
    ordinal: int
    question: str
    status: Literal[Status.QUEUED, Status.RUNNING, Status.SUCCEEDED, Status.FAILED, Status.CANCELLED]
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


# ---------------------------------------------------------------- settings and hand-offs (SPEC §11)


class SessionSettingsOut(BaseModel):
    """The whole settings object; unset fields are null."""

    summary_instructions: str | None
    summary_model: str | None
    answer_model: str | None
    context_window: int | None
    max_output_tokens: int | None
    on_busy: OnBusy | None
    mask_tool_results: bool | None


class HandoffIn(BaseModel):
    """POST body of a hand-off; every field optional."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["anthropic", "openai", "text"] = Field(
        default="anthropic",
        description="`anthropic` / `openai`: `message` is set; `text`: `message` is null.",
    )
    max_tokens: Annotated[JsonInt, Field(ge=HANDOFF_MIN_TOKENS, le=HANDOFF_MAX_TOKENS)] = Field(
        default=2000, description="The block's SPEC §5 estimate stays within this."
    )
    include: Literal["new", "all"] = Field(
        default="new",
        description="`new`: succeeded Q&A above `handed_off_through` plus pinned ones; "
        "`all`: every succeeded one.",
    )
    ordinals: (
        Annotated[list[Annotated[JsonInt, Field(ge=1, le=MAX_INT32)]], Field(min_length=1, max_length=1000)]
        | None
    ) = Field(
        default=None,
        description="Exactly these (each a succeeded request of the session); wins over `include`.",
    )


class HandoffMessage(BaseModel):
    """The block as one user message, ready to append to the main conversation."""

    role: Literal["user"]
    content: str


class Handoff(BaseModel):
    """A hand-off (SPEC §11.1). `id` is null when there was nothing to hand off (nothing recorded)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = Field(json_schema_extra={"format": "uuid"})
    parent_id: str
    created_at: Timestamp
    format: Literal["anthropic", "openai", "text"]
    ordinals: list[int] = Field(description="The Q&A the block carries, ascending.")
    from_ordinal: int | None
    through_ordinal: int | None
    estimate_tokens: int
    summarized_ordinals: list[int] = Field(description="Carried by the rolling Q&A summary, not verbatim.")
    shortened_ordinals: list[int] = Field(default_factory=list, description="Question or answer cut to fit.")
    omitted_ordinals: list[int] = Field(
        default_factory=list, description="Left out entirely to fit (not carried, still pinned if they were)."
    )
    truncated: bool
    message: HandoffMessage | None
    text: str


class HandoffPage(BaseModel):
    """A page of hand-offs, newest first."""

    items: list[Handoff]
    has_more: bool
    next_before: str | None = Field(description="Pass as `before` for the next (older) page; null when none.")


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

    first_ordinal: int | None = Field(
        default=None, description="First ordinal it covers (ordinals go on counting after a clear)."
    )
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


class BackgroundOverview(BaseModel):
    """Background summary jobs of the session (SPEC §6.6) and the usage of all their calls."""

    jobs: Counts
    usage: Usage


class SessionOut(BaseModel):
    """A session."""

    parent_id: str
    clear_version: int
    next_ordinal: int
    handed_off_through: int = Field(description="Highest ordinal handed off (SPEC §11.1); 0 after a clear.")
    settings: SessionSettingsOut
    counts: Counts
    background: BackgroundOverview
    memory: MemoryOverview
    created_at: Timestamp
    updated_at: Timestamp


class SessionPage(BaseModel):
    """A page of the tenant's sessions, most recently active first."""

    items: list[SessionOut]
    has_more: bool
    next_before: str | None


class Cleared(BaseModel):
    """The result of a clear."""

    parent_id: str
    clear_version: int
    next_ordinal: int
    cleared_requests: int
    cancelled_requests: int


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
