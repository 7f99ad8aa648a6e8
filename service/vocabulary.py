"""The domain vocabulary every layer speaks, each term defined once so no layer drifts from another
(docs/architecture.md lists them); stdlib only, so ``service.budget`` may import it. The enums are
``StrEnum``s: a member *is* its wire string, so JSON, SQL parameters and string comparisons are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]  # (typeshed omits it)
from typing import Any, Final, Literal


class Status(StrEnum):
    """A side request's (and a background job's) lifecycle status (SPEC §3)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL: Final = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED})
ACTIVE: Final = frozenset({Status.QUEUED, Status.RUNNING})
# The type of a terminal transition's status (the members of TERMINAL, for the type checker).
TerminalStatus = Literal[Status.SUCCEEDED, Status.FAILED, Status.CANCELLED]


class Stage(StrEnum):
    """The stages of a running side request (SPEC §4 ``status`` events, ``context_info.stage``)."""

    PREPARING = "preparing"
    ORGANIZING_HISTORY = "organizing_history"
    COMPACTING_CONTEXT = "compacting_context"
    ANSWERING = "answering"


class JobKind(StrEnum):
    """The kinds of background summary job (SPEC §6.6)."""

    QA_FOLD = "qa_fold"
    CONTEXT_SUMMARY = "context_summary"


# LISTEN/NOTIFY channels (one home: the store's listener and NOTIFYs, the worker's wake-ups).
EVENTS_CHANNEL: Final = "sidequest_events"
QUEUE_CHANNEL: Final = "sidequest_queue"
CANCEL_CHANNEL: Final = "sidequest_cancel"
JOBS_CHANNEL: Final = "sidequest_jobs"
ALL_CHANNELS: Final = (EVENTS_CHANNEL, QUEUE_CHANNEL, CANCEL_CHANNEL, JOBS_CHANNEL)


# The bounds of what a client may state for a question, a session's settings (SPEC §11.2) and an archive:
# one home, so the API's schemas, the archive model and the service's own settings never disagree.
MAX_PARENT_ID_CHARS: Final = 500
MAX_SNAPSHOT_ID_CHARS: Final = 500
MAX_MODEL_CHARS: Final = 200
CONTEXT_WINDOW_MIN: Final = 1024
CONTEXT_WINDOW_MAX: Final = 10_000_000
OUTPUT_CAP_MIN: Final = 256
OUTPUT_CAP_MAX: Final = 32768
# SPEC §11.2: summary instructions are at most 4 KiB, measured in UTF-8 bytes (not characters).
MAX_SUMMARY_INSTRUCTIONS_BYTES: Final = 4096
# What a new question does while its session has queued or running ones (SPEC §11.2).
OnBusy = Literal["enqueue", "reject", "interrupt"]


def utc_iso(moment: datetime | None = None) -> str:
    """ISO 8601 UTC, always with microseconds and ``Z`` (``2026-11-29T10:00:00.000000Z``); ``None`` is
    now. ``isoformat``, not ``strftime``: ``"%Y"`` drops the leading zeros of years below 1000 on glibc."""
    moment = (moment or datetime.now(UTC)).astimezone(UTC)
    return moment.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def utc_iso_seconds(moment: datetime | None) -> str | None:
    """:func:`utc_iso` cut to the second (``2026-11-29T10:03:10Z``), for text a model reads (a
    hand-off block's times: microseconds there are noise to the reader, not precision); None stays
    None. Never on the wire's ``at`` fields, which are always :func:`utc_iso`."""
    return utc_iso(moment)[:19] + "Z" if moment is not None else None


def iso_or_none(moment: datetime | None) -> str | None:
    """:func:`utc_iso` of a moment that may be missing (a record's ``finished_at``, say)."""
    return utc_iso(moment) if moment is not None else None


# The C encoder ``json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"),
# default=str)`` builds anew on every call, built once for every canonical encoding: the same bytes, a
# third less time per small value (~3.0 against ~4.3 ms for a large snapshot's 1600 messages).
# Without the circular-reference check, which JSON values (from a parser, or the database) never need:
# a cyclic value ends in RecursionError, not ValueError. (CPython always builds ``_json``, its home.)
_CANONICAL: Final = c_make_encoder(None, str, encode_basestring, None, ":", ",", True, False, True)


def canonical_bytes(value: Any) -> bytes:
    """Key-sorted compact JSON as UTF-8 (what content digests hash): equal documents give equal bytes
    whatever their key order."""
    return "".join(_CANONICAL(value, 0)).encode()


def content_hash(value: Any) -> str:
    """SHA-256 of the canonical JSON of ``value`` (hex): snapshot ids' content check, idempotency."""
    return hashlib.sha256(canonical_bytes(value)).hexdigest()


UNSTORABLE_TEXT: Final = "NUL characters and unpaired surrogates are not allowed"


