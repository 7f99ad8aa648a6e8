"""The usage ledger and the request's live metadata (``context_info``). A provider call's usage is appended as
the call ends, in one ``UPDATE`` recomputing the totals from the calls (sql/ledger.sql), so they never
disagree; usage is recorded even after the request left ``running`` (a call cancelled by a clear still cost
tokens).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from service.store import queries
from service.store.execute import Executor, execute, fetch_value, json_text

# The token totals of a usage object (SPEC §3), each the sum of its calls'.
USAGE_FIELDS = ("input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens")


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
    # This call's identity: an append retried after a lost reply (its COMMIT may have applied) counts it once.
    call_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def as_json(self) -> dict[str, Any]:
        """The stored entry, in the fields' order; ``latency_ms`` only when measured."""
        entry = asdict(self)
        if self.latency_ms is None:
            del entry["latency_ms"]
        return entry


@dataclass(frozen=True)
class Appended:
    """The usage after an append, and whether the append added its calls (False: already there)."""

    usage: dict[str, Any]
    added: bool


async def append_calls(
    tx: Executor, row_id: uuid.UUID, entries: Sequence[CallEntry], *, job: bool = False
) -> Appended:
    """Append calls, in this order, to the request's (or, with ``job``, the background job's) usage, in
    one statement (its row lock serialises concurrent appends); calls already there add nothing."""
    statement = queries.append_job_calls if job else queries.append_request_calls
    params = {"id": row_id, "call": json_text([entry.as_json() for entry in entries])}
    usage = await fetch_value(tx, statement, params)
    if usage is not None:
        return Appended(dict(usage), added=True)
    usage = await fetch_value(tx, queries.job_usage if job else queries.request_usage, {"id": row_id})
    if usage is None:
        raise LookupError(f"{'job' if job else 'request'} {row_id} does not exist")
    return Appended(dict(usage), added=False)


async def merge_context_info(tx: Executor, request_id: uuid.UUID, fields: dict[str, Any]) -> None:
    """Merge ``fields`` into the request's ``context_info`` (top-level keys replaced). Not
    lease-guarded: after a cancel it still shows how far the request got."""
    await execute(tx, queries.merge_context_info, {"id": request_id, "info": json_text(fields)})
