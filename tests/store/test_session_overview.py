"""The session object (SPEC §3) reads one snapshot of the database."""

from __future__ import annotations

from typing import Any

import pytest

from service.store import session_list, sessions
from service.store.admission import Admission, admit
from service.store.db import Database

TENANT = "acme"


async def _racing_counts(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every counts read first commit one more admission, from another connection: an admission
    committing between the session row's read and the counts' read, which must not make them disagree."""
    real = sessions.status_counts_of

    async def racing(session: Any, ids: Any) -> Any:
        await admit(db, TENANT, "p", Admission(question="raced in"), max_queued=20)
        return await real(session, ids)

    monkeypatch.setattr(sessions, "status_counts_of", racing)


async def test_a_session_objects_counts_agree_with_its_next_ordinal(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    await admit(db, TENANT, "p", Admission(question="first"), max_queued=20)
    await _racing_counts(db, monkeypatch)
    async with db.sessions() as session:
        overview = await sessions.session_overview(session, TENANT, "p")
    assert overview is not None
    assert sum(overview["counts"].values()) == overview["next_ordinal"] - 1 == 1
    async with db.sessions() as session:
        page = await session_list.sessions_page(session, TENANT, limit=20, before=None)
    (item,) = page["items"]
    assert sum(item["counts"].values()) == item["next_ordinal"] - 1 == 2
