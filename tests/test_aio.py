"""service.aio.wait_event: a cancellation is never swallowed (Python 3.11's asyncio.wait_for swallows
it when the awaited event is set in the same step, and the worker's stop would then hang)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import uuid
from dataclasses import dataclass

import pytest

from service.aio import all_or_first_failure, settle, wait_event
from service.worker.runner import SlotPool


async def _waiting(waiter: asyncio.Task[object]) -> None:
    for _ in range(5):  # let the task reach its wait
        await asyncio.sleep(0)
    assert not waiter.done()


async def test_wait_event_returns_whether_the_event_is_set() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, 5) is True
    assert await wait_event(event, 0) is True


async def test_a_cancel_in_the_step_that_sets_the_event_propagates() -> None:
    event = asyncio.Event()
    task = asyncio.ensure_future(wait_event(event, 30))
    await _waiting(task)
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the race is Python 3.11's (gh-86296)")
async def test_the_race_is_real_with_asyncio_wait_for() -> None:
    """The same steps with asyncio.wait_for: the cancel is swallowed (why wait_event exists)."""
    event = asyncio.Event()
    task = asyncio.ensure_future(asyncio.wait_for(event.wait(), 30))
    await _waiting(task)
    event.set()
    task.cancel()
    assert await task is True  # returned normally: the cancellation is lost


async def test_a_slot_pool_woken_as_it_is_cancelled_still_stops() -> None:
    claims = 0

    @dataclass
    class Work:
        id: uuid.UUID
        owner: str = "w1"

    async def claim() -> tuple[Work | None, bool]:
        nonlocal claims
        claims += 1
        return None, False

    async def run(_work: Work) -> None:
        raise AssertionError("nothing to run")

    async def settle(_work: Work, _reason: str) -> None:
        raise AssertionError("nothing to settle")

    pool: SlotPool[Work] = SlotPool("request", 2, claim=claim, run=run, settle=settle, poll_s=30)
    task = asyncio.ensure_future(pool.loop())
    await _waiting(task)
    assert claims == 1
    pool.wake(freed=True)  # a request ended somewhere, in the same step as the worker's stop
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)  # a lost cancel would be a TimeoutError: the loop runs on
    assert task.cancelled()


async def test_work_claimed_again_while_its_stale_run_goes_on_stops_that_run_and_keeps_the_new() -> None:
    """After a database outage longer than the lease, the sweep can re-queue a request this very
    process is still running, and it claims it again. The stale run's end must not remove the new
    run from the pool, or the heartbeat stops renewing its lease and it fails as worker_lost."""

    @dataclass
    class Work:
        id: uuid.UUID
        attempt: int
        owner: str = "w1"

    release = asyncio.Event()
    settled: list[tuple[int, str]] = []

    async def claim() -> tuple[Work | None, bool]:
        return None, False

    async def run(work: Work) -> None:
        await release.wait()

    async def settle(work: Work, reason: str) -> None:
        settled.append((work.attempt, reason))

    pool: SlotPool[Work] = SlotPool("request", 2, claim=claim, run=run, settle=settle, poll_s=30)
    wid = uuid.uuid4()
    pool._spawn(Work(wid, 1, "w1#first"))
    first = pool.tasks[wid]
    await asyncio.sleep(0)
    pool._spawn(Work(wid, 2, "w1#second"))  # the same request, claimed again
    second = pool.tasks[wid]
    assert second is not first
    assert pool.held() == {wid: "w1#second"}  # the heartbeat renews the new claim's lease only
    await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), 2)
    assert settled == [(1, "lost")]  # the stale run was stopped as lost, nothing written for it
    assert pool.tasks == {wid: second} and not second.done()  # the new run is still the pool's
    pool.cancel(wid, "cancelled")  # and can still be cancelled (its reason is its own)
    await asyncio.wait_for(asyncio.gather(second, return_exceptions=True), 2)
    assert settled == [(1, "lost"), (2, "cancelled")] and pool.tasks == {}


async def test_a_worker_loop_logs_the_database_being_away_as_one_line_now_and_then(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While PostgreSQL is stopped each worker loop says so in one line now and then, not a ~65-line
    traceback a second. A bug still gets its traceback."""
    from service.store import db
    from service.store.db import DatabaseUnavailable
    from service.worker import runner

    outages = db.OutageLog()
    caplog.set_level(logging.WARNING, logger=runner.log.name)
    for _ in range(5):
        try:
            raise DatabaseUnavailable("connection refused")
        except DatabaseUnavailable:
            runner.log_loop_failure("heartbeat failed", outages)
    outage = [r for r in caplog.records if r.message.startswith("heartbeat failed")]
    assert len(outage) == 1 and outage[0].levelno == logging.WARNING and outage[0].exc_info is None
    assert "the database is unavailable" in outage[0].message
    try:
        raise KeyError("a bug")
    except KeyError:
        runner.log_loop_failure("recovery sweep failed", outages)
    bug = [r for r in caplog.records if r.message == "recovery sweep failed"]
    assert len(bug) == 1 and bug[0].levelno == logging.ERROR and bug[0].exc_info is not None


