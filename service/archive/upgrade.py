"""Versions 1 and 2 of the archive as version 3 (SPEC §10): the upgrade refuses the fields a version
does not have, and fills in what it implies, so that one model validates every archive and reports
every problem where the archive has it.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic_core import ErrorDetails

from service.archive.model import QUESTION_FIELDS

# Versions 1 and 2 have the same top-level fields; version 3 adds ``session``.
OLDER_DOCUMENT_FIELDS: Final = ("version", "parent_id", "exported_at", "questions")
# What a version implies of each request: version 1 holds succeeded requests only (an export writes
# no other), so each restores as succeeded history. Version 2 implies nothing beyond the v3 model's
# defaults (no context_info, no pins; no session: an empty memory).
_IMPLIED: Final[dict[int, dict[str, Any]]] = {1: {"status": "succeeded"}, 2: {}}


def _unknown(version: int, loc: tuple[str | int, ...], value: object) -> ErrorDetails:
    # pydantic's own error for a field a closed model lacks, named by the version that lacks it.
    return {
        "type": "extra_forbidden",
        "loc": loc,
        "msg": f"Extra inputs are not permitted in a version {version} archive",
        "input": value,
    }


def upgrade(document: dict[str, Any], version: int) -> tuple[dict[str, Any], list[ErrorDetails]]:
    """A version ``version`` archive as version 3, and the fields its version does not have."""
    if version == 3:
        return {**document, "version": 3}, []  # a version written 3.0 is 3
    question_fields = QUESTION_FIELDS[version]
    errors = [_unknown(version, (key,), v) for key, v in document.items() if key not in OLDER_DOCUMENT_FIELDS]
    upgraded = {k: v for k, v in document.items() if k in OLDER_DOCUMENT_FIELDS} | {"version": 3}
    if isinstance(questions := document.get("questions"), list):
        upgraded["questions"] = []
        for index, item in enumerate(questions):
            if isinstance(item, dict):
                loc = ("questions", index)
                errors += [
                    _unknown(version, (*loc, k), v) for k, v in item.items() if k not in question_fields
                ]
                item = {k: v for k, v in item.items() if k in question_fields} | _IMPLIED[version]
            upgraded["questions"].append(item)
    return upgraded, errors
