"""The archive format (SPEC §10, docs/archive.md) as one pydantic model, version 3: it validates every
restore (older versions are upgraded to it first) and makes the archives' JSON Schemas.

What PostgreSQL keeps as JSON (usage, error, context_info, memory, hand-off bodies) is only checked for
what the service relies on, with every other key allowed: the parser stores the archive's own objects,
not the model's. Text PostgreSQL cannot store is found by one walk over the whole document (the
codec's), so the string types here only say so in the schema.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    Strict,
    StrictBool,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from service.vocabulary import (
    CONTEXT_WINDOW_MAX,
    CONTEXT_WINDOW_MIN,
    MAX_MODEL_CHARS,
    MAX_PARENT_ID_CHARS,
    MAX_SNAPSHOT_ID_CHARS,
    MAX_SUMMARY_INSTRUCTIONS_BYTES,
    OUTPUT_CAP_MAX,
    OUTPUT_CAP_MIN,
    UNSTORABLE_TEXT,
    OnBusy,
    Status,
    unstorable_reason,
)

NO_NUL_PATTERN: Final = "^[^\\u0000]*$"
NO_NUL: Final[dict[str, Any]] = {"pattern": NO_NUL_PATTERN}
# The recursive NUL-free JSON definitions (schema.storable_json_defs), under a key pydantic leaves
# alone: where they live (a standalone schema's $defs, the OpenAPI components) is known only later.
STORABLE_REF: Final = "x-storable"
STORABLE_JSON_NAME: Final = "StorableJson"
STORABLE_OBJECT_NAME: Final = "StorableObject"
STORABLE_JSON: Final = {STORABLE_REF: STORABLE_JSON_NAME}
STORABLE_OBJECT: Final = {STORABLE_REF: STORABLE_OBJECT_NAME}
_OPEN: Final[dict[str, Any]] = {"propertyNames": NO_NUL, "additionalProperties": STORABLE_JSON}

# Column limits: a longer value must be a 422, never a database error (500).
MAX_ORDINAL: Final = 2_147_483_646  # int4, and next_ordinal = highest + 1 must fit too
# The request fields of each version, in the order an export writes them.
V1_QUESTION_FIELDS: Final = ("ordinal", "question", "answer", "created_at")
V2_QUESTION_FIELDS: Final = (
    *V1_QUESTION_FIELDS,
    *("status", "error", "usage", "model", "started_at", "finished_at", "snapshot_id", "truncated"),
    "stop_reason",
)
QUESTION_FIELDS: Final = {
    1: V1_QUESTION_FIELDS,
    2: V2_QUESTION_FIELDS,
    3: (*V2_QUESTION_FIELDS, "context_info", "pinned"),
}
TIMESTAMP_NOTE: Final = (
    "ISO 8601 / RFC 3339 with a time zone; exports write UTC with microseconds, "
    "e.g. 2026-11-29T10:00:00.123456Z"
)


def _integral(value: object) -> object:
    # JSON Schema counts 5.0 as the integer 5; pydantic's strict int would refuse it.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def absent(**kwargs: Any) -> Any:
    """A field that may be left out (None then; ``model_fields_set`` tells) and has no schema default."""
    return Field(default_factory=lambda: None, **kwargs)


StrictInt = Annotated[int, Strict(), BeforeValidator(_integral)]
Text = Annotated[str, Strict(), Field(json_schema_extra=NO_NUL)]
NonEmptyText = Annotated[Text, Field(min_length=1)]
ParentId = Annotated[Text, Field(min_length=1, max_length=MAX_PARENT_ID_CHARS)]
ModelName = Annotated[Text, Field(max_length=MAX_MODEL_CHARS)]
SnapshotId = Annotated[Text, Field(max_length=MAX_SNAPSHOT_ID_CHARS)]
StopReason = Annotated[Text, Field(max_length=60)]
Counter = Annotated[int, Field(ge=0), Strict(), BeforeValidator(_integral)]
# The bounds go before the validator, so that the schema carries them as minimum and maximum.
Ordinal = Annotated[int, Field(ge=1, le=MAX_ORDINAL), Strict(), BeforeValidator(_integral)]
Through = Annotated[int, Field(ge=0, le=MAX_ORDINAL), Strict(), BeforeValidator(_integral)]
StorableObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object", **_OPEN})]
ObjectOrNull = Annotated[
    dict[str, Any] | None, WithJsonSchema({"anyOf": [STORABLE_OBJECT, {"type": "null"}]})
]


# RFC 3339 (JSON Schema's "date-time"): a full date and time with seconds and an offset.
_RFC3339: Final = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:(\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)")


def _timestamp(value: object) -> datetime:
    """An RFC 3339 timestamp as an aware UTC datetime (docs/archive.md). pydantic's own datetime takes
    one without a zone (read as the server's) and refuses a leap second, so the archive reads its own."""
    if not isinstance(value, str):
        raise ValueError("must be an RFC 3339 timestamp string")
    text = value.upper()
    if (match := _RFC3339.fullmatch(text)) is None:
        raise ValueError("must be an RFC 3339 timestamp with seconds and a zone, e.g. 2026-11-29T10:00:00Z")
    leap = match.group(1) == "60"
    try:
        moment = datetime.fromisoformat(
            text[: match.start(1)] + "59" + text[match.end(1) :] if leap else text
        )
        return (moment + timedelta(seconds=1) if leap else moment).astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:59:60Z, or 0001-01-01T00:00:00+12:00 in UTC
        raise ValueError("is out of range once read as UTC") from None


Timestamp = Annotated[
    datetime, PlainValidator(_timestamp), WithJsonSchema({"type": "string", "format": "date-time"})
]


class _Open(BaseModel):
    """A JSON object PostgreSQL keeps as the archive has it: any other key is allowed (and stored)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_OPEN)


class Call(_Open):
    purpose: Text = absent()
    model: Text | None = absent()
    status: Text = absent()
    reported: StrictBool = absent()
    input_tokens: Counter = absent()
    output_tokens: Counter = absent()
    reasoning_tokens: Counter = absent()
    cached_tokens: Counter = absent()


class Usage(_Open):
    input_tokens: Counter = absent()
    output_tokens: Counter = absent()
    reasoning_tokens: Counter = absent()
    cached_tokens: Counter = absent()
    calls: list[Call] = absent()


class Error(_Open):
    code: Text
    message: Text
    detail: ObjectOrNull = absent()


class ContextSummary(_Open):
    key: NonEmptyText


class Memory(_Open):
    qa_summary: ObjectOrNull = Field(None, description="the rolling Q&A summary (document and provenance)")
    context_summaries: list[ContextSummary] = Field(
        [], description="the context-summary cache, keyed by the content hash of the summarised prefix"
    )


class HandoffMessage(_Open):
    role: Literal["user"] = absent()
    content: Text = absent()


def _not_archived(value: object) -> object:
    # A hand-off's ids are its session's: restore gives it fresh ones.
    raise ValueError("is not archived (restore gives hand-offs fresh ids)")


def _handoff_schema(schema: dict[str, Any]) -> None:
    schema.update(_OPEN, description="a hand-off (SPEC §11.1) without its id and parent_id")
    for key in ("id", "parent_id"):
        schema["properties"].pop(key)
    schema["not"] = {"anyOf": [{"required": ["id"]}, {"required": ["parent_id"]}]}


class Handoff(_Open):
    model_config = ConfigDict(json_schema_extra=_handoff_schema)
    created_at: Timestamp
    format: Literal["anthropic", "openai", "text"]
    ordinals: Annotated[list[StrictInt], Field(min_length=1)]
    from_ordinal: StrictInt | None = absent()
    through_ordinal: StrictInt | None = absent()
    estimate_tokens: StrictInt = absent()
    summarized_ordinals: list[StrictInt] = absent()
    shortened_ordinals: list[StrictInt] = absent()
    omitted_ordinals: list[StrictInt] = absent()
    truncated: StrictBool = absent()
    message: HandoffMessage | None = absent()
    text: Text
    id: Annotated[Any, PlainValidator(_not_archived)] = absent()
    parent_id: Annotated[Any, PlainValidator(_not_archived)] = absent()


def _json_number(value: Any) -> Any:
    """A number as JSON writes one: pydantic's lax mode would read ``"5000"`` and ``true`` as integers
    (and an inline snapshot's own fields are then used as posted, as strings: ignored)."""
    if isinstance(value, str | bool):
        raise ValueError("must be a JSON number, not a string or a boolean")
    return value


# An integer field of a request body: a JSON integer, 4096.0 too (JSON Schema counts it as one).
JsonInt = Annotated[int, BeforeValidator(_json_number)]


def check_text(value: str) -> str:
    """Refuse text PostgreSQL cannot store (NUL, lone surrogate) as an input error, up front: it
    would otherwise fail deep in the driver. A pydantic validator; the message is the vocabulary's."""
    if unstorable_reason(value) is not None:
        raise ValueError(UNSTORABLE_TEXT)
    return value


def check_optional_text(value: str | None) -> str | None:
    return None if value is None else check_text(value)


# A model a client asks for (a question's, a session setting's): lax str, as the API reads it.
RequestedModelName = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_CHARS, json_schema_extra=NO_NUL)]


