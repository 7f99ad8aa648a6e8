"""The tenant's sessions, most recently active first (``GET /v1/sessions``), keyset-paginated.

"Activity" is the session row's ``updated_at``: what a client did — admission, a clear, an archive
restore, a settings PUT, a hand-off — moves it; a background summary does not (docs/api.md). Pages
are ordered by ``(updated_at, id)`` descending — the id breaks ties between sessions touched in the
same microsecond — and walk the index ``ix_sessions_tenant_activity`` (tenant, updated_at, id)
backwards, so a page costs the same however deep it is.

The cursor is opaque to clients: URL-safe base64 of ``[updated_at, id]`` of the last session of the
previous page. A session that becomes active while a client pages moves to the front; it is then
not shown again further down (its new position is before the cursor), and none is skipped.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import SidequestError
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
            parsed = datetime.fromisoformat(moment[:-1]).replace(tzinfo=UTC)
            return cls(parsed, uuid.UUID(session_id))
        except (ValueError, TypeError, UnicodeError, binascii.Error, AttributeError) as exc:
            raise InvalidCursor(
                "before is not a cursor from a previous page's next_before", {"before": text[:100]}
            ) from exc


async def sessions_page(
    session: AsyncSession, tenant: str, *, limit: int, before: Cursor | None
) -> dict[str, Any]:
    """``{items: [session overview…], has_more, next_before}`` of the tenant, newest activity first.

    ``next_before`` is the cursor after this page's last session when more remain, else None.
    Overviews are built for the whole page at once (:func:`session_overviews`), not one by one.
    """
    await read_one_snapshot(session)  # each overview's row and counts agree, as in GET /v1/sessions/{id}
    query = select(SessionRow).where(SessionRow.tenant == tenant)
    if before is not None:
        query = query.where(
            tuple_(SessionRow.updated_at, SessionRow.id) < tuple_(before.updated_at, before.session_id)
        )
    query = query.order_by(SessionRow.updated_at.desc(), SessionRow.id.desc()).limit(limit + 1)
    rows = list(await session.scalars(query.execution_options(populate_existing=True)))
    has_more = len(rows) > limit
    page = rows[:limit]
    return {
        "items": await session_overviews(session, page),
        "has_more": has_more,
        "next_before": Cursor(page[-1].updated_at, page[-1].id).encode() if has_more and page else None,
    }