def unstorable_reason(value: str) -> str | None:
    """Why PostgreSQL cannot store ``value`` as text (a NUL, an unpaired surrogate), or None."""
    if "\x00" in value:
        return "must not contain NUL characters"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "must not contain unpaired surrogates"
    return None


# A NUL inside a JSON string is written ``\u0000``; preceded by an odd number of backslashes it is
# the text ``\u0000`` (six characters, common in source code), not a NUL.
_NUL_ESCAPE: Final = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


class NotJson(ValueError):
    """Bytes that are not JSON text as RFC 8259 has it; the message says why."""


# What JSON that Python's parser would decode as UTF-16/32, or past a byte order mark, begins with: a
# BOM, or a NUL among its first four bytes (JSON text begins with an ASCII character, which they pad).
_BOMS: Final = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")


def may_be_lenient_json(raw: bytes) -> bool:
    """Whether Python's parser might read ``raw`` although :func:`strict_json` refuses it — C-speed,
    so that only the rare body that could be such is parsed strictly: the constants can only appear
    as those bytes, UTF-16/32 and a BOM show in the first bytes."""
    return b"NaN" in raw or b"Infinity" in raw or b"\x00" in raw[:4] or raw.startswith(_BOMS)


def _no_constant(name: str) -> Any:
    raise NotJson(f"{name} is not a JSON number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):  # RFC 8259 §6 lets a parser limit the range of numbers: a double's
        raise NotJson(f"the number {literal[:40]} is beyond the range of a 64-bit float")
    return value


def strict_json(raw: bytes | str) -> Any:
    """``raw`` parsed as JSON text (key order kept), or :class:`NotJson`: THE rule of what JSON a
    client may send. Python's parser is lenient where RFC 8259 is not — it reads ``NaN`` and
    ``Infinity`` as numbers, and decodes UTF-16, UTF-32 and a byte order mark; and a number beyond a
    double (``1e400``) would be an infinity that nothing downstream can store or send."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise NotJson("it is not UTF-8") from None
    if raw.startswith("\ufeff"):
        raise NotJson("it starts with a byte order mark (send plain UTF-8)")
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except NotJson:
        raise
    except ValueError as exc:  # json.JSONDecodeError
        raise NotJson(str(exc)) from None
    except RecursionError:
        raise NotJson("it is nested too deeply to parse") from None


def json_has_nul(encoded: bytes) -> bool:
    """Whether JSON text (UTF-8, as :func:`canonical_bytes` writes it) holds a NUL in a string or key;
    the plain search first, as the escape-aware pattern is ~70× slower and almost never needed."""
    return b"\\u0000" in encoded and _NUL_ESCAPE.search(encoded) is not None


# ---------------------------------------------------------------------------------------------------
# Progress events (SPEC §4 ``progress``): one constructor per kind, so every emitter writes the same
# keys in the same order. The runtime adds ``stage`` in front of those that do not carry it; the
# summary policy's own events name their stage. A keyword left None is left out of the event.


def _present(event: dict[str, Any], **fields: Any) -> dict[str, Any]:
    event.update((name, value) for name, value in fields.items() if value is not None)
    return event


def waiting_for_background(job_id: str, kind: str, key: str) -> dict[str, Any]:
    """A request waits for a background job that is making what it needs (SPEC §6.6)."""
    return {"what": "waiting_for_background", "job_id": job_id, "kind": kind, "key": key}


def overflow_retry(
    *, estimate_before: int | None = None, estimate_after: int | None = None, retry: int | None = None
) -> dict[str, Any]:
    """The answer call overflowed (``estimate_before``); the prompt was shrunk (``estimate_after``)
    and is sent again (``retry``)."""
    event: dict[str, Any] = {"what": "overflow_retry"}
    return _present(event, estimate_before=estimate_before, estimate_after=estimate_after, retry=retry)


def replay(replayed_groups: int, replayed_ordinals: list[int] | None, folded_groups: int) -> dict[str, Any]:
    """The history plan: Q&A groups replayed verbatim (their ordinals) and groups folded."""
    return {
        "what": "replay",
        "replayed_groups": replayed_groups,
        "replayed_ordinals": replayed_ordinals,
        "folded_groups": folded_groups,
    }


def compaction_skipped(reason: str) -> dict[str, Any]:
    """Compaction had nothing to work on."""
    return {"what": "compaction_skipped", "reason": reason}


def masks_tool_results(session_settings: Mapping[str, Any]) -> bool:
    """SPEC §11.2 ``mask_tool_results``: masking is on unless the session set it to false (null and
    unset mean the default)."""
    return session_settings.get("mask_tool_results") is not False


def context_masked(*, groups: int, masked_messages: int, payload_bytes: int, tier: str) -> dict[str, Any]:
    """Tool payloads of the oldest ``groups`` groups elided (SPEC §6.8), as tier ``tier`` of §6.2."""
    return {
        "what": "context_masked",
        "tier": tier,
        "groups": groups,
        "masked_messages": masked_messages,
        "payload_bytes": payload_bytes,
    }


def compaction_refused(reason: str, explanation: str | None = None) -> dict[str, Any]:
    """Compaction cannot help (a cut refusal's ``reason``, and why in words)."""
    return _present({"what": "compaction_refused", "reason": reason}, explanation=explanation)


def context_summary_cache(
    cache: str,
    *,
    stage: Stage | None = None,
    key: str | None = None,
    covered_messages: int | None = None,
    new_messages: int | None = None,
    verbatim_tail_tokens: int | None = None,
    answered_without_waiting: bool | None = None,
    waited_ms: int | None = None,
) -> dict[str, Any]:
    """What the context-summary cache gave (``hit``, ``prefix``, ``miss``) and what it covers."""
    event: dict[str, Any] = {} if stage is None else {"stage": stage}
    event.update(what="context_summary_cache", cache=cache)
    return _present(
        event,
        key=key,
        covered_messages=covered_messages,
        new_messages=new_messages,
        verbatim_tail_tokens=verbatim_tail_tokens,
        answered_without_waiting=answered_without_waiting,
        waited_ms=waited_ms,
    )


def summary_chunk(stage: Stage, purpose: str, chunk: int, chunks: int) -> dict[str, Any]:
    """A summary call over chunk ``chunk`` of ``chunks`` starts."""
    return {"stage": stage, "what": "summary_chunk", "purpose": purpose, "chunk": chunk, "chunks": chunks}


def summary_merge(
    stage: Stage, purpose: str, merge_round: int, merge: int, merges: int, documents: int
) -> dict[str, Any]:
    """Merge call ``merge`` of ``merges`` in round ``merge_round`` starts, over ``documents`` documents."""
    return {
        "stage": stage,
        "what": "summary_merge",
        "purpose": purpose,
        "round": merge_round,
        "merge": merge,
        "merges": merges,
        "documents": documents,
    }


# ---------------------------------------------------------------------------------------------------
# Terminal error objects (SPEC §3 ``error``: ``{code, message, detail}``): one constructor per way the
# service itself ends a request or a job, so every writer — the store, the pipeline, the worker —
# builds the same object, and SQL takes it as a parameter instead of spelling it out.

CANCELLED_BY_CLIENT: Final = "cancelled by the client"
CANCELLED_BY_CLEAR: Final = "cancelled because the session was cleared"

RequeueReason = Literal["worker_stopped", "worker_lost"]


def terminal_error(code: str, message: str, detail: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An error object: ``code``, ``message``, ``detail`` (an object, empty when there is nothing)."""
    return {"code": code, "message": message, "detail": dict(detail or {})}


def cancelled_error(message: str = "the request was cancelled") -> dict[str, Any]:
    """A request cancelled (by its client, a clear, or its worker settling a cancel)."""
    return terminal_error("cancelled", message)


def superseded_error(superseded_by: object) -> dict[str, Any]:
    """A request cancelled by a newer question of its session sent with ``on_busy: interrupt``."""
    return terminal_error(
        "superseded",
        "cancelled because a newer question of the session interrupted it",
        {"superseded_by": str(superseded_by)},
    )


def session_cleared_error() -> dict[str, Any]:
    """A background job (or a request's registration) ended by a clear of its session."""
    return terminal_error("cancelled", "the session was cleared")


def taken_over_error() -> dict[str, Any]:
    """A queued background job a waiting request took over: the request makes the summary itself."""
    return terminal_error("taken_over", "a request that needed it made it itself")


def worker_lost_error(attempts: int, stage: str | None, what: Literal["request", "job"]) -> dict[str, Any]:
    """A request or job whose worker stopped answering on its last attempt (the sweep's verdict)."""
    return terminal_error(
        "worker_lost",
        f"the worker running this {what} stopped answering ({attempts} attempts)",
        {"attempts": attempts, "stage": stage},
    )


def timeout_error(what: str, timeout_s: float, stage: str | None) -> dict[str, Any]:
    """``what`` (the side request, the background job) did not finish within its deadline."""
    return terminal_error(
        "timeout",
        f"{what} did not finish within its {timeout_s:g}s deadline",
        {"timeout_s": timeout_s, "stage": stage},
    )


def snapshot_missing_error() -> dict[str, Any]:
    """A background job whose snapshot is no longer stored."""
    return terminal_error("snapshot_missing", "snapshot gone")


def rerun(reason: RequeueReason, stage: str | None, attempt: int | None = None) -> dict[str, Any]:
    """The ``progress`` event of a request sent back to the queue: its worker stopped (``worker_stopped``,
    the attempt does not count) or was lost (``worker_lost``, ``attempt`` it was on); clients discard
    the text streamed so far, since the answer starts again."""
    return _present({"stage": stage, "what": f"{reason}_rerun"}, attempt=attempt, discard_streamed_text=True)


def integral(value: object) -> int | None:
    """A JSON integer as an int: ``5`` and ``5.0`` are one number (JSON Schema agrees); ``true`` is not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
