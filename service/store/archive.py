"""Side-question archives (SPEC §10): export a session's history and restore it elsewhere.

Three formats, one codec each way:

- ``version: 1`` — ``{version, parent_id, exported_at, questions}``, each question
  ``{ordinal, question, answer, created_at}``;
- ``version: 2`` — adds per request ``status, error, usage, model, started_at, finished_at, snapshot_id``
  (and ``truncated``, ``stop_reason``, which a record carries too);
- ``version: 3`` — adds ``session.memory`` (``qa_summary``, ``context_summaries``) and per request
  ``context_info``; and, as SPEC §11's extra fields, ``session.handoffs`` (oldest first, without ids),
  ``session.handed_off_through``, ``session.settings`` and per request ``pinned``. A v3 archive without
  them restores with no hand-offs, ``handed_off_through`` 0, no pins, and the session's settings as
  they were.

Decisions (docs/archive.md explains them to users):

- An archive is *history*: only terminal requests (``succeeded``, ``failed``, ``cancelled``) are
  exported, and only they can be restored. Queued and running requests are work in flight, not
  history; a restored ``queued`` request would make a worker answer it in a session that may not
  hold its snapshot. A v1 archive holds only succeeded requests, because v1 restores as succeeded.
- Cleared requests (``deleted_at`` set) are gone for users, so they are never exported.
- Export emits only what restore reproduces, so export → restore → export is the identity apart
  from ``parent_id`` and ``exported_at``.
- Restore validates the whole document before writing anything, then writes in one transaction:
  the archive's ordinals are kept, ``next_ordinal`` continues after the highest, restored requests
  get fresh ids, the archive's status and the session's ``clear_version``. Every restored request
  also gets its terminal ``status`` event and its ``done``/``error`` event, so that its event stream
  replays and closes like any finished request's.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.store.models import EMPTY_MEMORY, EventRow, HandoffRow, RequestRow, SessionRow
from service.store.records import EMPTY_USAGE, request_record
from service.store.sessions import find_session, lock_or_create_session
from service.store.settings import SETTINGS_FIELDS, public_settings, settings_problems
from service.vocabulary import EVENTS_CHANNEL as NOTIFY_CHANNEL
from service.vocabulary import TERMINAL as TERMINAL_STATUSES
from service.vocabulary import utc_iso

ARCHIVE_VERSIONS: Final = (1, 2, 3)
LATEST_VERSION: Final = 3

# Column limits of the schema: a longer value must be a 422, never a database error (500).
_MAX_ORDINAL: Final = 2_147_483_646  # int4, and next_ordinal = highest + 1 must fit too
_MAX_PARENT_ID: Final = 500
_MAX_SNAPSHOT_ID: Final = 500
_MAX_MODEL: Final = 200
_MAX_STOP_REASON: Final = 60
# A malformed archive may have thousands of problems; the first ones are enough to fix it.
_MAX_REPORTED_ERRORS: Final = 50

_V1_QUESTION_KEYS: Final = frozenset({"ordinal", "question", "answer", "created_at"})
_V2_QUESTION_KEYS: Final = _V1_QUESTION_KEYS | {
    "status",
    "error",
    "usage",
    "model",
    "started_at",
    "finished_at",
    "snapshot_id",
    "truncated",
    "stop_reason",
}
_V3_QUESTION_KEYS: Final = _V2_QUESTION_KEYS | {"context_info", "pinned"}
_V3_SESSION_KEYS: Final = frozenset({"memory", "handoffs", "handed_off_through", "settings"})
_HANDOFF_FORMATS: Final = ("anthropic", "openai", "text")
_HANDOFF_ORDINAL_LISTS: Final = ("ordinals", "summarized_ordinals", "shortened_ordinals", "omitted_ordinals")
_QUESTION_KEYS: Final = {1: _V1_QUESTION_KEYS, 2: _V2_QUESTION_KEYS, 3: _V3_QUESTION_KEYS}
_TOP_KEYS: Final = {
    1: frozenset({"version", "parent_id", "exported_at", "questions"}),
    2: frozenset({"version", "parent_id", "exported_at", "questions"}),
    3: frozenset({"version", "parent_id", "exported_at", "session", "questions"}),
}
_USAGE_COUNTERS: Final = ("input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens")


# --------------------------------------------------------------------------------------------
# Errors: one type per refusal, each carrying the HTTP status and SPEC error code it maps to.


class ArchiveError(Exception):
    """A refused export or restore; ``status``/``code``/``message``/``detail`` form the API error."""

    status: int = 400
    code: str = "invalid_archive"

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail: dict[str, Any] = detail or {}


class ArchiveUnreadable(ArchiveError):
    """The body is not a JSON object with a supported ``version`` (400)."""

    status = 400
    code = "invalid_archive"


class ArchiveInvalid(ArchiveError):
    """An archive of a known version that breaks its format (422); ``detail.errors`` lists where."""

    status = 422
    code = "invalid_archive"


class SessionNotFound(ArchiveError):
    """No session with this parent id for this tenant (404, also for another tenant's session)."""

    status = 404
    code = "not_found"


class SessionHasHistory(ArchiveError):
    """Restoring would mix two histories; ``mode=replace`` is the explicit way to discard one (409)."""

    status = 409
    code = "session_has_history"


class SessionBusy(ArchiveError):
    """Replace refused while requests are queued or running: their workers would write into it (409)."""

    status = 409
    code = "session_busy"


# --------------------------------------------------------------------------------------------
# The parsed archive: plain values, validated, ready to write.


@dataclass(frozen=True)
class ArchivedRequest:
    """One request as an archive carries it (defaults are what an older version implies)."""

    ordinal: int
    question: str
    answer: str | None
    created_at: datetime
    status: str = "succeeded"
    error: dict[str, Any] | None = None
    usage: dict[str, Any] = field(default_factory=lambda: json.loads(json.dumps(EMPTY_USAGE)))
    model: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    snapshot_id: str | None = None
    truncated: bool = False
    stop_reason: str | None = None
    context_info: dict[str, Any] = field(default_factory=dict)
    pinned: bool = False


@dataclass(frozen=True)
class ArchivedHandoff:
    """One hand-off as an archive carries it: its public object without ``id`` / ``parent_id``."""

    created_at: datetime
    body: dict[str, Any]


@dataclass(frozen=True)
class Archive:
    """A validated archive of any version, requests sorted by ordinal.

    ``settings`` is None when the archive carries none (the session's own are then kept).
    """

    version: int
    parent_id: str
    memory: dict[str, Any]
    requests: tuple[ArchivedRequest, ...]
    handoffs: tuple[ArchivedHandoff, ...] = ()
    handed_off_through: int = 0
    settings: dict[str, Any] | None = None


@dataclass(frozen=True)
class RestoreResult:
    """What a restore did; the API returns it as JSON."""

    parent_id: str
    version: int
    restored: int
    replaced: int
    next_ordinal: int
    clear_version: int

    def as_json(self) -> dict[str, Any]:
        return {
            "parent_id": self.parent_id,
            "version": self.version,
            "restored": self.restored,
            "replaced": self.replaced,
            "next_ordinal": self.next_ordinal,
            "clear_version": self.clear_version,
        }


# --------------------------------------------------------------------------------------------
# Parsing and validation (pure).


def load_archive_json(body: bytes | str) -> object:
    """Decode an archive body; anything that is not JSON is a 400 with the parser's reason."""
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ArchiveUnreadable(f"the archive is not valid JSON: {exc}") from None
    except RecursionError:
        raise ArchiveUnreadable("the archive is nested too deeply to be an archive") from None


class _Checker:
    """Collects every problem of a document with its location, so one reply shows them all."""

    def __init__(self) -> None:
        self.errors: list[dict[str, str]] = []

    def fail(self, loc: str, message: str) -> None:
        if len(self.errors) < _MAX_REPORTED_ERRORS:
            self.errors.append({"loc": loc, "message": message})

    def text(self, value: object, loc: str, *, max_len: int | None = None, nullable: bool = False) -> bool:
        if value is None and nullable:
            return True
        if not isinstance(value, str):
            self.fail(loc, "must be a string" + (" or null" if nullable else ""))
            return False
        if max_len is not None and len(value) > max_len:
            self.fail(loc, f"must be at most {max_len} characters")
            return False
        return self.storable(value, loc)

    def storable(self, value: object, loc: str, depth: int = 0) -> bool:
        """PostgreSQL refuses NUL characters, lone surrogates and non-finite numbers: say so here."""
        if depth > 64:
            self.fail(loc, "is nested too deeply")
            return False
        if isinstance(value, str):
            if "\x00" in value:
                self.fail(loc, "contains a NUL character, which cannot be stored")
                return False
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                self.fail(loc, "contains an unpaired surrogate, which is not valid UTF-8")
                return False
            return True
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(loc, "contains a non-finite number (NaN or Infinity)")
            return False
        if isinstance(value, dict):
            ok = True
            for key, item in value.items():
                ok = self.storable(key, f"{loc}.{key}", depth + 1) and ok
                ok = self.storable(item, f"{loc}.{key}", depth + 1) and ok
            return ok
        if isinstance(value, list):
            ok = True
            for index, item in enumerate(value):
                ok = self.storable(item, f"{loc}[{index}]", depth + 1) and ok
            return ok
        return True

    def timestamp(self, value: object, loc: str, *, nullable: bool = False) -> datetime | None:
        if value is None and nullable:
            return None
        if not isinstance(value, str):
            self.fail(loc, "must be an ISO 8601 timestamp string" + (" or null" if nullable else ""))
            return None
        moment = _parse_timestamp(value)
        if moment is None:
            if _RFC3339_NO_ZONE.fullmatch(value):
                self.fail(loc, "must carry a time zone (e.g. a trailing Z)")
            else:
                self.fail(loc, f"is not an ISO 8601 timestamp like 2026-11-29T10:00:00Z: {value[:40]!r}")
            return None
        try:
            return moment.astimezone(UTC)
        except OverflowError:  # e.g. 0001-01-01T00:00:00+12:00 is before year 1 in UTC
            self.fail(loc, "is out of range once converted to UTC")
            return None

    def json_object(self, value: object, loc: str) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            self.fail(loc, "must be an object")
            return None
        return value if self.storable(value, loc) else None


# RFC 3339 (JSON Schema's "date-time"): a full date and time with seconds and an offset.
_RFC3339_NO_ZONE = re.compile(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d(:\d\d(\.\d+)?)?")
_RFC3339 = re.compile(r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:(\d\d)(\.\d+)?([Zz]|[+-]\d\d:\d\d)")


def _parse_timestamp(text: str) -> datetime | None:
    """An RFC 3339 timestamp; a leap second counts, as in PostgreSQL, as the next minute's first instant."""
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


def _integral(value: object) -> int | None:
    """A JSON integer as an int: ``5`` and ``5.0`` are one number (JSON Schema agrees); ``true`` is not."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _is_int(value: object) -> bool:
    return _integral(value) is not None


def _check_counters(check: _Checker, owner: dict[str, Any], loc: str) -> bool:
    ok = True
    for name in _USAGE_COUNTERS:
        count = _integral(owner.get(name, 0))
        if count is None or count < 0:
            check.fail(f"{loc}.{name}", "must be a non-negative integer")
            ok = False
    return ok


def _check_usage(check: _Checker, value: object, loc: str) -> dict[str, Any] | None:
    usage = check.json_object(value, loc)
    if usage is None:
        return None
    ok = _check_counters(check, usage, loc)
    calls = usage.get("calls", [])
    if not isinstance(calls, list):
        check.fail(f"{loc}.calls", "must be a list of objects")
        return None
    for index, call in enumerate(calls):
        call_loc = f"{loc}.calls[{index}]"
        if not isinstance(call, dict):
            check.fail(call_loc, "must be an object")
            ok = False
            continue
        ok = _check_counters(check, call, call_loc) and ok
        for key, kinds, wanted in (
            ("purpose", (str,), "a string"),
            ("status", (str,), "a string"),
            ("model", (str, type(None)), "a string or null"),
            ("reported", (bool,), "true or false"),
        ):
            if key in call and not isinstance(call[key], kinds):
                check.fail(f"{call_loc}.{key}", f"must be {wanted}")
                ok = False
    return usage if ok else None


def _check_error(check: _Checker, value: object, loc: str) -> dict[str, Any] | None:
    error = check.json_object(value, loc)
    if error is None:
        return None
    ok = check.text(error.get("code"), f"{loc}.code") and check.text(error.get("message"), f"{loc}.message")
    if "detail" in error and error["detail"] is not None and not isinstance(error["detail"], dict):
        check.fail(f"{loc}.detail", "must be an object or null")
        ok = False
    return error if ok else None


def _check_memory(check: _Checker, value: object, loc: str) -> dict[str, Any] | None:
    memory = check.json_object(value, loc)
    if memory is None:
        return None
    ok = True
    qa_summary = memory.get("qa_summary")
    if qa_summary is not None and not isinstance(qa_summary, dict):
        check.fail(f"{loc}.qa_summary", "must be an object or null")
        ok = False
    summaries = memory.get("context_summaries", [])
    if not isinstance(summaries, list):
        check.fail(f"{loc}.context_summaries", "must be a list")
        return None
    for index, item in enumerate(summaries):
        item_loc = f"{loc}.context_summaries[{index}]"
        if not isinstance(item, dict):
            check.fail(item_loc, "must be an object")
            ok = False
        elif not (isinstance(item.get("key"), str) and item["key"]):
            # The cache is looked up by this key (the content hash of the summarised prefix).
            check.fail(f"{item_loc}.key", "must be a non-empty string")
            ok = False
    if not ok:
        return None
    # Missing parts of the memory are empty, as in a fresh session; extra keys are kept verbatim.
    return {**EMPTY_MEMORY, **memory, "context_summaries": summaries, "qa_summary": qa_summary}


def _check_request(check: _Checker, item: object, loc: str, version: int) -> ArchivedRequest | None:
    if not isinstance(item, dict):
        check.fail(loc, "must be an object")
        return None
    errors_before = len(check.errors)
    unknown = sorted(set(item) - _QUESTION_KEYS[version])
    for key in unknown:
        check.fail(f"{loc}.{key}", f"is not a field of a version {version} archive")
    for key in sorted(_V1_QUESTION_KEYS - set(item)):
        check.fail(f"{loc}.{key}", "is required")

    ordinal = _integral(item.get("ordinal"))
    if "ordinal" in item and not (ordinal is not None and 1 <= ordinal <= _MAX_ORDINAL):
        check.fail(f"{loc}.ordinal", f"must be an integer from 1 to {_MAX_ORDINAL}")
    if "question" in item:
        check.text(item["question"], f"{loc}.question")
    created_at = (
        check.timestamp(item.get("created_at"), f"{loc}.created_at") if "created_at" in item else None
    )

    status = "succeeded"
    if version >= 2 and "status" in item:
        status = item["status"]
        if not isinstance(status, str) or status not in TERMINAL_STATUSES:
            check.fail(
                f"{loc}.status",
                "must be one of succeeded, failed, cancelled (archives hold finished requests only)",
            )
    answer = item.get("answer")
    if "answer" in item:
        # A succeeded request always has its answer; a failed or cancelled one may have none.
        check.text(answer, f"{loc}.answer", nullable=status != "succeeded")

    extras: dict[str, Any] = {}
    if version >= 2:
        if item.get("error") is not None:
            extras["error"] = _check_error(check, item["error"], f"{loc}.error")
        if "usage" in item:
            extras["usage"] = _check_usage(check, item["usage"], f"{loc}.usage")
        for key, max_len in (("model", _MAX_MODEL), ("snapshot_id", _MAX_SNAPSHOT_ID)):
            if key in item:
                check.text(item[key], f"{loc}.{key}", max_len=max_len, nullable=True)
                extras[key] = item[key]
        if "stop_reason" in item:
            check.text(item["stop_reason"], f"{loc}.stop_reason", max_len=_MAX_STOP_REASON, nullable=True)
            extras["stop_reason"] = item["stop_reason"]
        if "truncated" in item:
            if not isinstance(item["truncated"], bool):
                check.fail(f"{loc}.truncated", "must be true or false")
            extras["truncated"] = item["truncated"]
        for key in ("started_at", "finished_at"):
            if key in item:
                extras[key] = check.timestamp(item[key], f"{loc}.{key}", nullable=True)
    if version >= 3 and "context_info" in item:
        extras["context_info"] = check.json_object(item["context_info"], f"{loc}.context_info")
    if version >= 3 and "pinned" in item:
        if not isinstance(item["pinned"], bool):
            check.fail(f"{loc}.pinned", "must be true or false")
        extras["pinned"] = item["pinned"]

    if len(check.errors) != errors_before or created_at is None:
        return None
    assert ordinal is not None
    return ArchivedRequest(
        ordinal=ordinal,
        question=item["question"],
        answer=answer,
        created_at=created_at,
        status=status,
        **{k: v for k, v in extras.items() if v is not None},
    )


def _check_handoffs(check: _Checker, value: object, loc: str) -> list[ArchivedHandoff] | None:
    if not isinstance(value, list):
        check.fail(loc, "must be a list")
        return None
    result: list[ArchivedHandoff] = []
    for index, item in enumerate(value):
        item_loc = f"{loc}[{index}]"
        body = check.json_object(item, item_loc)
        if body is None:
            continue
        errors_before = len(check.errors)
        for key in ("id", "parent_id"):
            if key in body:
                check.fail(f"{item_loc}.{key}", "is not archived (restore gives hand-offs fresh ids)")
        created_at = check.timestamp(body.get("created_at"), f"{item_loc}.created_at")
        if body.get("format") not in _HANDOFF_FORMATS:
            check.fail(f"{item_loc}.format", "must be one of anthropic, openai, text")
        check.text(body.get("text"), f"{item_loc}.text")
        ordinals = body.get("ordinals")
        if not (isinstance(ordinals, list) and ordinals and all(_is_int(o) for o in ordinals)):
            check.fail(f"{item_loc}.ordinals", "must be a non-empty list of integers")
        for key in _HANDOFF_ORDINAL_LISTS[1:]:
            listed = body.get(key, [])
            if not (isinstance(listed, list) and all(_is_int(o) for o in listed)):
                check.fail(f"{item_loc}.{key}", "must be a list of integers")
        message = body.get("message")
        if message is not None and not (
            isinstance(message, dict)
            and message.get("role", "user") == "user"
            and isinstance(message.get("content", ""), str)
        ):
            check.fail(f"{item_loc}.message", 'must be null or {"role": "user", "content": string}')
        for key in ("from_ordinal", "through_ordinal"):
            if body.get(key) is not None and not _is_int(body[key]):
                check.fail(f"{item_loc}.{key}", "must be an integer or null")
        if "estimate_tokens" in body and not _is_int(body["estimate_tokens"]):
            check.fail(f"{item_loc}.estimate_tokens", "must be an integer")
        if "truncated" in body and not isinstance(body["truncated"], bool):
            check.fail(f"{item_loc}.truncated", "must be true or false")
        if len(check.errors) == errors_before and created_at is not None:
            result.append(ArchivedHandoff(created_at=created_at, body=body))
    return result


def _check_settings(check: _Checker, value: object, loc: str) -> dict[str, Any] | None:
    settings = check.json_object(value, loc)
    if settings is None:
        return None
    problems = settings_problems(settings)
    for name, message in problems:
        check.fail(f"{loc}.{name}", message)
    return None if problems else public_settings(settings)


def parse_archive(document: object) -> Archive:
    """Validate an archive of any version and return it as plain values.

    Raises :class:`ArchiveUnreadable` (400) when ``document`` is not an object with a supported
    ``version``, and :class:`ArchiveInvalid` (422) listing every problem otherwise.
    """
    if not isinstance(document, dict):
        raise ArchiveUnreadable("an archive is a JSON object with a version, a parent_id and questions")
    raw_version = document.get("version")
    version = _integral(raw_version)
    if version not in ARCHIVE_VERSIONS:
        raise ArchiveUnreadable(
            f"unsupported archive version {raw_version!r}: supported versions are 1, 2 and 3",
            {"version": raw_version if isinstance(raw_version, (int, float, str)) else None},
        )
    assert version is not None
    check = _Checker()
    for key in sorted(set(document) - _TOP_KEYS[version]):
        check.fail(key, f"is not a field of a version {version} archive")
    parent_id = document.get("parent_id")
    if "parent_id" not in document:
        check.fail("parent_id", "is required")
    elif check.text(parent_id, "parent_id", max_len=_MAX_PARENT_ID) and not parent_id:
        check.fail("parent_id", "must not be empty")
    if "exported_at" in document:
        check.timestamp(document["exported_at"], "exported_at")

    memory: dict[str, Any] | None = dict(EMPTY_MEMORY)
    handoffs: list[ArchivedHandoff] | None = []
    handed_off_through: int | None = 0
    settings: dict[str, Any] | None = None
    if version >= 3 and "session" in document:
        session = document["session"]
        if not isinstance(session, dict):
            check.fail("session", "must be an object")
        else:
            for key in sorted(set(session) - _V3_SESSION_KEYS):
                check.fail(f"session.{key}", "is not a field of a version 3 archive")
            if "memory" in session:
                memory = _check_memory(check, session["memory"], "session.memory")
            if "handoffs" in session:
                handoffs = _check_handoffs(check, session["handoffs"], "session.handoffs")
            if "handed_off_through" in session:
                handed_off_through = _integral(session["handed_off_through"])
                if handed_off_through is None or not 0 <= handed_off_through <= _MAX_ORDINAL:
                    check.fail("session.handed_off_through", f"must be an integer from 0 to {_MAX_ORDINAL}")
            if "settings" in session:
                settings = _check_settings(check, session["settings"], "session.settings")

    questions = document.get("questions")
    requests: list[ArchivedRequest] = []
    if not isinstance(questions, list):
        check.fail("questions", "is required and must be a list")
    else:
        seen: dict[int, int] = {}
        for index, item in enumerate(questions):
            parsed = _check_request(check, item, f"questions[{index}]", version)
            if parsed is None:
                continue
            if parsed.ordinal in seen:
                check.fail(
                    f"questions[{index}].ordinal",
                    f"ordinal {parsed.ordinal} repeats questions[{seen[parsed.ordinal]}]",
                )
                continue
            seen[parsed.ordinal] = index
            requests.append(parsed)

    if check.errors:
        first = check.errors[0]
        more = f" (and {len(check.errors) - 1} more)" if len(check.errors) > 1 else ""
        raise ArchiveInvalid(
            f"invalid version {version} archive: {first['loc']} {first['message']}{more}",
            {"errors": check.errors},
        )
    assert isinstance(parent_id, str) and memory is not None
    assert handoffs is not None and handed_off_through is not None
    return Archive(
        version=version,
        parent_id=parent_id,
        memory=memory,
        requests=tuple(sorted(requests, key=lambda r: r.ordinal)),
        handoffs=tuple(sorted(handoffs, key=lambda h: h.created_at)),
        handed_off_through=handed_off_through,
        settings=settings,
    )


# --------------------------------------------------------------------------------------------
# JSON Schemas (pure): the one source of docs/archive/v*.schema.json and of the OpenAPI body.

_TIMESTAMP_NOTE: Final = (
    "ISO 8601 / RFC 3339 with a time zone; exports write UTC with microseconds, "
    "e.g. 2026-11-29T10:00:00.123456Z"
)


# PostgreSQL cannot store NUL (U+0000) in text or JSONB: every string the service stores says so.
NO_NUL_PATTERN: Final = "^[^\\u0000]*$"
STORABLE_JSON: Final = "StorableJson"
STORABLE_OBJECT: Final = "StorableObject"
OPENAPI_REFS: Final = "#/components/schemas/"
STANDALONE_REFS: Final = "#/$defs/"


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


def _text(schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """A string schema (or ``schema``) that also refuses NUL, as :func:`parse_archive` does."""
    return {"type": "string", **(schema or {}), "pattern": NO_NUL_PATTERN}


def _object(refs: str, schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (an open object) whose other keys and values hold no NUL either."""
    return {
        **schema,
        "propertyNames": {"pattern": NO_NUL_PATTERN},
        "additionalProperties": {"$ref": refs + STORABLE_JSON},
    }


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    kind = schema["type"]
    return {**schema, "type": [kind, "null"]}


def _question_schema(version: int, refs: str = STANDALONE_REFS) -> dict[str, Any]:
    timestamp: dict[str, Any] = {"type": "string", "format": "date-time", "description": _TIMESTAMP_NOTE}
    properties: dict[str, Any] = {
        "ordinal": {
            "type": "integer",
            "minimum": 1,
            "maximum": _MAX_ORDINAL,
            "description": "identifies the request within its session; kept by restore; unique in an archive",
        },
        "question": _text(),
        "answer": _text(),
        "created_at": timestamp,
    }
    schema: dict[str, Any] = {
        "type": "object",
        "required": ["ordinal", "question", "answer", "created_at"],
        "additionalProperties": False,
        "properties": properties,
    }
    if version >= 2:
        counters = {name: {"type": "integer", "minimum": 0} for name in _USAGE_COUNTERS}
        call = _object(
            refs,
            {
                "type": "object",
                "properties": {
                    "purpose": _text(),
                    "model": _text({"type": ["string", "null"]}),
                    "status": _text(),
                    "reported": {"type": "boolean"},
                    **counters,
                },
            },
        )
        properties.update(
            answer=_text(
                {"type": ["string", "null"], "description": "required text when status is succeeded"}
            ),
            status={
                "enum": sorted(TERMINAL_STATUSES, reverse=True),
                "default": "succeeded",
                "description": "archives hold finished requests only",
            },
            error=_object(
                refs,
                {
                    "type": ["object", "null"],
                    "required": ["code", "message"],
                    "properties": {
                        "code": _text(),
                        "message": _text(),
                        "detail": {"anyOf": [{"$ref": refs + STORABLE_OBJECT}, {"type": "null"}]},
                    },
                    "default": None,
                },
            ),
            usage=_object(
                refs,
                {
                    "type": "object",
                    "description": "cumulative usage (SPEC §3); missing → zeros and no calls",
                    "properties": {**counters, "calls": {"type": "array", "items": call}},
                },
            ),
            model=_nullable(_text({"maxLength": _MAX_MODEL})),
            started_at=_nullable(timestamp),
            finished_at=_nullable(timestamp),
            snapshot_id=_nullable(
                _text(
                    {
                        "maxLength": _MAX_SNAPSHOT_ID,
                        "description": "a reference only: archives carry no snapshot content",
                    }
                )
            ),
            truncated={"type": "boolean", "default": False},
            stop_reason=_nullable(_text({"maxLength": _MAX_STOP_REASON})),
        )
        schema["allOf"] = [
            {
                "if": {"properties": {"status": {"const": "succeeded"}}},
                "then": {"properties": {"answer": {"type": "string"}}},
            }
        ]
    if version >= 3:
        properties["context_info"] = _object(
            refs,
            {
                "type": "object",
                "default": {},
                "description": "the request's budget report (SPEC §3 context_info); missing → {}",
            },
        )
        properties["pinned"] = {
            "type": "boolean",
            "default": False,
            "description": "pinned for the next hand-off (SPEC §11.1); missing → false",
        }
    return schema


def _settings_schema() -> dict[str, Any]:
    nullable_text = {"type": ["string", "null"], "default": None}
    return {
        "type": "object",
        "additionalProperties": False,
        "description": "the session's settings (SPEC §11.2); missing → the session keeps its own",
        "properties": {
            "summary_instructions": {
                **nullable_text,
                "maxLength": 4096,
                "description": "at most 4096 bytes of UTF-8",
            },
            "summary_model": {**nullable_text, "minLength": 1, "maxLength": 200},
            "answer_model": {**nullable_text, "minLength": 1, "maxLength": 200},
            "context_window": {
                "type": ["integer", "null"],
                "minimum": 1024,
                "maximum": 10_000_000,
                "default": None,
            },
            "max_output_tokens": {
                "type": ["integer", "null"],
                "minimum": 256,
                "maximum": 32768,
                "default": None,
            },
            "on_busy": {"enum": ["enqueue", "reject", "interrupt", None], "default": None},
        },
    }


def _handoff_schema() -> dict[str, Any]:
    ordinals = {"type": "array", "items": {"type": "integer"}}
    return {
        "type": "object",
        "required": ["created_at", "format", "ordinals", "text"],
        "description": "a hand-off (SPEC §11.1) without its id and parent_id",
        "properties": {
            "created_at": {"type": "string", "format": "date-time"},
            "format": {"enum": list(_HANDOFF_FORMATS)},
            "ordinals": {**ordinals, "minItems": 1},
            "from_ordinal": {"type": ["integer", "null"]},
            "through_ordinal": {"type": ["integer", "null"]},
            "estimate_tokens": {"type": "integer"},
            **{key: ordinals for key in _HANDOFF_ORDINAL_LISTS[1:]},
            "truncated": {"type": "boolean"},
            "message": {
                "type": ["object", "null"],
                "properties": {"role": {"const": "user"}, "content": {"type": "string"}},
            },
            "text": {"type": "string"},
        },
        "not": {"anyOf": [{"required": ["id"]}, {"required": ["parent_id"]}]},
    }


_DESCRIPTIONS: Final = {
    1: "Questions and answers only; holds succeeded requests and restores as succeeded history.",
    2: "Adds each request's outcome: status, error, usage, model, timings, snapshot reference "
    "(and truncated, stop_reason).",
    3: "Adds the session's memory (rolling Q&A summary, context-summary cache) and each request's "
    "context_info; and the session's hand-offs, handed_off_through and settings, and each request's pinned.",
}


def archive_json_schema(version: int, *, standalone: bool = True) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a version ``version`` archive.

    ``standalone`` adds ``$schema``/``$id`` for the published files and carries the NUL-free JSON
    definitions (:func:`storable_json_defs`) in its own ``$defs``; an OpenAPI document embeds the
    schema without them and refers to ``#/components/schemas/`` instead (the app adds them there).
    What a schema cannot say is checked by :func:`parse_archive` (unique ordinals).
    """
    refs = STANDALONE_REFS if standalone else OPENAPI_REFS
    if version not in ARCHIVE_VERSIONS:
        raise ValueError(f"no archive version {version}")
    properties: dict[str, Any] = {
        "version": {"const": version},
        "parent_id": _text(
            {
                "minLength": 1,
                "maxLength": _MAX_PARENT_ID,
                "description": "the session it was exported from; restore uses the parent id of its URL",
            }
        ),
        "exported_at": {
            "type": "string",
            "format": "date-time",
            "description": "when the archive was written (informational; ignored by restore)",
        },
    }
    if version >= 3:
        properties["session"] = {
            "type": "object",
            "additionalProperties": False,
            "description": "missing → empty memory",
            "properties": {
                "memory": _object(
                    refs,
                    {
                        "type": "object",
                        "description": "the session's memory; missing parts are empty, other keys are kept",
                        "properties": {
                            "qa_summary": {
                                "anyOf": [{"$ref": refs + STORABLE_OBJECT}, {"type": "null"}],
                                "default": None,
                                "description": "the rolling Q&A summary (document and provenance)",
                            },
                            "context_summaries": {
                                "type": "array",
                                "default": [],
                                "description": "the context-summary cache, keyed by the content hash of "
                                "the summarised prefix",
                                "items": _object(
                                    refs,
                                    {
                                        "type": "object",
                                        "required": ["key"],
                                        "properties": {"key": _text({"minLength": 1})},
                                    },
                                ),
                            },
                        },
                    },
                ),
                "handoffs": {
                    "type": "array",
                    "default": [],
                    "description": "the session's hand-offs, oldest first; missing → none",
                    "items": _handoff_schema(),
                },
                "handed_off_through": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": _MAX_ORDINAL,
                    "default": 0,
                    "description": "highest ordinal handed off (SPEC §11.1); missing → 0",
                },
                "settings": _settings_schema(),
            },
        }
    properties["questions"] = {
        "type": "array",
        "description": "finished requests in ascending ordinal",
        "items": _question_schema(version, refs),
    }
    schema: dict[str, Any] = {
        "title": f"Sidequest side-question archive, version {version}",
        "description": _DESCRIPTIONS[version],
        "type": "object",
        "required": ["version", "parent_id", "questions"],
        "additionalProperties": False,
        "properties": properties,
    }
    if standalone:
        return {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"urn:sidequest:archive:v{version}",
            **schema,
            "$defs": storable_json_defs(STANDALONE_REFS),
        }
    return schema


# --------------------------------------------------------------------------------------------
# Encoding (pure): rows → the document of one version.


def archive_time(moment: datetime | None) -> str | None:
    """UTC, microseconds, ``Z`` and a four-digit year (``strftime("%Y")`` drops the zeros of year 2)."""
    if moment is None:
        return None
    return moment.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def encode_request(row: RequestRow, version: int) -> dict[str, Any]:
    """One request in the given archive version; no request id (ordinals identify requests)."""
    item: dict[str, Any] = {
        "ordinal": row.ordinal,
        "question": row.question,
        "answer": row.answer,
        "created_at": archive_time(row.created_at),
    }
    if version >= 2:
        item.update(
            status=row.status,
            error=row.error,
            usage=row.usage or json.loads(json.dumps(EMPTY_USAGE)),
            model=row.model,
            started_at=archive_time(row.started_at),
            finished_at=archive_time(row.finished_at),
            snapshot_id=row.snapshot_id,
            truncated=row.truncated,
            stop_reason=row.stop_reason,
        )
    if version >= 3:
        item["context_info"] = row.context_info or {}
        item["pinned"] = row.pinned
    return item


def encode_archive(
    version: int,
    parent_id: str,
    memory: dict[str, Any] | None,
    rows: Sequence[RequestRow],
    exported_at: datetime | None = None,
    *,
    handoffs: Sequence[dict[str, Any]] = (),
    handed_off_through: int = 0,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The archive document; ``rows`` must already be the exportable requests in ordinal order and
    ``handoffs`` the hand-off bodies oldest first (v3 only)."""
    if version not in ARCHIVE_VERSIONS:
        raise ArchiveUnreadable(f"unsupported archive version {version!r}: supported versions are 1, 2 and 3")
    document: dict[str, Any] = {
        "version": version,
        "parent_id": parent_id,
        "exported_at": archive_time(exported_at or datetime.now(UTC)),
    }
    if version >= 3:
        document["session"] = {
            "memory": {**EMPTY_MEMORY, **(memory or {})},
            "handoffs": [dict(body) for body in handoffs],
            "handed_off_through": handed_off_through,
            "settings": public_settings(settings),
        }
    document["questions"] = [encode_request(row, version) for row in rows]
    return document


# --------------------------------------------------------------------------------------------
# SQL: export and restore.


async def export_archive(session: AsyncSession, tenant: str, parent_id: str, version: int) -> dict[str, Any]:
    """Export the session's finished history as a version ``version`` archive.

    Raises :class:`SessionNotFound` when the tenant has no such session. The memory is read before
    the requests: memory is written while a request runs, so the requests read after it are at least
    as new as anything the memory covers.
    """
    if version not in ARCHIVE_VERSIONS:
        raise ArchiveUnreadable(f"unsupported archive version {version!r}: supported versions are 1, 2 and 3")
    row = await find_session(session, tenant, parent_id)
    if row is None:
        raise SessionNotFound(f"no session {parent_id!r}")
    exportable = ("succeeded",) if version == 1 else tuple(sorted(TERMINAL_STATUSES))
    rows = (
        await session.scalars(
            select(RequestRow)
            .where(
                RequestRow.session_id == row.id,
                RequestRow.deleted_at.is_(None),
                RequestRow.status.in_(exportable),
            )
            .order_by(RequestRow.ordinal)
        )
    ).all()
    bodies = list(
        await session.scalars(
            select(HandoffRow.body)
            .where(HandoffRow.session_id == row.id)
            .order_by(HandoffRow.created_at, HandoffRow.id)
        )
    )
    return encode_archive(
        version,
        parent_id,
        row.memory,
        rows,
        handoffs=bodies,
        handed_off_through=row.handed_off_through,
        settings=row.settings,
    )


def _terminal_events(row: RequestRow, parent_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The two events a finished request ends its stream with: its terminal status, then done/error."""
    events: list[tuple[str, dict[str, Any]]] = [("status", {"status": row.status, "stage": row.stage})]
    if row.status == "succeeded":
        events.append(("done", {"record": request_record(row, parent_id)}))
    else:
        error = row.error or {}
        events.append(
            (
                "error",
                {
                    "code": error.get("code", row.status),
                    "message": error.get("message", f"the request was {row.status}"),
                    "detail": error.get("detail") or {},
                },
            )
        )
    return events


async def restore_archive(
    session: AsyncSession,
    tenant: str,
    parent_id: str,
    archive: Archive,
    *,
    replace: bool = False,
) -> RestoreResult:
    """Write ``archive`` into the session (tenant, parent_id), creating it if needed, and commit.

    Everything happens in the caller's session's one transaction, committed at the end and rolled
    back on any failure, so a refused restore writes nothing. Raises :class:`SessionHasHistory`
    when the session has history and ``replace`` is false, :class:`SessionBusy` when ``replace`` is
    asked while requests are queued or running.
    """
    try:
        result = await _restore(session, tenant, parent_id, archive, replace=replace)
    except BaseException:
        await session.rollback()
        raise
    await session.commit()
    return result


async def _restore(
    session: AsyncSession, tenant: str, parent_id: str, archive: Archive, *, replace: bool
) -> RestoreResult:
    target = await lock_or_create_session(session, tenant, parent_id)
    live = (
        await session.execute(
            select(RequestRow.status, func.count())
            .where(RequestRow.session_id == target.id, RequestRow.deleted_at.is_(None))
            .group_by(RequestRow.status)
        )
    ).all()
    counts = {status: count for status, count in live}
    existing = sum(counts.values())
    in_flight = sum(n for status, n in counts.items() if status not in TERMINAL_STATUSES)
    if existing and not replace:
        raise SessionHasHistory(
            f"session {parent_id!r} already has {existing} requests; "
            "restore with mode=replace to discard them, or restore under another parent id",
            {"requests": existing},
        )
    if in_flight:
        raise SessionBusy(
            f"session {parent_id!r} has {in_flight} queued or running requests; "
            "cancel them or clear the session before replacing its history",
            {"in_flight": in_flight},
        )

    clear_version = target.clear_version
    if replace and existing:
        # Replacing is a clear followed by a restore: bump clear_version like a clear does, so no
        # summary computed for the old history can ever be written over the restored memory.
        clear_version += 1
        # The old requests are hidden like a clear hides them (their finished streams stay readable
        # until the sweep purges them), unless the archive reuses their ordinal (purged below).
        await session.execute(
            update(RequestRow)
            .where(RequestRow.session_id == target.id, RequestRow.deleted_at.is_(None))
            .values(deleted_at=func.now())
            .execution_options(synchronize_session=False)
        )
    ordinals = [r.ordinal for r in archive.requests]
    if ordinals:
        # Cleared requests still occupy their ordinals until the sweep purges them; the archive's
        # ordinals win (they are already invisible, 404, to every client).
        await session.execute(
            delete(RequestRow)
            .where(
                RequestRow.session_id == target.id,
                RequestRow.deleted_at.is_not(None),
                RequestRow.ordinal.in_(ordinals),
            )
            .execution_options(synchronize_session=False)
        )
    next_ordinal = max([target.next_ordinal, *(o + 1 for o in ordinals)])
    session_values: dict[str, Any] = {
        "memory": archive.memory,
        "clear_version": clear_version,
        "next_ordinal": next_ordinal,
        "handed_off_through": archive.handed_off_through,
        "updated_at": func.now(),
    }
    if archive.settings is not None:
        # Only set fields are stored (unset ones are absent, as after a PUT with null).
        session_values["settings"] = {
            k: v for k, v in archive.settings.items() if k in SETTINGS_FIELDS and v is not None
        }
    await session.execute(update(SessionRow).where(SessionRow.id == target.id).values(**session_values))
    # The hand-offs belong to the history being restored: earlier ones of this session go with it.
    await session.execute(delete(HandoffRow).where(HandoffRow.session_id == target.id))
    session.add_all(
        HandoffRow(
            id=uuid.uuid4(),
            session_id=target.id,
            body=item.body,
            through_ordinal=_integral(item.body.get("through_ordinal")),
            created_at=item.created_at,
        )
        for item in archive.handoffs
    )

    rows = [
        RequestRow(
            id=uuid.uuid4(),
            session_id=target.id,
            ordinal=item.ordinal,
            question=item.question,
            snapshot_id=item.snapshot_id,
            status=item.status,
            stage=None,
            answer=item.answer,
            truncated=item.truncated,
            stop_reason=item.stop_reason,
            error=item.error,
            usage=item.usage,
            context_info=item.context_info,
            options={},
            clear_version=clear_version,
            model=item.model,
            attempt=0,
            event_seq=2,
            pinned=item.pinned and item.status == "succeeded",
            created_at=item.created_at,
            started_at=item.started_at,
            finished_at=item.finished_at,
        )
        for item in archive.requests
    ]
    session.add_all(rows)
    await session.flush()

    if rows:
        # Same ordering rule as append_event: global event ids of a session are allocated under
        # its advisory lock. One NOTIFY is enough: it is a wake-up call, readers read the rows.
        await session.execute(
            text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 7))"), {"key": str(target.id)}
        )
        at = utc_iso()
        events = []
        for row in rows:
            for seq, (event_type, fields) in enumerate(_terminal_events(row, parent_id), start=1):
                data = {"request_id": str(row.id), "ordinal": row.ordinal, "seq": seq, "at": at, **fields}
                events.append(
                    EventRow(request_id=row.id, session_id=target.id, seq=seq, type=event_type, data=data)
                )
        session.add_all(events)
        await session.flush()
        payload = json.dumps(
            {"id": events[-1].id, "request_id": str(rows[-1].id), "session_id": str(target.id)}
        )
        await session.execute(
            text("SELECT pg_notify(:channel, :payload)"), {"channel": NOTIFY_CHANNEL, "payload": payload}
        )

    return RestoreResult(
        parent_id=parent_id,
        version=archive.version,
        restored=len(rows),
        replaced=existing if replace else 0,
        next_ordinal=next_ordinal,
        clear_version=clear_version,
    )