class SessionSettingsIn(BaseModel):
    """PUT body: only the fields it names change; `null` clears a field."""

    # The one rule of a session's settings (SPEC §11.2): a PUT's body and an archive's settings
    # (restore) are this model, so an archive cannot bring what a PUT would refuse.
    model_config = ConfigDict(extra="forbid")

    summary_instructions: str | None = Field(
        default=None,
        max_length=MAX_SUMMARY_INSTRUCTIONS_BYTES,  # characters; the byte limit is checked below
        description="At most 4 KiB of UTF-8 (4096 bytes); added after the built-in summary instructions "
        "of every summary call of the session (never replacing them).",
        json_schema_extra=NO_NUL,
    )
    summary_model: RequestedModelName | None = Field(default=None, description="Model for summary calls.")
    answer_model: RequestedModelName | None = Field(
        default=None, description="Model for answers (a request's own wins)."
    )
    context_window: Annotated[JsonInt, Field(ge=CONTEXT_WINDOW_MIN, le=CONTEXT_WINDOW_MAX)] | None = Field(
        default=None, description="Session default window, below a request's own value."
    )
    max_output_tokens: Annotated[JsonInt, Field(ge=OUTPUT_CAP_MIN, le=OUTPUT_CAP_MAX)] | None = Field(
        default=None, description="Session default side output cap, below a request's own value."
    )
    on_busy: OnBusy | None = Field(
        default=None, description="What a new question does while the session has queued or running ones."
    )
    mask_tool_results: StrictBool | None = Field(
        default=None,
        description="SPEC §6.8: elide old tool payloads before summarising (null: the default, true); "
        "false: summarise the old messages as they are.",
    )

    _texts = field_validator("summary_instructions", "summary_model", "answer_model")(check_optional_text)

    @field_validator("summary_instructions")
    @classmethod
    def _instructions_size(cls, value: str | None) -> str | None:
        size = len(value.encode("utf-8")) if value is not None else 0
        if size > MAX_SUMMARY_INSTRUCTIONS_BYTES:
            raise ValueError(
                f"is {size} bytes of UTF-8; "
                f"at most {MAX_SUMMARY_INSTRUCTIONS_BYTES} bytes (4 KiB) are allowed"
            )
        return value


