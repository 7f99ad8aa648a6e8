"""The archive's field types (SPEC §10): each an annotated type carrying its validator, in the
archive's own words, and its JSON Schema; and how the archive reports a problem.

A problem is a pydantic error of one custom type (``archive``) whose message is ours, so the models
of :mod:`service.store.archive_schema` merge the problems of their parts with full locations, and
:func:`problem_message` / :func:`loc_text` turn them into SPEC's ``{"loc", "message"}`` items.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Final, NoReturn

from pydantic import BeforeValidator, Field, PlainValidator, ValidationError, ValidationInfo, WithJsonSchema
from pydantic_core import InitErrorDetails, PydanticCustomError

from service.vocabulary import TERMINAL, Status, integral, unstorable_reason

ARCHIVE_VERSIONS: Final = (1, 2, 3)

# Column limits of the schema: a longer value must be a 422, never a database error (500).
MAX_ORDINAL: Final = 2_147_483_646  # int4, and next_ordinal = highest + 1 must fit too
_MAX_PARENT_ID: Final = 500
_MAX_SNAPSHOT_ID: Final = 500
_MAX_MODEL: Final = 200
_MAX_STOP_REASON: Final = 60
HANDOFF_FORMATS: Final = ("anthropic", "openai", "text")
_FINISHED: Final = sorted((str(s) for s in TERMINAL), reverse=True)  # succeeded, failed, cancelled

# PostgreSQL cannot store NUL (U+0000) in text or JSONB: every string the service stores says so.
NO_NUL_PATTERN: Final = "^[^\\u0000]*$"
STORABLE_JSON: Final = "StorableJson"
STORABLE_OBJECT: Final = "StorableObject"
OPENAPI_REFS: Final = "#/components/schemas/"
STANDALONE_REFS: Final = "#/$defs/"


# --------------------------------------------------------------------------------------------
# Problems: raised as pydantic errors of one custom type, so nested models merge their locations.

Loc = tuple[str | int, ...]


def problem(message: str) -> PydanticCustomError:
    """The problem ``message`` (our words) as the pydantic error a validator raises."""
    return PydanticCustomError("archive", "{message}", {"message": message})


def refuse(problems: Sequence[tuple[Loc, str]]) -> NoReturn:
    """Raise every problem at once, each at its location below the value being validated."""
    details: list[InitErrorDetails] = [
        {"type": problem(message), "loc": loc, "input": None} for loc, message in problems
    ]
    raise ValidationError.from_exception_data("archive", details)


# The few pydantic errors our validators leave to pydantic itself, in the archive's words.
_PYDANTIC_WORDS: Final = {"missing": "is required", "model_type": "must be an object"}


def problem_message(error: Any) -> str:
    """The archive's words for one pydantic error (``ValidationError.errors()`` item)."""
    if error["type"] == "archive":
        return str(error["ctx"]["message"])
    return _PYDANTIC_WORDS.get(error["type"], str(error["msg"]))


def loc_text(loc: Loc) -> str:
    """``("questions", 0, "usage")`` as ``questions[0].usage``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def unstorable_text(value: str) -> str | None:
    """Why PostgreSQL cannot store the string ``value``, in the archive's words, or None."""
    if unstorable_reason(value) is None:  # the rule is the vocabulary's
        return None
    if "\x00" in value:
        return "contains a NUL character, which cannot be stored"
    return "contains an unpaired surrogate, which is not valid UTF-8"


def unstorable(value: object) -> list[tuple[Loc, str]]:
    """Where in ``value`` PostgreSQL would refuse it: NUL, unpaired surrogates, non-finite numbers."""
    found: list[tuple[Loc, str]] = []
    _scan(value, [], found)
    return found


def _scan(value: object, path: list[str | int], found: list[tuple[Loc, str]]) -> None:
    # One path list, copied only where there is a problem: archives hold megabytes of usage and
    # context_info, nearly all of it fine.
    if len(path) > 64:
        found.append((tuple(path), "is nested too deeply"))
    elif isinstance(value, str):
        if (why := unstorable_text(value)) is not None:
            found.append((tuple(path), why))
    elif isinstance(value, dict):
        for key, item in value.items():
            path.append(key)
            _scan(key, path, found)
            _scan(item, path, found)
            path.pop()
    elif isinstance(value, list):
        for index, item in enumerate(value):
            path.append(index)
            _scan(item, path, found)
            path.pop()
    elif isinstance(value, float) and not math.isfinite(value):
        found.append((tuple(path), "contains a non-finite number (NaN or Infinity)"))


