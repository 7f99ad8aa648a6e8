"""Versions 1 and 2 of the archive as version 3 (SPEC §10): each upgrade refuses the fields its
version does not have, and fills in what it implies, so that one model validates every archive and
reports every problem where the archive has it.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic_core import ErrorDetails

from service.archive.model import V1_QUESTION_FIELDS, V2_QUESTION_FIELDS

# Versions 1 and 2 have the same top-level fields; version 3 adds ``session``.
OLDER_DOCUMENT_FIELDS: Final = ("version", "parent_id", "exported_at", "questions")


def _unknown(version: int, loc: tuple[str | int, ...], value: object) -> ErrorDetails:
    # pydantic's own error for a field a closed model lacks, named by the version that lacks it.
    return {
        "type": "extra_forbidden",
        "loc": loc,
        "msg": f"Extra inputs are not permitted in a version {version} archive",
        "input": value,
    }


def _upgrade(
    document: dict[str, Any], version: int, question_fields: tuple[str, ...], implied: dict[str, Any]
) -> tuple[dict[str, Any], list[ErrorDetails]]:
    errors = [_unknown(version, (key,), v) for key, v in document.items() if key not in OLDER_DOCUMENT_FIELDS]
    upgraded = {k: v for k, v in document.items() if k in OLDER_DOCUMENT_FIELDS} | {"version": 3}
    questions = document.get("questions")
    if isinstance(questions, list):
        upgraded["questions"] = []
        for index, item in enumerate(questions):
            if isinstance(item, dict):
                loc = ("questions", index)
                errors += [
                    _unknown(version, (*loc, k), v) for k, v in item.items() if k not in question_fields
                ]
                item = {k: v for k, v in item.items() if k in question_fields} | implied
            upgraded["questions"].append(item)
    return upgraded, errors


def v1_to_v3(document: dict[str, Any]) -> tuple[dict[str, Any], list[ErrorDetails]]:
    """A version 1 archive as version 3, and the fields version 1 does not have. Version 1 holds
    succeeded requests only (an export writes no other), so each restores as succeeded history."""
    return _upgrade(document, 1, V1_QUESTION_FIELDS, {"status": "succeeded"})


def v2_to_v3(document: dict[str, Any]) -> tuple[dict[str, Any], list[ErrorDetails]]:
    """A version 2 archive as version 3 (no session: an empty memory; no context_info, no pins),
    and the fields version 2 does not have."""
    return _upgrade(document, 2, V2_QUESTION_FIELDS, {})
