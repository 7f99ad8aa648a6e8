"""The lease guard (sql/lease.sql): every write a worker makes to a request it runs is conditional on
still holding it, so a request cancelled, cleared or swept is never written by a worker that lost it.
The lease owner names one *claim*, not just the process (docs/pipeline.md says why).
"""

from __future__ import annotations

import uuid
from typing import Any

from service.store import queries
from service.store.execute import Executor, fetch_value, json_text
from service.vocabulary import utc_iso

# Between the worker's name and the claim's own token; a host name never holds one.
_CLAIM_TOKEN_MARK = "#"


def claim_owner(worker: str) -> str:
    """The lease owner of one claim by ``worker``: its name and a token of this claim alone."""
    return f"{worker}{_CLAIM_TOKEN_MARK}{uuid.uuid4().hex[:8]}"


def worker_of(owner: str) -> str:
    """The worker process a lease owner (:func:`claim_owner`) belongs to."""
    return owner.split(_CLAIM_TOKEN_MARK, 1)[0]


async def lock_if_held(tx: Executor, request_id: uuid.UUID, owner: str) -> bool:
    """Lock the request row if this worker still runs it (a cancel or clear holding the row makes
    this wait and then see the new status)."""
    return bool(await fetch_value(tx, queries.lock_if_held, {"id": request_id, "owner": owner}))


async def emit_if_held(
    tx: Executor,
    request_id: uuid.UUID,
    owner: str,
    events: list[tuple[str, dict[str, Any]]],
    *,
    stage: str | None = None,
    context_info: dict[str, Any] | None = None,
) -> bool:
    """One statement: the lease guard, any ``stage`` change with ``context_info``, then ``events`` in order
    (an event's own ``at`` wins); False, writing nothing, if the worker lost the request."""
    info = None if stage is None else json_text({**(context_info or {}), "stage": stage})
    held = await fetch_value(
        tx,
        queries.emit_if_held,
        {
            "id": request_id,
            "owner": owner,
            "events": json_text([[event_type, fields] for event_type, fields in events]),
            "at": utc_iso(),
            "stage": stage,
            "info": info,
        },
    )
    return bool(held)
