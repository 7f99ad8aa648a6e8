"""Calibration counters in PostgreSQL (SPEC 5.1): one atomic upsert per sample, shared by processes."""

from __future__ import annotations

import asyncio

from service.budget import Calibration
from service.store import calibration as store
from service.store.db import Database
from service.store.stats import read_request_stats


async def _sample(db: Database, model: str, estimate: int, reported: int | None) -> bool:
    async with db.sessions() as session, session.begin():
        return await store.add_sample(session, "openai", model, estimate, reported)


async def test_concurrent_samples_are_never_lost(db: Database) -> None:
    # 40 writers at once (as many workers would): the upsert increments in place, no lost update.
    results = await asyncio.gather(*(_sample(db, "m", 100, 150 + i % 2) for i in range(40)))
    assert all(results)
    async with db.sessions() as session:
        calibration = await store.load_calibration(session, "openai", "m")
    assert calibration == Calibration(samples=40, estimate_sum=4000, provider_sum=40 * 150 + 20)


async def test_unreported_and_empty_samples_write_nothing(db: Database) -> None:
    assert not await _sample(db, "m", 100, None)
    assert not await _sample(db, "m", 100, 0)
    assert not await _sample(db, "m", 0, 120)
    async with db.sessions() as session:
        assert await store.load_calibration(session, "openai", "m") == Calibration.empty()
        assert (await read_request_stats(session)).calibration == []


async def test_counters_are_keyed_by_provider_and_model(db: Database) -> None:
    await _sample(db, "a", 100, 200)
    await _sample(db, "b", 100, 50)
    async with db.sessions() as session:
        async with session.begin():
            await store.add_sample(session, "anthropic", "a", 10, 10)
        rows = (await read_request_stats(session)).calibration
    assert [(provider, model, samples) for provider, model, samples, _, _ in rows] == [
        ("anthropic", "a", 1),
        ("openai", "a", 1),
        ("openai", "b", 1),
    ]