# --------------------------------------------------------------------------------------------
# Field types: each an annotated type with its validator (our messages) and its JSON Schema.


def text_check(
    *, max_len: int | None = None, nullable: bool = False, empty: str | None = None, wrong: str | None = None
) -> Callable[[object], str | None]:
    """A text check: a string PostgreSQL can store (or null), at most ``max_len`` characters, and not
    empty when ``empty`` says why it must not be."""

    def validate(value: object) -> str | None:
        if value is None and nullable:
            return None
        if not isinstance(value, str):
            raise problem(wrong or "must be a string" + (" or null" if nullable else ""))
        if max_len is not None and len(value) > max_len:
            raise problem(f"must be at most {max_len} characters")
        if (why := unstorable_text(value)) is not None:
            raise problem(why)
        if empty and not value:
            raise problem(empty)
        return value

    return validate


def text(**check: Any) -> Any:
    """The validator of a text field (:func:`text_check`)."""
    return PlainValidator(text_check(**check))


def where(predicate: Callable[[Any], bool], message: str) -> Any:
    """The validator of a field whose value must satisfy ``predicate`` (else ``message``), kept as given."""

    def validate(value: object) -> object:
        if not predicate(value):
            raise problem(message)
        return value

    return PlainValidator(validate)


def bounded(low: int, high: int | None = None) -> Any:
    """The validator of a JSON integer (``5.0`` included) from ``low`` to ``high``."""
    message = "must be a non-negative integer" if high is None else f"must be an integer from {low} to {high}"

    def validate(value: object) -> int:
        number = integral(value)
        if number is None or number < low or (high is not None and number > high):
            raise problem(message)
        return number

    return PlainValidator(validate)


