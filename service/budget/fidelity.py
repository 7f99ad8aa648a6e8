"""What of the snapshot reached the model (SPEC §6.10 ``context_info.fidelity``), counted from the
plan the answer request was built from, never estimated. An artifact is *in the prompt* when the
request carries its text: in a kept tool call (masking never elides a key argument) or in the trail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from service.budget.ladder import MASKED, NONE, SUMMARY, Tier
from service.budget.masking import Artifact, MaskedGroup
from service.budget.messages import MessageGroup
from service.budget.trail import TrailEntry


@dataclass(frozen=True)
class Fidelity:
    """``context_info.fidelity`` of one answer request."""

    tier: Tier
    verbatim_messages: int
    masked_messages: int
    masked_payload_bytes: int
    summarized_messages: int
    artifacts_total: int
    artifacts_in_prompt: int

    def to_json(self) -> dict[str, Any]:
        value = asdict(self)
        total, in_prompt = value.pop("artifacts_total"), value.pop("artifacts_in_prompt")
        return {**value, "artifacts": {"total": total, "in_prompt": in_prompt}}


def measure_fidelity(
    groups: Sequence[MessageGroup],
    masked: Sequence[MaskedGroup],
    artifacts: Sequence[Sequence[tuple[Artifact, bool]]],
    *,
    summarize_until: int,
    mask_until: int,
    trail: Sequence[TrailEntry] = (),
) -> Fidelity:
    """Fidelity of a plan over ``groups``: groups ``[0, summarize_until)`` summarised (their trail
    ``trail``), ``[summarize_until, mask_until)`` in their ``masked`` form, the rest verbatim."""
    total_messages = groups[-1].end if groups else 0
    summarized = groups[summarize_until - 1].end if summarize_until > 0 else 0
    masked_messages = sum(g.masked_messages for g in masked[summarize_until:mask_until])
    payload = sum(g.payload_bytes for g in masked[summarize_until:mask_until])
    everything = {artifact for found in artifacts for artifact, _ in found}
    carried = {artifact for found in artifacts[summarize_until:] for artifact, _ in found}
    carried.update(entry.artifact for entry in trail)
    return Fidelity(
        tier=SUMMARY if summarize_until > 0 else MASKED if mask_until > 0 else NONE,
        verbatim_messages=total_messages - summarized - masked_messages,
        masked_messages=masked_messages,
        masked_payload_bytes=payload,
        summarized_messages=summarized,
        artifacts_total=len(everything),
        artifacts_in_prompt=len(everything & carried),
    )
