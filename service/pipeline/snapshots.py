"""The worker's most recently used prepared snapshots, kept in memory (issue 12: "a request loads only
what it needs").

A stored snapshot never changes (SPEC §3: the same id with other content is a 409), and its
preparation is a pure function of its content, so an entry can never be stale: no invalidation, no
coherence between processes. Reading the preparation of a 2000-message snapshot from PostgreSQL and
rebuilding it costs ~10 ms per request (the transfer, the JSON decode, the groups and digests); a
session's next questions — and the background job its snapshot triggered — mostly name the same one.
Bounded by count: each entry holds one snapshot's canonical messages (1.8 MB for a 600 KB one).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Final

from service.budget.prepared import PreparedSnapshot
from service.store.db import Database
from service.store.history import load_prepared_snapshot

CAPACITY: Final = 8


class PreparedSnapshots:
    """A small LRU of prepared snapshots by (session, snapshot id), in front of the store."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[uuid.UUID, str], PreparedSnapshot] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, session_id: uuid.UUID, snapshot_id: str, prepared: PreparedSnapshot) -> None:
        """Remember a snapshot prepared elsewhere in this process (``sidequest serve``: the API just
        stored it, so the question it came with need not read it back)."""
        if self.capacity <= 0:
            return
        key = (session_id, snapshot_id)
        self._entries[key] = prepared
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    async def load(self, db: Database, session_id: uuid.UUID, snapshot_id: str) -> PreparedSnapshot | None:
        """The snapshot as prepared when stored; None when the session does not have it."""
        key = (session_id, snapshot_id)
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        async with db.sessions() as session:
            prepared = await load_prepared_snapshot(session, session_id, snapshot_id)
        if prepared is not None:
            self.put(session_id, snapshot_id, prepared)
        return prepared


__all__ = ["CAPACITY", "PreparedSnapshots"]