# RFC 3339 (JSON Schema's "date-time"): a full date and time with seconds and an offset.
_RFC3339_NO_ZONE = re.compile(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d(:\d\d(\.\d+)?)?")
_RFC3339 = re.compile(r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:(\d\d)(\.\d+)?([Zz]|[+-]\d\d:\d\d)")


def _parse_timestamp(text: str) -> datetime | None:
    """An RFC 3339 timestamp; a leap second counts, as in PostgreSQL, as the next minute's first instant
    (OverflowError when that is past year 9999)."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        return None
    leap = match.group(1) == "60"
    normalized = text.upper()
    if leap:
        normalized = normalized[: match.start(1)] + "59" + normalized[match.end(1) :]
    try:
        moment = datetime.fromisoformat(normalized)
    except ValueError:
        return None
    return moment + timedelta(seconds=1) if leap else moment


def _timestamp(*, nullable: bool = False) -> Any:
    """The validator of a timestamp field: RFC 3339 with a zone, as an aware UTC datetime."""

    def validate(value: object) -> datetime | None:
        if value is None and nullable:
            return None
        if not isinstance(value, str):
            raise problem("must be an ISO 8601 timestamp string" + (" or null" if nullable else ""))
        try:
            moment = _parse_timestamp(value)
        except OverflowError:  # 9999-12-31T23:59:60Z: its next minute is past year 9999
            raise problem("is out of range (a leap second at the end of year 9999)") from None
        if moment is None:
            if _RFC3339_NO_ZONE.fullmatch(value):
                raise problem("must carry a time zone (e.g. a trailing Z)")
            raise problem(f"is not an ISO 8601 timestamp like 2026-11-29T10:00:00Z: {value[:40]!r}")
        try:
            return moment.astimezone(UTC)
        except OverflowError:  # e.g. 0001-01-01T00:00:00+12:00 is before year 1 in UTC
            raise problem("is out of range once converted to UTC") from None

    return PlainValidator(validate)


def _answer(value: object, info: ValidationInfo) -> str | None:
    # A succeeded request always has its answer; a failed or cancelled one may have none. The
    # status is validated first; when it was refused, its own error says so and null is let through.
    return text_check(nullable=info.data.get("status") != Status.SUCCEEDED)(value)


def list_of(message: str) -> BeforeValidator:
    """Refuse anything but a JSON array with ``message`` (before its items are validated)."""

    def validate(value: object) -> object:
        if not isinstance(value, list):
            raise problem(message)
        return value

    return BeforeValidator(validate)


def _none() -> Any:
    return None


def optional(**kwargs: Any) -> Any:
    """A field that may be absent: None then (``model_fields_set`` tells), and no default in the schema."""
    return Field(default_factory=_none, **kwargs)


NO_NUL: Final = {"pattern": NO_NUL_PATTERN}
# References to the NUL-free JSON definitions, under a key pydantic leaves alone: where the
# definitions live (standalone $defs or OpenAPI components) is only known when a schema is made.
REF: Final = "x-sidequest-ref"
STORABLE: Final = {REF: STORABLE_JSON}
_OBJECT_OR_NULL: Final = {"anyOf": [{REF: STORABLE_OBJECT}, {"type": "null"}]}
TIMESTAMP_NOTE: Final = (
    "ISO 8601 / RFC 3339 with a time zone; exports write UTC with microseconds, "
    "e.g. 2026-11-29T10:00:00.123456Z"
)

Text = Annotated[str, text(), WithJsonSchema({"type": "string", **NO_NUL})]
NullableText = Annotated[
    str | None, text(nullable=True), WithJsonSchema({"type": ["string", "null"], **NO_NUL})
]
Answer = Annotated[
    str | None, PlainValidator(_answer), WithJsonSchema({"type": ["string", "null"], **NO_NUL})
]
ParentId = Annotated[
    str,
    text(max_len=_MAX_PARENT_ID, empty="must not be empty"),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": _MAX_PARENT_ID, **NO_NUL}),
]
ModelName = Annotated[
    str | None,
    text(max_len=_MAX_MODEL, nullable=True),
    WithJsonSchema({"type": ["string", "null"], "maxLength": _MAX_MODEL, **NO_NUL}),
]
SnapshotId = Annotated[
    str | None,
    text(max_len=_MAX_SNAPSHOT_ID, nullable=True),
    WithJsonSchema({"type": ["string", "null"], "maxLength": _MAX_SNAPSHOT_ID, **NO_NUL}),
]
StopReason = Annotated[
    str | None,
    text(max_len=_MAX_STOP_REASON, nullable=True),
    WithJsonSchema({"type": ["string", "null"], "maxLength": _MAX_STOP_REASON, **NO_NUL}),
]
SummaryKey = Annotated[
    str,
    text(empty="must be a non-empty string", wrong="must be a non-empty string"),
    WithJsonSchema({"type": "string", "minLength": 1, **NO_NUL}),
]
Timestamp = Annotated[datetime, _timestamp(), WithJsonSchema({"type": "string", "format": "date-time"})]
NullableTimestamp = Annotated[
    datetime | None,
    _timestamp(nullable=True),
    WithJsonSchema({"type": ["string", "null"], "format": "date-time"}),
]
Ordinal = Annotated[
    int, bounded(1, MAX_ORDINAL), WithJsonSchema({"type": "integer", "minimum": 1, "maximum": MAX_ORDINAL})
]
Through = Annotated[
    int, bounded(0, MAX_ORDINAL), WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_ORDINAL})
]
Counter = Annotated[int, bounded(0), WithJsonSchema({"type": "integer", "minimum": 0})]
Flag = Annotated[
    bool, where(lambda v: isinstance(v, bool), "must be true or false"), WithJsonSchema({"type": "boolean"})
]
Finished = Annotated[
    str,
    where(
        lambda v: isinstance(v, str) and v in TERMINAL,
        "must be one of succeeded, failed, cancelled (archives hold finished requests only)",
    ),
    WithJsonSchema({"enum": _FINISHED}),
]
ObjectOrNull = Annotated[
    dict[str, Any] | None,
    where(lambda v: v is None or isinstance(v, dict), "must be an object or null"),
    WithJsonSchema(_OBJECT_OR_NULL),
]


def _storable_object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise problem("must be an object")
    if found := unstorable(value):
        refuse(found)
    return value


StorableObject = Annotated[
    dict[str, Any],
    PlainValidator(_storable_object),
    WithJsonSchema({"type": "object", "propertyNames": NO_NUL, "additionalProperties": STORABLE}),
]
# The version is checked before a model is chosen (parse_archive); each model names its own.
Version1 = Annotated[int, PlainValidator(integral), WithJsonSchema({"const": 1})]
Version2 = Annotated[int, PlainValidator(integral), WithJsonSchema({"const": 2})]
Version3 = Annotated[int, PlainValidator(integral), WithJsonSchema({"const": 3})]
