"""The worker's in-memory prepared snapshots (service/pipeline/snapshots.py): same result as the store,
read once, bounded, keyed by content hash (never stale, whatever was shared before a commit)."""

from __future__ import annotations

import asyncio
import hashlib
import json

from service.budget.prepared import prepare_snapshot
from service.pipeline.snapshots import PreparedSnapshots
from service.store.db import Database
from service.store.history import load_prepared_snapshot
from tests.factories import add_snapshot, make_session


def _hash(content: dict[str, object]) -> str:
    """The content hash tests.factories.add_snapshot stores."""
    return hashlib.sha256(json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def _content(n: int) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": f"message {i} of snapshot {n}"} for i in range(5)]}


async def test_a_snapshot_is_read_once_and_equals_the_stores(db: Database) -> None:
    sid = await make_session(db, "parent-cache")
    await add_snapshot(db, sid, "s1", _content(1))
    cache = PreparedSnapshots(capacity=2)
    first = await cache.load(db, sid, "s1")
    again = await cache.load(db, sid, "s1")
    async with db.sessions() as session, session.begin():
        loaded = await load_prepared_snapshot(session, sid, "s1")
    assert first is not None and again is first and loaded is not None
    read_hash, stored = loaded
    assert read_hash == _hash(_content(1))
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


async def test_an_entry_is_found_by_content_so_a_preparation_shared_early_is_never_wrong(
    db: Database,
) -> None:
    """The API shares a preparation before its transaction commits. Keyed by content hash, an entry
    whose snapshot was never stored (a refused admission) cannot answer for another content stored
    later under the same id; one whose content is stored is found without a read."""
    sid = await make_session(db, "parent-cache-early")
    cache = PreparedSnapshots()
    never_stored = _content(7)
    cache.put(_hash(never_stored), prepare_snapshot(never_stored))  # its admission rolled back
    await add_snapshot(db, sid, "s", _content(8))  # the same id, other content, later
    found = await cache.load(db, sid, "s")
    assert found is not None and found.messages == prepare_snapshot(_content(8)).messages
    assert (cache.hits, cache.misses) == (0, 1)
    # Shared before its commit, then stored: found by the hash the claim read, no read at all.
    shared = _content(9)
    cache.put(_hash(shared), prepare_snapshot(shared))
    await add_snapshot(db, sid, "t", shared)
    assert await cache.load(db, sid, "t", _hash(shared)) is not None
    assert await cache.load(db, sid, "t") is not None  # without the hash: one small read, then a hit
    assert (cache.hits, cache.misses) == (2, 1)


def _long(turns: int) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": f"turn {i}: " + "word " * 60} for i in range(turns)]}


async def test_warming_renders_the_transcript_pieces_in_the_background() -> None:
    from service.summary.context import snapshot_pieces

    cache = PreparedSnapshots()
    prepared = prepare_snapshot(_long(51))
    cache.warm(prepared)
    assert prepared.memo == {}  # nothing yet: it renders when the loop is free
    for _ in range(10):
        await asyncio.sleep(0)
    pieces = prepared.memo["summary.group_pieces"]
    assert len(pieces) == len(prepared.groups)
    assert snapshot_pieces(prepared, 0, len(prepared.messages)) == [
        pieces[i] for i in range(len(prepared.groups))
    ]
    await cache.close()


async def test_closing_stops_a_rendering_in_progress() -> None:
    cache = PreparedSnapshots()
    big = prepare_snapshot(_long(2000))
    cache.warm(big)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    await cache.close()
    rendered = len(big.memo.get("summary.group_pieces", {}))
    assert 0 < rendered < len(big.groups)
    await asyncio.sleep(0.01)
    assert len(big.memo["summary.group_pieces"]) == rendered  # nothing more once closed


async def test_the_worker_renders_a_snapshot_whose_job_the_api_expects(
    db: Database, database_url: str
) -> None:
    from service.worker import start_worker
    from tests.factories import scripted_settings

    worker = await start_worker(scripted_settings(database_url, "http://127.0.0.1:9"), db)
    try:
        prepared = prepare_snapshot(_long(400))
        worker.snapshots.warm(prepared)  # what sidequest serve's API calls (serve.create_serving_app)
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(prepared.memo["summary.group_pieces"]) == len(prepared.groups)
    finally:
        await worker.stop()
