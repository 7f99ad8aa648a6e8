"""The tenant's sessions, most recently active first (``GET /v1/sessions``), keyset-paginated by
``(updated_at, id)``: docs/api.md, "Session list order and cursor".
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import SidequestError
from service.store import queries
from service.store.execute import fetch_models
from service.store.models import SessionRow
from service.store.sessions import read_one_snapshot, session_overviews
from service.vocabulary import utc_iso


class InvalidCursor(SidequestError):
    """A ``before`` cursor that this service did not issue (or that was altered); 400."""

    code = "invalid_cursor"
    status = 400


@dataclass(frozen=True)
class Cursor:
    """A position in the activity order: sessions strictly after it (older activity) come next."""

    updated_at: datetime
    session_id: uuid.UUID

    def encode(self) -> str:
        """The opaque text form (URL-safe base64, no padding)."""
        raw = json.dumps([utc_iso(self.updated_at), str(self.session_id)], separators=(",", ":"))
        return base64.urlsafe_b64encode(raw.encode("ascii")).decode("ascii").rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Cursor:
        """Parse :meth:`encode`'s output; :class:`InvalidCursor` for anything else."""
        try:
            padded = text + "=" * (-len(text) % 4)
            raw = base64.urlsafe_b64decode(padded.encode("ascii"))
            moment, session_id = json.loads(raw)
            if not isinstance(moment, str) or not moment.endswith("Z"):
                raise ValueError("not a UTC timestamp")
            return cls(datetime.fromisoformat(moment[:-1]).replace(tzinfo=UTC), uuid.UUID(session_id))
        except (ValueError, TypeError, UnicodeError, binascii.Error, AttributeError) as exc:
            raise InvalidCursor(
                "before is not a cursor from a previous page's next_before", {"before": text[:100]}
            ) from exc


async def sessions_page(
    tx: AsyncSession, tenant: str, *, limit: int, before: Cursor | None
) -> dict[str, Any]:
    """``{items: [session overview…], has_more, next_before}`` of the tenant, newest activity first;
    ``next_before`` is the cursor after this page's last session when more remain, else None."""
    await read_one_snapshot(tx)  # each overview's row and counts agree, as in GET /v1/sessions/{id}
    params = {
        "tenant": tenant,
        "updated_at": None if before is None else before.updated_at,
        "id": None if before is None else before.session_id,
        "limit": limit + 1,
    }
    rows = await fetch_models(tx, SessionRow, queries.sessions_page, params)
    has_more = len(rows) > limit
    page = rows[:limit]
    return {
        "items": await session_overviews(tx, page),
        "has_more": has_more,
        "next_before": Cursor(page[-1].updated_at, page[-1].id).encode() if has_more and page else None,
    }
