"""An archive document to plain values ready to write (:func:`parse_archive`) and back
(:func:`encode_archive`). A refused archive is a 422 listing pydantic's own errors, each at its
location in the archive, and the few problems no model can see (docs/archive.md, "Errors").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from pydantic import ValidationError

from service.archive.model import QUESTION_FIELDS, ArchiveV3, public_settings
from service.archive.schema import ARCHIVE_VERSIONS
from service.archive.upgrade import upgrade
from service.errors import SidequestError
from service.vocabulary import NotJson, Status, integral, iso_or_none, strict_json, unstorable_reason, utc_iso

# A malformed archive may have thousands of problems; the first ones are enough to fix it.
_MAX_REPORTED_ERRORS: Final = 50
# Deeper than any object the service writes, and shallow enough for a recursive walk.
_MAX_DEPTH: Final = 64
_HANDOFF_ORDINALS: Final = ("ordinals", "summarized_ordinals", "shortened_ordinals", "omitted_ordinals")
# The error detail that names another request by its id: a superseded request's (SPEC §11.2).
SUPERSEDED_BY: Final = "superseded_by"

Loc = tuple[str | int, ...]


class ArchiveError(SidequestError):
    """A refused export or restore (the API answers with its status, code, message and detail)."""

    status = 400
    code = "invalid_archive"


class ArchiveUnreadable(ArchiveError):
    """The body is not a JSON object with a supported ``version`` (400)."""


class ArchiveInvalid(ArchiveError):
    """An archive of a known version that breaks its format (422); ``detail.errors`` lists where."""

    status = 422


@dataclass(frozen=True)
class ArchivedRequest:
    """One request as an archive carries it (``usage`` None where the archive has none: the store's
    empty usage). Both builders (the parser, the store's export) give every field."""

    ordinal: int
    question: str
    answer: str | None
    created_at: datetime
    status: str
    error: dict[str, Any] | None
    usage: dict[str, Any] | None
    model: str | None
    started_at: datetime | None
    finished_at: datetime | None
    snapshot_id: str | None
    truncated: bool
    stop_reason: str | None
    context_info: dict[str, Any]
    pinned: bool


@dataclass(frozen=True)
class ArchivedHandoff:
    """One hand-off: its public object without ``id`` / ``parent_id`` (restore gives fresh ones)."""

    created_at: datetime
    body: dict[str, Any]
    through_ordinal: int | None


@dataclass(frozen=True)
class Archive:
    """An archive of any version, requests in ordinal order. ``memory`` is None when the archive has
    none (an empty memory then; a missing part of it is empty too), ``settings`` when it has none (the
    session's own are kept)."""

    version: int
    parent_id: str
    requests: tuple[ArchivedRequest, ...]
    memory: dict[str, Any] | None
    handoffs: tuple[ArchivedHandoff, ...]
    handed_off_through: int
    settings: dict[str, Any] | None


def load_archive_json(body: bytes | str) -> object:
    """Decode an archive body; anything that is not JSON is a 400 with the parser's reason."""
    try:
        return strict_json(body)
    except NotJson as exc:
        raise ArchiveUnreadable(f"the archive is not valid JSON: {exc}") from None


def _find_unstorable(value: object, path: list[str | int], found: list[tuple[Loc, str]]) -> None:
    """Add to ``found`` where in ``value`` PostgreSQL would refuse it (NUL, unpaired surrogates,
    non-finite numbers). One path, copied only where there is a problem: archives hold megabytes of
    usage and context_info, nearly all of it fine."""
    if len(path) > _MAX_DEPTH:
        found.append((tuple(path), "is nested too deeply"))
    elif isinstance(value, str):
        if (why := unstorable_reason(value)) is not None:
            found.append((tuple(path), why))
    elif isinstance(value, dict):
        for key, item in value.items():
            path.append(key)
            _find_unstorable(key, path, found)
            _find_unstorable(item, path, found)
            path.pop()
    elif isinstance(value, list):
        for index, item in enumerate(value):
            path.append(index)
            _find_unstorable(item, path, found)
            path.pop()
    elif isinstance(value, float) and not math.isfinite(value):
        found.append((tuple(path), "must be a finite number"))


def _question_index(problem: tuple[Loc, str]) -> int:
    """The index of the question a problem is in; -1 for the document's own."""
    loc = problem[0]
    return loc[1] if len(loc) > 1 and loc[0] == "questions" and isinstance(loc[1], int) else -1


def _loc_text(loc: Loc) -> str:
    """``("questions", 0, "usage")`` as ``questions[0].usage``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _rule_problems(questions: list[Any], failed: set[int], max_bytes: int | None) -> list[tuple[Loc, str]]:
    """Repeated ordinals, and questions over the service's question limit (a restore makes no history
    no client could have asked), among the questions without problems of their own: each of those is
    a valid ``Question``, so its ordinal is an integer (5.0 too) and its question a string."""
    found: list[tuple[Loc, str]] = []
    seen: dict[int, int] = {}
    for index, item in enumerate(questions):
        if index in failed:
            continue
        if (ordinal := int(item["ordinal"])) in seen:
            message = f"ordinal {ordinal} repeats questions[{seen[ordinal]}]"
            found.append((("questions", index, "ordinal"), message))
        seen.setdefault(ordinal, index)
        if max_bytes is not None and (size := len(item["question"].encode("utf-8"))) > max_bytes:
            message = f"is {size} bytes of UTF-8, over the limit of {max_bytes} a question may have"
            found.append((("questions", index, "question"), message))
    return found


def _handoff_problems(parsed: ArchiveV3) -> list[tuple[Loc, str]]:
    """A ``handed_off_through`` beyond the archive's ordinals, or a hand-off naming an ordinal that is
    not a succeeded request of it; no export has either (docs/archive.md, "Hand-offs, settings and
    pins", says what each would break)."""
    highest = max((q.ordinal for q in parsed.questions), default=0)
    succeeded = {q.ordinal for q in parsed.questions if q.status == Status.SUCCEEDED.value}
    found: list[tuple[Loc, str]] = []
    if (through := parsed.session.handed_off_through) > highest:
        message = f"is {through}, beyond the archive's highest ordinal ({highest})"
        found.append((("session", "handed_off_through"), message))
    for index, handoff in enumerate(parsed.session.handoffs):
        named = [o for key in _HANDOFF_ORDINALS for o in getattr(handoff, key) or []]
        named += [o for o in (handoff.from_ordinal, handoff.through_ordinal) if o is not None]
        if others := set(named) - succeeded:
            where = "not a succeeded request of the archive"
            if max(others) > highest:
                where = "beyond the archive's highest ordinal"
            found.append((("session", "handoffs", index), f"names ordinal {max(others)}, {where}"))
    return found


def parse_archive(document: object, *, max_question_bytes: int | None = None) -> Archive:
    """Validate an archive of any version and return it as plain values (``max_question_bytes``: the
    service's question limit, which a restored question keeps too). Raises :class:`ArchiveUnreadable`
    (400) without a supported ``version``, else :class:`ArchiveInvalid` (422) listing every problem."""
    if not isinstance(document, dict):
        raise ArchiveUnreadable("an archive is a JSON object with a version, a parent_id and questions")
    version = integral(given := document.get("version"))
    if version not in ARCHIVE_VERSIONS:
        named = "the archive has no version" if given is None else f"unsupported archive version {given!r}"
        detail = {"version": given if isinstance(given, int | float | str) else None}
        raise ArchiveUnreadable(f"{named}: supported versions are 1, 2 and 3", detail)
    upgraded, errors = upgrade(document, version)
    problems: list[tuple[Loc, str]] = []
    _find_unstorable(document, [], problems)
    parsed: ArchiveV3 | None = None
    try:
        parsed = ArchiveV3.model_validate(upgraded)
    except ValidationError as exc:
        errors += exc.errors(include_url=False, include_context=False)
    # A value PostgreSQL cannot store is reported as that, not also as the wrong type it is.
    unstorable = {loc for loc, _ in problems}
    problems += [(e["loc"], e["msg"]) for e in errors if e["loc"] not in unstorable]
    if isinstance(questions := upgraded.get("questions"), list):
        failed = {index for problem in problems if (index := _question_index(problem)) >= 0}
        problems += _rule_problems(questions, failed, max_question_bytes)
    if parsed is not None:
        problems += _handoff_problems(parsed)
    if problems:
        # The document's own problems first, then each question's, in order.
        problems.sort(key=_question_index)
        listed = [{"loc": _loc_text(loc), "message": message} for loc, message in problems]
        more = f" (and {len(listed) - 1} more)" if len(listed) > 1 else ""
        first = listed[0]
        message = f"invalid version {version} archive: {first['loc']} {first['message']}{more}"
        raise ArchiveInvalid(message, {"errors": listed[:_MAX_REPORTED_ERRORS]})
    assert parsed is not None
    return _archive(parsed, upgraded, version)


def _archive(parsed: ArchiveV3, raw: dict[str, Any], version: int) -> Archive:
    """The validated archive as plain values, with the JSON PostgreSQL keeps as the archive has it."""
    requests = [
        ArchivedRequest(
            **{
                **{name: getattr(q, name) for name in QUESTION_FIELDS[3]},
                "error": archived_error(item.get("error"), {}),
                "usage": item.get("usage"),
                "context_info": item.get("context_info", {}),
            }
        )
        for q, item in zip(parsed.questions, raw["questions"], strict=True)
    ]
    session, raw_session = parsed.session, raw.get("session", {})
    handoffs = [
        ArchivedHandoff(h.created_at, body, h.through_ordinal)
        for h, body in zip(session.handoffs, raw_session.get("handoffs", []), strict=True)
    ]
    return Archive(
        version,
        parsed.parent_id,
        tuple(sorted(requests, key=lambda r: r.ordinal)),
        memory=raw_session.get("memory"),
        handoffs=tuple(sorted(handoffs, key=lambda h: h.created_at)),
        handed_off_through=session.handed_off_through,
        settings=None if session.settings is None else session.settings.model_dump(),
    )


def archived_error(error: dict[str, Any] | None, ordinal_of: Mapping[str, int]) -> dict[str, Any] | None:
    """A request's error as an archive holds it (docs/archive.md): no request ids, so the one that
    superseded it is named by its ordinal from ``ordinal_of`` (request id → ordinal), or left out."""
    detail = error.get("detail") if error else None
    if error is None or not isinstance(detail, dict) or SUPERSEDED_BY not in detail:
        return error
    detail = dict(detail)
    ordinal = ordinal_of.get(str(detail.pop(SUPERSEDED_BY)))
    if ordinal is not None:
        detail["superseded_by_ordinal"] = ordinal
    return {**error, "detail": detail}


def superseding_ids(errors: Iterable[dict[str, Any] | None]) -> set[str]:
    """The ids of the requests that superseded the ones with these errors (for :func:`archived_error`)."""
    details = [error.get("detail") for error in errors if error]
    return {str(d[SUPERSEDED_BY]) for d in details if isinstance(d, dict) and SUPERSEDED_BY in d}


def _encode_request(request: ArchivedRequest, version: int) -> dict[str, Any]:
    values = {name: getattr(request, name) for name in QUESTION_FIELDS[version]}
    return {name: iso_or_none(v) if isinstance(v, datetime) else v for name, v in values.items()}


def encode_archive(archive: Archive) -> dict[str, Any]:
    """The document of ``archive`` in its version: no request ids (ordinals identify requests); a v3
    session with every part, its settings with all their fields (null when unset)."""
    document: dict[str, Any] = {
        "version": archive.version,
        "parent_id": archive.parent_id,
        "exported_at": utc_iso(),
    }
    if archive.version >= 3:
        document["session"] = {
            "memory": archive.memory,
            "handoffs": [dict(h.body) for h in archive.handoffs],
            "handed_off_through": archive.handed_off_through,
            "settings": public_settings(archive.settings or {}),
        }
    document["questions"] = [_encode_request(r, archive.version) for r in archive.requests]
    return document