SETTINGS_FIELDS: Final = tuple(SessionSettingsIn.model_fields)


def public_settings(stored: dict[str, Any]) -> dict[str, Any]:
    """The whole settings object (SPEC §11.2) of the session's, or an archive's, stored settings:
    every field, ``null`` when unset (unknown stored keys are dropped)."""
    return {name: stored.get(name) for name in SETTINGS_FIELDS}


class Session(BaseModel):
    model_config = ConfigDict(extra="forbid")
    memory: Memory = absent(description="the session's memory; missing parts are empty, other keys are kept")
    handoffs: list[Handoff] = Field([], description="the session's hand-offs, oldest first; missing → none")
    handed_off_through: Through = Field(0, description="highest ordinal handed off (SPEC §11.1); missing → 0")
    settings: SessionSettingsIn = absent(
        description="the session's settings (SPEC §11.2); missing → the session keeps its own"
    )


def _question_schema(schema: dict[str, Any]) -> None:
    # The fields are in the order they are validated (status before the answer and pin it decides
    # about); the schema lists the required ones in SPEC's order.
    schema["required"] = ["ordinal", "question", "answer", "created_at"]
    schema["allOf"] = [
        {
            "if": {"properties": {"status": {"const": "succeeded"}}},
            "then": {"properties": {"answer": {"type": "string"}}},
        },
        {
            "if": {"properties": {"status": {"enum": ["failed", "cancelled"]}}, "required": ["status"]},
            "then": {"properties": {"pinned": {"const": False}}},
        },
    ]


