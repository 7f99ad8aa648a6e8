"""The archive versions as pydantic models (SPEC §10): they validate an archive on restore *and* are the
source of its JSON Schema (docs/archive/v*.schema.json, the archive bodies of /openapi.json).

Every model validates the raw document as the hand-written checker before them did (same problems,
locations, words and order); what PostgreSQL keeps as JSON (usage, error, memory, hand-off bodies) is
kept verbatim beside the validated model (``_raw``). The field types live in
:mod:`service.store.archive_fields`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Final, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PlainValidator,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import GenerateJsonSchema

from service.store.archive_fields import (
    ARCHIVE_VERSIONS,
    HANDOFF_FORMATS,
    NO_NUL,
    NO_NUL_PATTERN,
    OPENAPI_REFS,
    REF,
    STANDALONE_REFS,
    STORABLE,
    STORABLE_JSON,
    STORABLE_OBJECT,
    TIMESTAMP_NOTE,
    Answer,
    Counter,
    Finished,
    Flag,
    Loc,
    ModelName,
    NullableText,
    NullableTimestamp,
    ObjectOrNull,
    Ordinal,
    ParentId,
    SnapshotId,
    StopReason,
    StorableObject,
    SummaryKey,
    Text,
    Through,
    Timestamp,
    Version1,
    Version2,
    Version3,
    list_of,
    optional,
    problem,
    problem_message,
    refuse,
    text,
    text_check,
    unstorable,
    where,
)
from service.store.settings import (
    CONTEXT_WINDOW_MAX,
    CONTEXT_WINDOW_MIN,
    MAX_MODEL_CHARS,
    MAX_SUMMARY_INSTRUCTIONS_BYTES,
    ON_BUSY_CHOICES,
    OUTPUT_CAP_MAX,
    OUTPUT_CAP_MIN,
    settings_problems,
)
from service.vocabulary import Status, is_int

# --------------------------------------------------------------------------------------------
# The models. One base validates an object the archive's way (_Part.validate_part).


class _Part(BaseModel):
    """An object of the archive: JSON PostgreSQL keeps verbatim (``_raw``), checked as storable as a
    whole first; any other key is kept too.

    ``missing_first`` reports missing required keys before anything else; ``null_if_missing`` keys
    are validated as null when absent, so their own message says what they must be.
    """

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "propertyNames": {"pattern": NO_NUL_PATTERN},
            "additionalProperties": {REF: STORABLE_JSON},
        },
    )
    closed: ClassVar[bool] = False
    # False for the parts of a part (the calls of a usage): the whole was checked as storable.
    checks_storable: ClassVar[bool] = True
    missing_first: ClassVar[bool] = False
    null_if_missing: ClassVar[tuple[str, ...]] = ()
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def raw(self) -> dict[str, Any]:
        """The object exactly as the archive holds it (what PostgreSQL keeps)."""
        return self._raw

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[tuple[Loc, str]]:
        """Problems no single field can see, reported before the fields' own."""
        return []

    @model_validator(mode="wrap")
    @classmethod
    def validate_part(cls, data: Any, handler: ModelWrapValidatorHandler[Self], info: ValidationInfo) -> Self:
        """Validate ``data`` as this part, every problem of it (and of its parts) in one error."""
        if not isinstance(data, dict):
            raise problem("must be an object")
        fields = cls.model_fields
        found: list[tuple[Loc, str]] = []
        if cls.closed:
            version = (info.context or {}).get("version")
            unknown = sorted(set(data) - set(fields))
            found = [((key,), f"is not a field of a version {version} archive") for key in unknown]
            given = {key: value for key, value in data.items() if key in fields}
        else:
            if cls.checks_storable and (unstorable_here := unstorable(data)):
                refuse(unstorable_here)  # an object that cannot be stored is not looked into further
            given = dict(data)
        if cls.missing_first:
            required = {name for name, spec in fields.items() if spec.is_required()}
            found += [((key,), "is required") for key in sorted(required - set(data))]
        found += cls.problems(data)
        given = {**dict.fromkeys(k for k in cls.null_if_missing if k not in given), **given}
        try:
            part = handler(given)
        except ValidationError as exc:
            skip = "missing" if cls.missing_first else None  # already reported above
            refuse(found + [(e["loc"], problem_message(e)) for e in exc.errors() if e["type"] != skip])
        if found:
            refuse(found)
        part._raw = data
        return part


