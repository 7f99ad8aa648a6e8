"""The worker's most recently used prepared snapshots, an LRU by content hash in front of the store
(docs/pipeline.md, "preparing": why an entry is never stale). Reading a 2000-message preparation back costs
~10 ms per request; bounded by count, as an entry holds the canonical messages (1.8 MB for a 600 KB snapshot)
and, once a summary of it is due, its rendered transcript.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import OrderedDict

from service.budget.prepared import PreparedSnapshot
from service.store.db import Database
from service.store.history import load_prepared_snapshot, snapshot_content_hash
from service.summary.context import warm_snapshot_pieces


class PreparedSnapshots:
    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, PreparedSnapshot] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self._warming: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, content_hash: str, prepared: PreparedSnapshot) -> None:
        """Remember the preparation of the content with this hash (made elsewhere in this process)."""
        self._entries[content_hash] = prepared
        self._entries.move_to_end(content_hash)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def warm(self, prepared: PreparedSnapshot) -> None:
        """Render ``prepared``'s transcript pieces in the background: a summary of it will be made soon."""
        task = asyncio.get_running_loop().create_task(warm_snapshot_pieces(prepared))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def close(self) -> None:
        """Stop the renderings still running (the worker stops)."""
        for task in list(self._warming):
            task.cancel()
        for task in list(self._warming):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def load(
        self, db: Database, session_id: uuid.UUID, snapshot_id: str, content_hash: str | None = None
    ) -> PreparedSnapshot | None:
        """The snapshot as prepared when stored; None when the session does not have it.
        ``content_hash``: the stored snapshot's hash when the caller has it (a claim returns it)."""
        if content_hash is None:
            async with db.connection() as conn:
                content_hash = await snapshot_content_hash(conn, session_id, snapshot_id)
            if content_hash is None:
                return None
        found = self._entries.get(content_hash)
        if found is not None:
            self._entries.move_to_end(content_hash)
            self.hits += 1
            return found
        self.misses += 1
        async with db.sessions() as session, session.begin():
            loaded = await load_prepared_snapshot(session, session_id, snapshot_id)
        if loaded is None:
            return None
        read_hash, prepared = loaded
        self.put(read_hash, prepared)
        return prepared