def test_the_drivers_own_retries_log_one_line_now_and_then_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Left alone, asyncpg's pool logs "Failed to restore the pool connection floor" with a ~20-line
    traceback on every try of an outage, and the LISTEN loss once per reconnect try."""
    from service.store import db

    db.quiet_driver_outages()
    for quiet in logging.getLogger("asyncpg.pool").filters:
        if isinstance(quiet, db.QuietOutages):
            quiet.outages.said_at.clear()
    pool_log = logging.getLogger("asyncpg.pool")
    caplog.set_level(logging.WARNING, logger="asyncpg.pool")
    for _ in range(4):
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError:
            pool_log.warning("Failed to restore the pool connection floor; retrying", exc_info=True)
    lines = [r for r in caplog.records if r.name == "asyncpg.pool"]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert "the database is unavailable" in lines[0].getMessage()
    try:
        raise KeyError("a bug")
    except KeyError:
        pool_log.warning("something else broke", exc_info=True)
    assert caplog.records[-1].exc_info is not None  # anything else keeps its traceback


async def test_settle_returns_when_a_task_ignores_its_stop_and_names_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def stuck() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await release.wait()  # a settle that never ends (a database that stopped answering)

    task = asyncio.create_task(stuck(), name="stuck-request")
    quick = asyncio.create_task(asyncio.sleep(0), name="quick-request")
    await asyncio.sleep(0)
    task.cancel()
    with caplog.at_level(logging.WARNING, logger="service.aio"):
        await asyncio.wait_for(settle([task, quick], 0.2, "request tasks"), timeout=5)
    assert quick.done() and not task.done()
    assert [r.getMessage() for r in caplog.records if "stuck-request" in r.getMessage()]
    assert not [r for r in caplog.records if "quick-request" in r.getMessage()]
    release.set()
    await task


async def test_all_or_first_failure_gives_results_in_order_or_the_first_failure_once_all_ended() -> None:
    async def value(v: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return v

    assert await all_or_first_failure([value(1, 0.02), value(2, 0)]) == [1, 2]
    assert await all_or_first_failure([]) == []
    cleaned: list[str] = []

    async def slow() -> int:
        try:
            await asyncio.sleep(10)
        finally:
            cleaned.append("slow")  # its own cleanup ran before the failure reached the caller
        return 0

    async def fails() -> int:
        await asyncio.sleep(0)
        raise ValueError("first")

    with pytest.raises(ValueError, match="first") as caught:
        await all_or_first_failure([slow(), fails()])
    assert cleaned == ["slow"]
    assert caught.value.__context__ is None  # raised as it came, not chained to anything of ours


async def test_all_or_first_failure_leaves_a_cancelled_caller_cancelled() -> None:
    """A child that raises while it is being cancelled does not turn the caller's cancellation into
    its error (a TaskGroup would)."""

    async def raises_when_cancelled() -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None
        return 0

    caller = asyncio.ensure_future(all_or_first_failure([raises_when_cancelled(), asyncio.sleep(10)]))
    await _waiting(caller)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
