"""The archive codec (SPEC §10): an archive document to plain values ready to write
(:func:`parse_archive`, validated by the models of :mod:`service.store.archive_schema`) and rows back
to a document of any version (:func:`encode_archive`). Pure: export and restore, the SQL, live in
:mod:`service.store.archive`.

Every problem of a refused archive is reported with its location (``questions[0].usage.calls[1].model``)
in our own words, as SPEC's ``invalid_archive`` detail ``{"errors": [{"loc", "message"}, …]}``. What
PostgreSQL keeps as JSON (usage, error, context_info, memory, hand-off bodies) is validated and then
stored verbatim. What a schema cannot say is checked here (unique ordinals).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Final

from pydantic import ValidationError

from service.errors import SidequestError
from service.store.archive_fields import ARCHIVE_VERSIONS, Loc, loc_text, problem_message
from service.store.archive_schema import (
    MODELS,
    ArchiveV1,
    ArchiveV2,
    ArchiveV3,
    QuestionV1,
    QuestionV2,
    QuestionV3,
)
from service.store.models import EMPTY_MEMORY, RequestRow
from service.store.records import EMPTY_USAGE
from service.store.settings import public_settings
from service.vocabulary import NotJson, Status, integral, iso_or_none, strict_json, utc_iso

# A malformed archive may have thousands of problems; the first ones are enough to fix it.
_MAX_REPORTED_ERRORS: Final = 50


# --------------------------------------------------------------------------------------------
# Errors and the parsed archive.


class ArchiveError(SidequestError):
    """A refused export or restore (the API answers with its status, code, message and detail)."""

    status = 400
    code = "invalid_archive"


class ArchiveUnreadable(ArchiveError):
    """The body is not a JSON object with a supported ``version`` (400)."""

    status = 400
    code = "invalid_archive"


class ArchiveInvalid(ArchiveError):
    """An archive of a known version that breaks its format (422); ``detail.errors`` lists where."""

    status = 422
    code = "invalid_archive"


@dataclass(frozen=True)
class ArchivedRequest:
    """One request as an archive carries it (defaults are what an older version implies)."""

    ordinal: int
    question: str
    answer: str | None
    created_at: datetime
    status: str = Status.SUCCEEDED
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
    through_ordinal: int | None = None


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


# --------------------------------------------------------------------------------------------
# Decoding: a document → Archive.


def load_archive_json(body: bytes | str) -> object:
    """Decode an archive body; anything that is not JSON is a 400 with the parser's reason."""
    try:
        return strict_json(body)
    except NotJson as exc:
        raise ArchiveUnreadable(f"the archive is not valid JSON: {exc}") from None


def _unsupported(version: object) -> ArchiveUnreadable:
    named = "the archive has no version" if version is None else f"unsupported archive version {version!r}"
    return ArchiveUnreadable(
        f"{named}: supported versions are 1, 2 and 3",
        {"version": version if isinstance(version, (int, float, str)) else None},
    )


# Every list of ordinals a recorded hand-off names (SPEC §11.1, and the left-out and shortened ones).
_HANDOFF_ORDINAL_LISTS: Final = ("ordinals", "summarized_ordinals", "shortened_ordinals", "omitted_ordinals")


def _watermark_problems(parsed: ArchiveV1 | ArchiveV2 | ArchiveV3) -> list[tuple[Loc, str]]:
    """``handed_off_through`` beyond every ordinal of the archive, or a recorded hand-off naming an
    ordinal that is not a succeeded request of the archive: the session's next questions would then
    count as handed off already and never come in an ``include: "new"`` hand-off, and the hand-off
    would name Q&A the session never had to hand off (SPEC §11.1: a hand-off carries succeeded
    requests only; a clear deletes hand-offs with the history). An exported archive never has such a
    one."""
    if not isinstance(parsed, ArchiveV3) or parsed.session is None:
        return []
    through = parsed.session.handed_off_through
    highest = max((q.ordinal for q in parsed.questions), default=0)
    succeeded = {q.ordinal for q in parsed.questions if q.status == Status.SUCCEEDED}
    problems: list[tuple[Loc, str]] = []
    if through > highest:
        message = f"is {through}, beyond the archive's highest ordinal ({highest})"
        problems.append((("session", "handed_off_through"), message))
    for index, handoff in enumerate(parsed.session.handoffs):
        named = [integral(o) for key in _HANDOFF_ORDINAL_LISTS for o in handoff.raw.get(key) or []]
        named += [integral(handoff.raw.get(key)) for key in ("from_ordinal", "through_ordinal")]
        beyond = [o for o in named if o is not None and o > highest]
        others = sorted({o for o in named if o is not None and o <= highest and o not in succeeded})
        if beyond:
            message = f"names ordinal {max(beyond)}, beyond the archive's highest ordinal ({highest})"
            problems.append((("session", "handoffs", index), message))
        elif others:
            message = f"names ordinal {others[0]}, which is not a succeeded request of the archive"
            problems.append((("session", "handoffs", index), message))
    return problems


