"""Per-session settings (SPEC §11.2): the rules of the object, its read, and its one write.

The settings live in ``side_question_sessions.settings`` (JSONB). A field that is unset is simply
absent there; the public object always names every field, with ``null`` for unset ones. A PUT
changes only the fields it names, and ``null`` clears a field. Nothing but a PUT changes them: a clear
keeps them, an archive restore brings the archive's (see :mod:`service.store.archive`).

The field rules are plain values and one pure checker (:func:`settings_problems`), shared by the API's
request model and the archive codec, so an archive cannot smuggle in what a PUT would refuse.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import func
from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import SidequestError
from service.store.sessions import SETTINGS_FIELDS, find_session, lock_or_create_session
from service.vocabulary import (
    CONTEXT_WINDOW_MAX,
    CONTEXT_WINDOW_MIN,
    MAX_MODEL_CHARS,
    MAX_SUMMARY_INSTRUCTIONS_BYTES,
    OUTPUT_CAP_MAX,
    OUTPUT_CAP_MIN,
    integral,
    unstorable_reason,
)

ON_BUSY_CHOICES: Final = ("enqueue", "reject", "interrupt")


# The number fields and their bounds: the one table both the check and the stored form read.
_INTEGER_BOUNDS: Final = {
    "context_window": (CONTEXT_WINDOW_MIN, CONTEXT_WINDOW_MAX),
    "max_output_tokens": (OUTPUT_CAP_MIN, OUTPUT_CAP_MAX),
}


def _int_problem(value: object, low: int, high: int) -> str | None:
    number = integral(value)  # 4096.0 is the integer 4096, as JSON Schema says (an archive may say so)
    if number is None:
        return "must be an integer or null"
    if not low <= number <= high:
        return f"must be from {low} to {high}"
    return None


def stored_setting(name: str, value: Any) -> Any:
    """A valid setting's value as stored: a number field as an int (``4096.0`` → ``4096``)."""
    if name in _INTEGER_BOUNDS and value is not None:
        return integral(value)
    return value


def field_problem(name: str, value: object) -> str | None:
    """Why ``value`` is not acceptable for setting ``name`` (None: fine; ``None`` always clears)."""
    if value is None:
        return None
    if name == "summary_instructions":
        if not isinstance(value, str):
            return "must be a string or null"
        bad = unstorable_reason(value)
        if bad:
            return bad
        size = len(value.encode("utf-8"))
        if size > MAX_SUMMARY_INSTRUCTIONS_BYTES:
            return f"is {size} bytes of UTF-8; at most {MAX_SUMMARY_INSTRUCTIONS_BYTES} bytes (4 KiB) allowed"
        return None
    if name in ("summary_model", "answer_model"):
        if not isinstance(value, str) or not value:
            return "must be a non-empty string or null"
        if len(value) > MAX_MODEL_CHARS:
            return f"must be at most {MAX_MODEL_CHARS} characters"
        return unstorable_reason(value)
    if name in _INTEGER_BOUNDS:
        return _int_problem(value, *_INTEGER_BOUNDS[name])
    if name == "on_busy":
        if value not in ON_BUSY_CHOICES:
            return "must be one of enqueue, reject, interrupt (or null)"
        return None
    if name == "mask_tool_results":
        return None if isinstance(value, bool) else "must be true, false or null"
    return "is not a session setting"


def settings_problems(value: object) -> list[tuple[str, str]]:
    """Every problem of a settings object as ``(field, message)``; empty when it is valid."""
    if not isinstance(value, dict):
        return [("", "must be an object")]
    problems = []
    for name, item in value.items():
        problem = field_problem(str(name), item)
        if problem is not None:
            problems.append((str(name), problem))
    return problems


def public_settings(stored: dict[str, Any] | None) -> dict[str, Any]:
    """The whole settings object: every field, ``null`` when unset (unknown stored keys are dropped)."""
    stored = stored or {}
    return {name: stored.get(name) for name in SETTINGS_FIELDS}


class InvalidSettings(SidequestError):
    """A settings change breaks the field rules (422); ``problems`` lists ``(field, message)``.

    The detail is a request validation error's (the settings are a PUT body).
    """

    code = "validation_error"
    status = 422

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        first = problems[0]
        errors = [
            {"loc": ["body", name], "msg": message, "type": "value_error"} for name, message in problems
        ]
        super().__init__(f"invalid settings: {first[0]} {first[1]}", {"errors": errors})
        self.problems = problems


async def read_settings(tx: AsyncSession, tenant: str, parent_id: str) -> dict[str, Any] | None:
    """The tenant's session settings as the public object, or None when there is no such session."""
    session_row = await find_session(tx, tenant, parent_id)
    return None if session_row is None else public_settings(session_row.settings)


async def update_settings(
    tx: AsyncSession, tenant: str, parent_id: str, changes: dict[str, Any]
) -> dict[str, Any]:
    """Apply a PUT (only the named fields; ``None`` clears one), creating the session if needed,
    inside the caller's transaction.

    Every change is checked before the first write, so a refused PUT writes nothing (not even the
    session it would have created). Returns the whole settings object after the change.
    """
    problems = settings_problems(changes)
    if problems:
        raise InvalidSettings(problems)
    session_row = await lock_or_create_session(tx, tenant, parent_id)
    merged = {k: v for k, v in (session_row.settings or {}).items() if k in SETTINGS_FIELDS}
    for name, value in changes.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = stored_setting(name, value)
    session_row.settings = merged
    session_row.updated_at = func.now()
    await tx.flush()
    return public_settings(merged)


__all__ = [
    "MAX_SUMMARY_INSTRUCTIONS_BYTES",
    "ON_BUSY_CHOICES",
    "SETTINGS_FIELDS",
    "InvalidSettings",
    "field_problem",
    "public_settings",
    "read_settings",
    "settings_problems",
    "stored_setting",
    "update_settings",
]
