"""Calibration counters per (provider, model) (SPEC §5.1), shared by every process and tenant (they
describe a tokenizer, not a customer). A sample is ONE atomic upsert, so no increment is lost; the
ratio is the pure :class:`service.budget.Calibration`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.budget import Calibration
from service.store import queries
from service.store.execute import Executor, execute, fetch_one
from service.store.models import CALIBRATION_MODEL_CHARS, CALIBRATION_PROVIDER_CHARS


def _key(provider: str, model: str) -> dict[str, str]:
    # Cut to the key columns' sizes: a sample must never fail a request.
    return {"provider": provider[:CALIBRATION_PROVIDER_CHARS], "model": model[:CALIBRATION_MODEL_CHARS]}


async def load_calibration(tx: Executor, provider: str, model: str) -> Calibration:
    """The counters of (``provider``, ``model``) as a :class:`Calibration` (empty when none)."""
    row = await fetch_one(tx, queries.load_calibration, _key(provider, model))
    if row is None:
        return Calibration.empty()
    return Calibration(int(row["samples"]), int(row["sum_estimate"]), int(row["sum_provider"]))


@dataclass(frozen=True)
class Sample:
    """One calibration sample waiting to be written (with the request's success, in one commit)."""

    provider: str
    model: str
    estimate: int
    reported_prompt_tokens: int


async def add_sample(
    tx: Executor, provider: str, model: str, estimate: int, reported_prompt_tokens: int | None
) -> bool:
    """Add one sample (``estimate`` as sent, the provider's prompt tokens), unless unreported usage or
    an empty estimate carry no signal about the tokenizer; whether a sample was written."""
    if reported_prompt_tokens is None or reported_prompt_tokens <= 0 or estimate <= 0:
        return False
    await execute(
        tx,
        queries.add_calibration_sample,
        {**_key(provider, model), "estimate": estimate, "reported": reported_prompt_tokens},
    )
    return True