def _with_repeated_ordinals(problems: list[tuple[Loc, str]], questions: object) -> list[tuple[Loc, str]]:
    """``problems`` and every repeated ordinal among the questions that have none, in question order."""
    if not isinstance(questions, list):
        return problems
    failed = {loc[1] for loc, _ in problems if loc[:1] == ("questions",) and len(loc) > 1}
    seen: dict[int | None, int] = {}
    for index, item in enumerate(questions):
        if index in failed:
            continue
        ordinal = integral(item["ordinal"])
        if ordinal in seen:
            problems.append(
                (("questions", index, "ordinal"), f"ordinal {ordinal} repeats questions[{seen[ordinal]}]")
            )
        else:
            seen[ordinal] = index
    # Stable: the document's own problems first, then each question's, in order.
    return sorted(problems, key=lambda p: p[0][1] if p[0][:1] == ("questions",) and len(p[0]) > 1 else -1)


def _question_problems(
    parsed: ArchiveV1 | ArchiveV2 | ArchiveV3, max_bytes: int | None
) -> list[tuple[Loc, str]]:
    """A question admission would refuse (SPEC §3): empty, or over the service's question limit. A
    restore must not make history that no client could have asked."""
    problems: list[tuple[Loc, str]] = []
    questions: list[QuestionV1 | QuestionV2 | QuestionV3] = list(parsed.questions)
    for index, q in enumerate(questions):
        size = len(q.question.encode("utf-8"))
        if size == 0:
            problems.append((("questions", index, "question"), "is empty"))
        elif max_bytes is not None and size > max_bytes:
            message = f"is {size} bytes of UTF-8, over the limit of {max_bytes} a question may have"
            problems.append((("questions", index, "question"), message))
    return problems


def parse_archive(document: object, *, max_question_bytes: int | None = None) -> Archive:
    """Validate an archive of any version and return it as plain values (``max_question_bytes``:
    the service's question limit, which a restored question keeps too).

    Raises :class:`ArchiveUnreadable` (400) when ``document`` is not an object with a supported
    ``version``, and :class:`ArchiveInvalid` (422) listing every problem otherwise.
    """
    if not isinstance(document, dict):
        raise ArchiveUnreadable("an archive is a JSON object with a version, a parent_id and questions")
    version = integral(document.get("version"))
    if version not in ARCHIVE_VERSIONS:
        raise _unsupported(document.get("version"))
    assert version is not None
    problems: list[tuple[Loc, str]] = []
    try:
        parsed = MODELS[version].model_validate(document, context={"version": version})
    except ValidationError as exc:
        parsed = None
        problems = [(e["loc"], problem_message(e)) for e in exc.errors()]
    problems = _with_repeated_ordinals(problems, document.get("questions"))
    if parsed is not None:
        problems += _watermark_problems(parsed) + _question_problems(parsed, max_question_bytes)
    if problems:
        errors = [{"loc": loc_text(loc), "message": message} for loc, message in problems]
        errors = errors[:_MAX_REPORTED_ERRORS]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ArchiveInvalid(
            f"invalid version {version} archive: {errors[0]['loc']} {errors[0]['message']}{more}",
            {"errors": errors},
        )
    assert parsed is not None
    return _archive(parsed, version)


def _request(item: QuestionV1 | QuestionV2) -> ArchivedRequest:
    if isinstance(item, QuestionV1):
        return ArchivedRequest(item.ordinal, item.question, item.answer, item.created_at)
    given = item.model_fields_set
    extras: dict[str, Any] = {
        key: getattr(item, key)
        for key in ("model", "snapshot_id", "stop_reason", "truncated", "started_at", "finished_at")
        if key in given and getattr(item, key) is not None
    }
    if item.error is not None:
        extras["error"] = archived_error(item.error.raw, {})
    if "usage" in given:
        extras["usage"] = item.usage.raw
    if isinstance(item, QuestionV3):
        extras.update(context_info=item.context_info, pinned=item.pinned)
    return ArchivedRequest(item.ordinal, item.question, item.answer, item.created_at, item.status, **extras)