class Question(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_question_schema)
    ordinal: Ordinal = Field(
        description="identifies the request within its session; kept by restore; unique in an archive"
    )
    question: NonEmptyText
    created_at: Timestamp = Field(description=TIMESTAMP_NOTE)
    status: Literal["succeeded", "failed", "cancelled"] = Field(
        "succeeded", description="archives hold finished requests only"
    )
    answer: Text | None = Field(description="required text when status is succeeded")
    error: Error | None = None
    usage: Usage = absent(description="cumulative usage (SPEC §3); missing → zeros and no calls")
    model: ModelName | None = absent()
    snapshot_id: SnapshotId | None = absent(
        description="a reference only: archives carry no snapshot content"
    )
    stop_reason: StopReason | None = absent()
    truncated: StrictBool = False
    started_at: Timestamp | None = absent(description=TIMESTAMP_NOTE)
    finished_at: Timestamp | None = absent(description=TIMESTAMP_NOTE)
    context_info: StorableObject = Field(
        {}, description="the request's budget report (SPEC §3 context_info); missing → {}"
    )
    pinned: StrictBool = Field(
        False,
        description="pinned for the next hand-off (SPEC §11.1), succeeded requests only; missing → false",
    )

    @field_validator("answer")
    @classmethod
    def _succeeded_has_answer(cls, answer: str | None, info: ValidationInfo) -> str | None:
        if answer is None and info.data.get("status") == Status.SUCCEEDED:
            raise ValueError("a succeeded request has an answer")
        return answer

    @field_validator("pinned")
    @classmethod
    def _only_succeeded_is_pinned(cls, pinned: bool, info: ValidationInfo) -> bool:
        # SPEC §11.1 refuses to pin another (409 not_pinnable), so no export has one; restored, the
        # pin would be dropped instead of written back as the archive says.
        if pinned and info.data.get("status", Status.SUCCEEDED) != Status.SUCCEEDED:
            raise ValueError("only a succeeded request can be pinned")
        return pinned


class ArchiveV3(BaseModel):
    """A version 3 archive: older ones are upgraded to it before they are validated."""

    model_config = ConfigDict(extra="forbid", title="Sidequest side-question archive, version 3")
    version: Literal[3]
    parent_id: ParentId = Field(
        description="the session it was exported from; restore uses the parent id of its URL"
    )
    exported_at: Timestamp = absent(
        description="when the archive was written (informational; ignored by restore)"
    )
    session: Session = Field(
        default_factory=lambda: Session.model_validate({}), description="missing → empty memory"
    )
    questions: list[Question] = Field(description="finished requests in ascending ordinal")
