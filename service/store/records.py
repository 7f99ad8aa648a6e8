"""Turning rows into the records of SPEC §3 (one place, used by the API, the worker and archives)."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, cast

from service.store.models import RequestRow, empty_usage
from service.vocabulary import iso_or_none


def request_record(row: RequestRow, parent_id: str) -> dict[str, Any]:
    """The public record of one request, with exactly SPEC's field names (plus ``clear_version``)."""
    return {
        "id": str(row.id),
        "parent_id": parent_id,
        "ordinal": row.ordinal,
        "question": row.question,
        "status": row.status,
        "stage": row.stage,
        "answer": row.answer,
        "truncated": row.truncated,
        "stop_reason": row.stop_reason,
        "error": row.error,
        "usage": row.usage or empty_usage(),
        "context_info": row.context_info or {},
        "model": row.model,
        "snapshot_id": row.snapshot_id,
        "attempt": row.attempt,
        "clear_version": row.clear_version,
        "created_at": iso_or_none(row.created_at),
        "started_at": iso_or_none(row.started_at),
        "finished_at": iso_or_none(row.finished_at),
        "pinned": row.pinned,
    }


def record_of_row(row: Mapping[str, Any], parent_id: str) -> dict[str, Any]:
    """:func:`request_record` of a request row read by a SQL function (its own columns, by name)."""
    return request_record(cast(RequestRow, SimpleNamespace(**row)), parent_id)