def _archive(document: ArchiveV1 | ArchiveV2 | ArchiveV3, version: int) -> Archive:
    requests = sorted((_request(q) for q in document.questions), key=lambda r: r.ordinal)
    archive = Archive(
        version=version, parent_id=document.parent_id, memory=dict(EMPTY_MEMORY), requests=tuple(requests)
    )
    if not isinstance(document, ArchiveV3) or "session" not in document.model_fields_set:
        return archive
    session = document.session
    given = session.model_fields_set
    memory = dict(EMPTY_MEMORY)
    if "memory" in given:
        # Missing parts of the memory are empty, as in a fresh session; extra keys are kept verbatim.
        memory.update(session.memory.raw)
    handoffs = [
        ArchivedHandoff(
            created_at=h.created_at, body=h.raw, through_ordinal=integral(h.raw.get("through_ordinal"))
        )
        for h in session.handoffs
    ]
    return replace(
        archive,
        memory=memory,
        handoffs=tuple(sorted(handoffs, key=lambda h: h.created_at)),
        handed_off_through=session.handed_off_through,
        settings=public_settings(session.settings.raw) if "settings" in given else None,
    )


# --------------------------------------------------------------------------------------------
# Encoding: rows → the document of one version.


# The error detail that names another request by its id: a superseded request's (SPEC §11.2).
SUPERSEDED_BY: Final = "superseded_by"


def archived_error(error: dict[str, Any] | None, ordinal_of: Mapping[str, int]) -> dict[str, Any] | None:
    """A request's error as an archive holds it: archives carry no request ids (SPEC §10), so the
    request that superseded this one is named by its ordinal (``superseded_by_ordinal``, from
    ``ordinal_of``: request id → ordinal), and an id no ordinal is known for (one in another
    session's archive, restored) is left out."""
    detail = error.get("detail") if error else None
    if error is None or not isinstance(detail, dict) or SUPERSEDED_BY not in detail:
        return error
    detail = dict(detail)
    ordinal = ordinal_of.get(str(detail.pop(SUPERSEDED_BY)))
    if ordinal is not None:
        detail["superseded_by_ordinal"] = ordinal
    return {**error, "detail": detail}


def superseding_ids(rows: Sequence[RequestRow]) -> set[str]:
    """The ids of the requests that superseded any of ``rows`` (for :func:`archived_error`)."""
    return {
        str(row.error["detail"][SUPERSEDED_BY])
        for row in rows
        if row.error and isinstance(row.error.get("detail"), dict) and SUPERSEDED_BY in row.error["detail"]
    }


def encode_request(
    row: RequestRow, version: int, ordinal_of: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """One request in the given archive version; no request id (ordinals identify requests, and
    ``ordinal_of`` maps the ids an error names to theirs)."""
    item: dict[str, Any] = {
        "ordinal": row.ordinal,
        "question": row.question,
        "answer": row.answer,
        "created_at": iso_or_none(row.created_at),
    }
    if version >= 2:
        item.update(
            status=row.status,
            error=archived_error(row.error, ordinal_of or {}),
            usage=row.usage or json.loads(json.dumps(EMPTY_USAGE)),
            model=row.model,
            started_at=iso_or_none(row.started_at),
            finished_at=iso_or_none(row.finished_at),
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
    ordinal_of: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The archive document; ``rows`` must already be the exportable requests in ordinal order,
    ``handoffs`` the hand-off bodies oldest first (v3 only), and ``ordinal_of`` the ordinals of the
    requests the rows' errors name (:func:`superseding_ids`)."""
    if version not in ARCHIVE_VERSIONS:
        raise ArchiveUnreadable(f"unsupported archive version {version!r}: supported versions are 1, 2 and 3")
    document: dict[str, Any] = {
        "version": version,
        "parent_id": parent_id,
        "exported_at": utc_iso(exported_at),
    }
    if version >= 3:
        document["session"] = {
            "memory": {**EMPTY_MEMORY, **(memory or {})},
            "handoffs": [dict(body) for body in handoffs],
            "handed_off_through": handed_off_through,
            "settings": public_settings(settings),
        }
    document["questions"] = [encode_request(row, version, ordinal_of) for row in rows]
    return document
