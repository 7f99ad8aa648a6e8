"""The worker's in-memory prepared snapshots (service/pipeline/snapshots.py): same result as the store,
read once, bounded."""

from __future__ import annotations

from service.pipeline.snapshots import PreparedSnapshots
from service.store.db import Database
from service.store.history import load_prepared_snapshot
from tests.factories import add_snapshot, make_session


def _content(n: int) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": f"message {i} of snapshot {n}"} for i in range(5)]}


async def test_a_snapshot_is_read_once_and_equals_the_stores(db: Database) -> None:
    sid = await make_session(db, "parent-cache")
    await add_snapshot(db, sid, "s1", _content(1))
    cache = PreparedSnapshots(capacity=2)
    first = await cache.load(db, sid, "s1")
    again = await cache.load(db, sid, "s1")
    async with db.sessions() as session:
        stored = await load_prepared_snapshot(session, sid, "s1")
    assert first is not None and again is first and stored is not None
    assert first.digests == stored.digests and first.messages == stored.messages
    assert (cache.hits, cache.misses) == (1, 1)


async def test_missing_snapshots_are_not_remembered_and_the_oldest_entry_goes(db: Database) -> None:
    sid = await make_session(db, "parent-cache-lru")
    assert await PreparedSnapshots().load(db, sid, "nowhere") is None
    for n in (1, 2, 3):
        await add_snapshot(db, sid, f"s{n}", _content(n))
    cache = PreparedSnapshots(capacity=2)
    for n in (1, 2, 3):
        assert await cache.load(db, sid, f"s{n}") is not None
    await cache.load(db, sid, "s3")  # still there
    await cache.load(db, sid, "s1")  # evicted: read again
    assert (cache.hits, cache.misses) == (1, 4)
    # A snapshot stored after a miss is found (a miss is never cached).
    await add_snapshot(db, sid, "late", _content(4))
    missing = PreparedSnapshots()
    assert await missing.load(db, sid, "late") is not None
