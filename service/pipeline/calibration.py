"""The pipeline's side of calibration (SPEC §5.1, docs/budget.md): load the counters, record samples.

A sample is best effort: a database failure while writing one is logged and dropped — a missed sample
costs a little precision, failing the request over it would cost the answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from service.budget import Calibration
from service.store import calibration as store
from service.store.db import DB_ERRORS, Database

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationBook:
    """Calibration counters of one provider, read and written through the store."""

    db: Database
    provider: str
    enabled: bool = True

    async def snapshot(self, model: str) -> Calibration:
        """The counters of ``model`` as they stand now (empty when calibration is off)."""
        if not self.enabled:
            return Calibration.empty()
        async with self.db.connection() as conn:
            return await store.load_calibration(conn, self.provider, model)

    def pending(self, model: str, estimate: int, reported_prompt_tokens: int | None) -> store.Sample | None:
        """The sample :meth:`sample` would write, for the caller's transaction (the success's); None
        when calibration is off or nothing was reported (the store drops a zero count or estimate)."""
        if not self.enabled or reported_prompt_tokens is None:
            return None
        return store.Sample(self.provider, model, estimate, reported_prompt_tokens)

    async def sample(self, model: str, estimate: int, reported_prompt_tokens: int | None) -> None:
        """Add one sample: ``estimate`` (the request as sent) against the provider's prompt tokens."""
        if not self.enabled or reported_prompt_tokens is None or reported_prompt_tokens <= 0:
            return
        try:
            async with self.db.sessions() as session, session.begin():
                await store.add_sample(session, self.provider, model, estimate, reported_prompt_tokens)
        except DB_ERRORS as exc:
            log.warning("calibration sample for %s dropped: %s", model, type(exc).__name__)
