"""One LISTEN connection per process, fanned out in memory to its subscribers. A notification is only a
wake-up call (docs/architecture.md, "Past one database machine"): after each (re)connect every subscriber is
called with an empty payload (anything may have been missed) and ``on_connect`` runs. The connection goes to
the primary (:func:`~.db.open_connection`); its probe notices a node turned standby under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Final

import asyncpg

from service.aio import settle, wait_event
from service.store import queries
from service.store.db import OutageLog, is_unavailable, open_connection, plain_dsn
from service.store.execute import positional
from service.vocabulary import ALL_CHANNELS, CANCEL_CHANNEL, JOBS_CHANNEL, QUEUE_CHANNEL

log = logging.getLogger(__name__)

# A worker does not need the event notifications.
WORKER_CHANNELS = (QUEUE_CHANNEL, CANCEL_CHANNEL, JOBS_CHANNEL)

# A silent connection is probed every PROBE_S: a half-open socket (host gone, no FIN) never fires the
# termination listener, and LISTEN would wait on it forever.
PROBE_S = 5.0
PROBE_TIMEOUT_S = 3.0

Callback = Callable[[str, str], None]  # (channel, payload); must not block


class StandbyNow(Exception):
    """The LISTEN connection's node became a standby (a failover demoted it): reconnect."""


# A stop waits this long for the LISTEN task; a graceful close of its connection, this long.
STOP_WAIT_S: Final = 10.0
CLOSE_TIMEOUT_S: Final = 2.0


class Listener:
    """Holds the LISTEN connection, reconnects when it drops, and calls subscribers' callbacks."""

    def __init__(
        self,
        database_url: str,
        channels: tuple[str, ...] = ALL_CHANNELS,
        *,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        self._dsn = plain_dsn(database_url)
        self._channels = channels
        self._on_connect = on_connect
        self.connects = 0  # (re)connections made: tests and logs
        self.backend_pid: int | None = None  # of the LISTEN connection, while it is up
        self._subscribers: dict[str, set[Callback]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._stopping = False
        self._outages = OutageLog()

    def subscribe(self, channel: str, callback: Callback) -> Callable[[], None]:
        """Register ``callback`` for ``channel``; returns the function that unsubscribes it."""
        self._subscribers[channel].add(callback)
        return lambda: self._subscribers[channel].discard(callback)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sidequest-listener")
        await wait_event(self._connected, 10)

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await settle([self._task], STOP_WAIT_S, "LISTEN connection tasks")

    def _dispatch(self, _conn: object, _pid: int, channel: str, payload: str) -> None:
        for callback in list(self._subscribers.get(channel, ())):
            try:
                callback(channel, payload)
            except Exception:  # one broken subscriber must not starve the others
                log.exception("listener callback failed")

    def _wake_all(self) -> None:
        if self._on_connect is not None:
            try:
                self._on_connect()
            except Exception:
                log.exception("listener on_connect failed")
        for channel in self._channels:
            self._dispatch(None, 0, channel, "")

    async def _run(self) -> None:
        backoff = 0.2
        while not self._stopping:
            conn: asyncpg.Connection | None = None
            try:
                conn = await open_connection(self._dsn, command_timeout=None)
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                for channel in self._channels:
                    await conn.add_listener(channel, self._dispatch)
                self.connects += 1
                self.backend_pid = conn.get_server_pid()
                self._connected.set()
                self._wake_all()
                backoff = 0.2
                while not lost.is_set():
                    await wait_event(lost, PROBE_S)
                    probe, _ = positional(queries.node_in_recovery)
                    if not lost.is_set() and await conn.fetchval(probe, timeout=PROBE_TIMEOUT_S):
                        # Demoted under us: a standby's LISTEN would never hear the new primary.
                        raise StandbyNow("the LISTEN connection's node is a standby now")
            except Exception as exc:
                expected = is_unavailable(exc) or isinstance(exc, StandbyNow)
                if not expected or self._outages.due("LISTEN"):  # not once per reconnect try
                    log.warning("LISTEN connection lost (%s); reconnecting", exc)
            finally:
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(Exception):
                        # Bounded: asyncpg terminates the connection when a graceful close times out.
                        await conn.close(timeout=CLOSE_TIMEOUT_S)
            self._connected.clear()
            self.backend_pid = None
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