class _Closed(_Part):
    """An object of the archive's own shape (the document, its session, a question): unknown keys are
    refused first, in the archive version's words."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=None)
    closed = True


class _Call(_Part):
    checks_storable = False
    input_tokens: Counter = optional()
    output_tokens: Counter = optional()
    reasoning_tokens: Counter = optional()
    cached_tokens: Counter = optional()
    # Already storable as a part of the usage: these only say what type they must be.
    purpose: Text = optional()
    status: Text = optional()
    model: NullableText = optional()
    reported: Flag = optional()


class _Usage(_Part):
    input_tokens: Counter = optional()
    output_tokens: Counter = optional()
    reasoning_tokens: Counter = optional()
    cached_tokens: Counter = optional()
    calls: Annotated[list[_Call], list_of("must be a list of objects")] = optional()


def _error_message(value: object, info: ValidationInfo) -> object:
    # Looked at only once the code is right: one problem of an error object at a time, as ever.
    return text_check()(value) if "code" in info.data else value


class _Error(_Part):
    null_if_missing = ("code", "message")
    code: Text
    message: Annotated[str, PlainValidator(_error_message), WithJsonSchema({"type": "string", **NO_NUL})]
    detail: ObjectOrNull = optional()


class _ContextSummary(_Part):
    checks_storable = False
    null_if_missing = ("key",)
    key: SummaryKey


class _Memory(_Part):
    qa_summary: ObjectOrNull = Field(None, description="the rolling Q&A summary (document and provenance)")
    context_summaries: Annotated[list[_ContextSummary], list_of("must be a list")] = Field(
        [], description="the context-summary cache, keyed by the content hash of the summarised prefix"
    )


HandoffInt = Annotated[
    int | None,
    where(lambda v: v is None or is_int(v), "must be an integer or null"),
    WithJsonSchema({"type": ["integer", "null"]}),
]
HandoffOrdinals = Annotated[
    list[int],
    where(lambda v: isinstance(v, list) and all(is_int(o) for o in v), "must be a list of integers"),
    WithJsonSchema({"type": "array", "items": {"type": "integer"}}),
]


def _user_message(value: object) -> bool:
    return value is None or (
        isinstance(value, dict)
        and value.get("role", "user") == "user"
        and isinstance(value.get("content", ""), str)
    )


# A hand-off: kept verbatim, so open, but never with the ids a restore gives it afresh.
class _Handoff(_Part):
    model_config = ConfigDict(extra="allow", json_schema_extra=lambda schema: _handoff_schema(schema))
    null_if_missing = ("created_at", "format", "ordinals", "text")
    created_at: Timestamp
    format: Annotated[
        str,
        where(lambda v: v in HANDOFF_FORMATS, "must be one of anthropic, openai, text"),
        WithJsonSchema({"enum": list(HANDOFF_FORMATS)}),
    ]
    text: Annotated[str, text(), WithJsonSchema({"type": "string", **NO_NUL})]
    ordinals: Annotated[
        list[int],
        where(
            lambda v: isinstance(v, list) and bool(v) and all(is_int(o) for o in v),
            "must be a non-empty list of integers",
        ),
        WithJsonSchema({"type": "array", "items": {"type": "integer"}, "minItems": 1}),
    ]
    summarized_ordinals: HandoffOrdinals = optional()
    shortened_ordinals: HandoffOrdinals = optional()
    omitted_ordinals: HandoffOrdinals = optional()
    message: Annotated[
        dict[str, Any] | None,
        where(_user_message, 'must be null or {"role": "user", "content": string}'),
        WithJsonSchema(
            {
                "type": ["object", "null"],
                "properties": {"role": {"const": "user"}, "content": {"type": "string", **NO_NUL}},
                "propertyNames": NO_NUL,
                "additionalProperties": STORABLE,
            }
        ),
    ] = optional()
    from_ordinal: HandoffInt = optional()
    through_ordinal: HandoffInt = optional()
    estimate_tokens: Annotated[
        int, where(is_int, "must be an integer"), WithJsonSchema({"type": "integer"})
    ] = optional()
    truncated: Flag = optional()

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[tuple[Loc, str]]:
        return [
            ((key,), "is not archived (restore gives hand-offs fresh ids)")
            for key in ("id", "parent_id")
            if key in data
        ]


def _handoff_schema(schema: dict[str, Any]) -> None:
    # Open, as every part (_Part): other keys are kept, stored as they are, so storable at any depth.
    schema["propertyNames"] = NO_NUL
    schema["additionalProperties"] = STORABLE
    schema["required"].sort()  # the fields are in the order they are checked; the schema lists them a-z
    schema["description"] = "a hand-off (SPEC §11.1) without its id and parent_id"
    schema["not"] = {"anyOf": [{"required": ["id"]}, {"required": ["parent_id"]}]}


_NULLABLE_MODEL: Final = {"type": ["string", "null"], "minLength": 1, "maxLength": MAX_MODEL_CHARS}


# The session's settings: checked by the store's one settings rule (a PUT's), described here.
class _Settings(_Part):
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})
    summary_instructions: Annotated[
        Any, WithJsonSchema({"type": ["string", "null"], "maxLength": MAX_SUMMARY_INSTRUCTIONS_BYTES})
    ] = Field(None, description=f"at most {MAX_SUMMARY_INSTRUCTIONS_BYTES} bytes of UTF-8")
    summary_model: Annotated[Any, WithJsonSchema(_NULLABLE_MODEL)] = None
    answer_model: Annotated[Any, WithJsonSchema(_NULLABLE_MODEL)] = None
    context_window: Annotated[
        Any,
        WithJsonSchema(
            {"type": ["integer", "null"], "minimum": CONTEXT_WINDOW_MIN, "maximum": CONTEXT_WINDOW_MAX}
        ),
    ] = None
    max_output_tokens: Annotated[
        Any,
        WithJsonSchema({"type": ["integer", "null"], "minimum": OUTPUT_CAP_MIN, "maximum": OUTPUT_CAP_MAX}),
    ] = None
    on_busy: Annotated[Any, WithJsonSchema({"enum": [*ON_BUSY_CHOICES, None]})] = None
    mask_tool_results: Annotated[Any, WithJsonSchema({"type": ["boolean", "null"]})] = None

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[tuple[Loc, str]]:
        return [((name,), message) for name, message in settings_problems(data)]


class _Session(_Closed):
    memory: _Memory = optional(
        description="the session's memory; missing parts are empty, other keys are kept"
    )
    handoffs: Annotated[list[_Handoff], list_of("must be a list")] = Field(
        [], description="the session's hand-offs, oldest first; missing → none"
    )
    handed_off_through: Through = Field(0, description="highest ordinal handed off (SPEC §11.1); missing → 0")
    settings: _Settings = optional(
        description="the session's settings (SPEC §11.2); missing → the session keeps its own"
    )


_ORDINAL_NOTE: Final = "identifies the request within its session; kept by restore; unique in an archive"


def _question_schema(schema: dict[str, Any]) -> None:
    # The fields are in the order they are checked (status before the answer it decides about);
    # the schema lists the required ones in SPEC's order.
    schema["required"] = ["ordinal", "question", "answer", "created_at"]


class QuestionV1(_Closed):
    model_config = ConfigDict(json_schema_extra=_question_schema)
    missing_first = True
    ordinal: Ordinal = Field(description=_ORDINAL_NOTE)
    question: Text
    created_at: Timestamp = Field(description=TIMESTAMP_NOTE)
    answer: Text


def _question_v2_schema(schema: dict[str, Any]) -> None:
    _question_schema(schema)
    schema["allOf"] = [
        {
            "if": {"properties": {"status": {"const": "succeeded"}}},
            "then": {"properties": {"answer": {"type": "string"}}},
        }
    ]


class QuestionV2(_Closed):
    model_config = ConfigDict(json_schema_extra=_question_v2_schema)
    missing_first = True
    ordinal: Ordinal = Field(description=_ORDINAL_NOTE)
    question: Text
    created_at: Timestamp = Field(description=TIMESTAMP_NOTE)
    status: Finished = Field("succeeded", description="archives hold finished requests only")
    answer: Answer = Field(description="required text when status is succeeded")
    error: _Error | None = None
    usage: _Usage = optional(description="cumulative usage (SPEC §3); missing → zeros and no calls")
    model: ModelName = optional()
    snapshot_id: SnapshotId = optional(description="a reference only: archives carry no snapshot content")
    stop_reason: StopReason = optional()
    truncated: Flag = False
    started_at: NullableTimestamp = optional(description=TIMESTAMP_NOTE)
    finished_at: NullableTimestamp = optional(description=TIMESTAMP_NOTE)


def _question_v3_schema(schema: dict[str, Any]) -> None:
    _question_v2_schema(schema)
    schema["allOf"].append(
        {
            "if": {"properties": {"status": {"enum": ["failed", "cancelled"]}}, "required": ["status"]},
            "then": {"properties": {"pinned": {"const": False}}},
        }
    )


def _pinned(value: object, info: ValidationInfo) -> bool:
    # Only a succeeded request can be pinned (SPEC §11.1: 409 not_pinnable otherwise), so no export
    # has another one pinned; restored, it would be dropped, not written back as the archive says.
    if not isinstance(value, bool):
        raise problem("must be true or false")
    if value and info.data.get("status", Status.SUCCEEDED) != Status.SUCCEEDED:
        raise problem("can only be true on a succeeded request")
    return value


class QuestionV3(QuestionV2):
    model_config = ConfigDict(json_schema_extra=_question_v3_schema)
    context_info: StorableObject = Field(
        {}, description="the request's budget report (SPEC §3 context_info); missing → {}"
    )
    pinned: Annotated[bool, PlainValidator(_pinned), WithJsonSchema({"type": "boolean"})] = Field(
        False,
        description="pinned for the next hand-off (SPEC §11.1), succeeded requests only; missing → false",
    )


_PARENT_NOTE: Final = "the session it was exported from; restore uses the parent id of its URL"
_EXPORTED_NOTE: Final = "when the archive was written (informational; ignored by restore)"
_QUESTIONS_NOTE: Final = "finished requests in ascending ordinal"


def _document_config(version: int, description: str) -> ConfigDict:
    return ConfigDict(
        title=f"Sidequest side-question archive, version {version}",
        json_schema_extra={"description": description},
    )


class _Document(_Closed):
    null_if_missing = ("questions",)


class ArchiveV1(_Document):
    """A version 1 archive."""

    model_config = _document_config(
        1, "Questions and answers only; holds succeeded requests and restores as succeeded history."
    )
    version: Version1
    parent_id: ParentId = Field(description=_PARENT_NOTE)
    exported_at: Timestamp = optional(description=_EXPORTED_NOTE)
    questions: Annotated[list[QuestionV1], list_of("is required and must be a list")] = Field(
        description=_QUESTIONS_NOTE
    )


class ArchiveV2(_Document):
    """A version 2 archive."""

    model_config = _document_config(
        2,
        "Adds each request's outcome: status, error, usage, model, timings, snapshot reference "
        "(and truncated, stop_reason).",
    )
    version: Version2
    parent_id: ParentId = Field(description=_PARENT_NOTE)
    exported_at: Timestamp = optional(description=_EXPORTED_NOTE)
    questions: Annotated[list[QuestionV2], list_of("is required and must be a list")] = Field(
        description=_QUESTIONS_NOTE
    )


class ArchiveV3(_Document):
    """A version 3 archive."""

    model_config = _document_config(
        3,
        "Adds the session's memory (rolling Q&A summary, context-summary cache) and each request's "
        "context_info; and the session's hand-offs, handed_off_through and settings, and each request's "
        "pinned.",
    )
    version: Version3
    parent_id: ParentId = Field(description=_PARENT_NOTE)
    exported_at: Timestamp = optional(description=_EXPORTED_NOTE)
    session: _Session = optional(description="missing → empty memory")
    questions: Annotated[list[QuestionV3], list_of("is required and must be a list")] = Field(
        description=_QUESTIONS_NOTE
    )


MODELS: Final[dict[int, type[ArchiveV1 | ArchiveV2 | ArchiveV3]]] = {
    1: ArchiveV1,
    2: ArchiveV2,
    3: ArchiveV3,
}


# --------------------------------------------------------------------------------------------
# JSON Schemas: generated from the models (the one source of docs/archive/v*.schema.json and of the
# OpenAPI archive bodies).


def storable_json_defs(refs: str) -> dict[str, dict[str, Any]]:
    """``StorableJson`` (any JSON value) and ``StorableObject`` (a JSON object) without NUL anywhere.

    Recursive: strings and keys at every depth match :data:`NO_NUL_PATTERN`. ``refs`` is the prefix
    the two definitions are found under (``#/components/schemas/`` in OpenAPI, ``#/$defs/`` in a
    standalone schema).
    """
    value = {"$ref": refs + STORABLE_JSON}
    obj: dict[str, Any] = {
        "type": "object",
        "propertyNames": {"pattern": NO_NUL_PATTERN},
        "additionalProperties": value,
        "description": "A JSON object without NUL characters in any string or key (PostgreSQL refuses them).",
    }
    return {
        STORABLE_JSON: {
            "description": "Any JSON value without NUL characters in any string or key.",
            "anyOf": [
                {"type": "string", "pattern": NO_NUL_PATTERN},
                {"type": ["number", "boolean", "null"]},
                {"type": "array", "items": value},
                {"$ref": refs + STORABLE_OBJECT},
            ],
        },
        STORABLE_OBJECT: obj,
    }


class _SchemaGenerator(GenerateJsonSchema):
    """Pydantic's generator without a title on every field (the archive schemas never had them)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _inline(node: Any, defs: dict[str, Any], refs: str) -> Any:
    """The schema with every model written in place (no ``$defs`` of models), nullable models as
    ``"type": [..., "null"]`` like every other nullable field, and our own references under ``refs``."""
    if isinstance(node, list):
        return [_inline(item, defs, refs) for item in node]
    if not isinstance(node, dict):
        return node
    name = node.get("$ref", "").removeprefix(STANDALONE_REFS)
    if name in defs:
        model = {k: v for k, v in defs[name].items() if k != "title"}
        node = {**model, **{k: v for k, v in node.items() if k != "$ref"}}
    if REF in node:
        node = {"$ref": refs + node[REF]}
    any_of = node.get("anyOf")
    if isinstance(any_of, list) and len(any_of) == 2 and any_of[1] == {"type": "null"}:
        if any_of[0].get("$ref", "").removeprefix(STANDALONE_REFS) in defs:
            model = _inline(any_of[0], defs, refs)
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            node = {**model, "type": [model["type"], "null"], **rest}
    return {key: _inline(value, defs, refs) for key, value in node.items()}


def archive_json_schema(version: int, *, standalone: bool = True) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a version ``version`` archive, made from its model.

    ``standalone`` adds ``$schema``/``$id`` for the published files and carries the NUL-free JSON
    definitions (:func:`storable_json_defs`) in its own ``$defs``; an OpenAPI document embeds the
    schema without them and refers to ``#/components/schemas/`` instead (the app adds them there).
    What a schema cannot say is checked by :func:`parse_archive` (unique ordinals).
    """
    if version not in ARCHIVE_VERSIONS:
        raise ValueError(f"no archive version {version}")
    generated = MODELS[version].model_json_schema(schema_generator=_SchemaGenerator)
    defs = generated.pop("$defs", {})
    schema: dict[str, Any] = _inline(generated, defs, STANDALONE_REFS if standalone else OPENAPI_REFS)
    if not standalone:
        return schema
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:sidequest:archive:v{version}",
        **schema,
        "$defs": storable_json_defs(STANDALONE_REFS),
    }
