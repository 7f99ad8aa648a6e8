"""The usage ledger and the request's live metadata (``context_info``).

Each provider call's usage is appended the moment the call ends (ok, failed or cancelled) in one
``UPDATE`` that also recomputes the totals from the per-call list, so the totals can never disagree with
the calls and a worker crash right after a call loses nothing. Totals come only from reported usage: a
call the provider sent no usage for is recorded with zeros and ``reported: false``.

Usage is recorded even after the request left ``running`` (a call cancelled by a clear still cost
tokens); only events are guarded by the lease (see :mod:`service.store.queue`).

Each call carries its own ``call_id``, and an append whose calls are already in the list changes
nothing: a write tried again because the database's reply was lost — its COMMIT may have been applied —
never counts a call twice.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from service.store import queries
from service.store.execute import Executor, execute, fetch_value, json_text

USAGE_FIELDS = ("input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens")

# The appends (a request's, a background job's: the same usage object, SPEC §3, each in its own
# table) and the reads of the usage as it stands: named queries in service/store/sql/ledger.sql, with
# why the totals are computed inside the SET expression.


@dataclass(frozen=True)
class CallEntry:
    """One provider call as the ledger stores it (SPEC §3 ``usage.calls[]``)."""

    purpose: str
    model: str
    status: str  # ok | failed | cancelled
    reported: bool
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    # Wall time of the call; not in SPEC's list, kept for the provider latency metric.
    latency_ms: int | None = None
    # This call's identity: an append tried again after a lost reply does not count it twice.
    call_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def as_json(self) -> dict[str, Any]:
        extra = {} if self.latency_ms is None else {"latency_ms": self.latency_ms}
        return {
            "purpose": self.purpose,
            "model": self.model,
            "status": self.status,
            "reported": self.reported,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "cached_tokens": self.cached_tokens,
            **extra,
            "call_id": self.call_id,
        }


@dataclass(frozen=True)
class Appended:
    """The usage after an append, and whether the append added its calls (False: already there)."""

    usage: dict[str, Any]
    added: bool


async def append_calls(
    tx: Executor, row_id: uuid.UUID, entries: Sequence[CallEntry], *, job: bool = False
) -> Appended:
    """Append calls, in this order, to the request's (or, with ``job``, the background job's) usage,
    in one statement inside the caller's transaction.

    The totals are recomputed from the calls in the same statement, and the row lock taken by the
    ``UPDATE`` serialises concurrent appends. Calls already in the list add nothing (``added`` False).
    """
    statement = queries.append_job_calls if job else queries.append_request_calls
    params = {"id": row_id, "call": json.dumps([entry.as_json() for entry in entries])}
    usage = await fetch_value(tx, statement, params)
    if usage is not None:
        return Appended(dict(usage), added=True)
    usage = await fetch_value(tx, queries.job_usage if job else queries.request_usage, {"id": row_id})
    if usage is None:
        raise LookupError(f"{'job' if job else 'request'} {row_id} does not exist")
    return Appended(dict(usage), added=False)


async def merge_context_info(tx: Executor, request_id: uuid.UUID, fields: dict[str, Any]) -> None:
    """Merge ``fields`` into the request's ``context_info`` (top-level keys replaced), inside the
    caller's transaction.

    Not lease-guarded: context_info is metadata about what was done, and keeping it current after a
    cancel is harmless and useful (it shows how far the request got).
    """
    await execute(tx, queries.merge_context_info, {"id": request_id, "info": json_text(fields)})
