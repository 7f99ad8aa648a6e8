"""The rolling Q&A summary (SPEC §6.1): older side Q&A folded into one summary by *updating* it, so
what the first fold established survives fold after fold (docs/summaries.md, "Rolling Q&A summary").
The result carries our provenance (ordinal range, context time) and is returned for the store to save.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from service.budget import estimate_text
from service.summary.document import Provenance, SummaryDocument, render_summary
from service.summary.material import QAPair, render_qa_pair
from service.summary.runner import SummaryRunner


@dataclass(frozen=True)
class StoredQASummary:
    """A validated rolling Q&A summary as kept in ``memory.qa_summary``; ``tokens`` estimates
    :meth:`rendered`, the text that goes into the answer prompt."""

    document: SummaryDocument
    provenance: Provenance
    first_ordinal: int
    covered_through_ordinal: int
    tokens: int
    # Who made this version: a request, or a background job (SPEC §3 ``qa_summary.made_by``).
    made_by: str = "request"

    def rendered(self) -> str:
        return render_summary(self.document, self.provenance)

    def to_json(self) -> dict[str, Any]:
        """JSON form for the session memory (and v3 archives)."""
        return {
            "document": self.document.to_json(),
            "provenance": self.provenance.to_json(),
            "first_ordinal": self.first_ordinal,
            "covered_through_ordinal": self.covered_through_ordinal,
            "tokens": self.tokens,
            "updated_at": self.provenance.created_at,
            "made_by": self.made_by,
            # The prompt text too, so that the store can hand it off without the summary layer.
            "rendered": self.rendered(),
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> StoredQASummary:
        """Inverse of :meth:`to_json`; the document is re-validated."""
        return cls(
            document=SummaryDocument.from_json(value["document"]),
            provenance=Provenance.from_json(value["provenance"]),
            first_ordinal=int(value["first_ordinal"]),
            covered_through_ordinal=int(value["covered_through_ordinal"]),
            tokens=int(value["tokens"]),
            made_by=str(value.get("made_by") or "request"),
        )


def _new_pairs(previous: StoredQASummary | None, batches: Sequence[Sequence[QAPair]]) -> list[list[QAPair]]:
    """Batches without pairs the previous summary already covers (folding one twice would count its
    conclusions twice); the rest must ascend throughout."""
    covered = previous.covered_through_ordinal if previous is not None else None
    fresh = [[pair for pair in batch if covered is None or pair.ordinal > covered] for batch in batches]
    if any(a.ordinal >= b.ordinal for a, b in pairwise(pair for batch in fresh for pair in batch)):
        raise ValueError("Q&A pairs must be in strictly ascending ordinal")
    return [batch for batch in fresh if batch]


async def fold_qa(
    runner: SummaryRunner,
    previous: StoredQASummary | None,
    batches: Sequence[Sequence[QAPair]],
    context_time: str | None,
) -> StoredQASummary | None:
    """Fold ``batches`` of Q&A pairs (ascending ordinals) into ``previous``, all batches' calls
    reserved together before any call (docs/summaries.md, "Rolling Q&A summary"). ``context_time``
    None keeps ``previous``'s. Returns the new summary, ``previous`` when there is nothing new, or None
    when there is nothing at all."""
    fresh = _new_pairs(previous, batches)
    if not fresh:
        return previous
    plans = [runner.chunk("qa", [render_qa_pair(pair) for pair in batch]) for batch in fresh]
    total = sum(len(chunks) for chunks in plans)
    plan = runner.plan("qa", total)
    document = previous.document if previous is not None else None
    # In parallel mode batches are only a loading unit: all their chunks at once need one merge.
    runs = [[chunk for chunks in plans for chunk in chunks]] if plan.parallel else plans
    done = 0
    with runner.budget.reserve(plan.calls) as reservation:
        for chunks in runs:
            document = await runner.summarize(
                "qa",
                chunks,
                document,
                progress_offset=done,
                progress_total=total,
                parallel=plan.parallel,
                reservation=reservation,
            )
            done += len(chunks)
    assert document is not None
    first = previous.first_ordinal if previous is not None else fresh[0][0].ordinal
    through = fresh[-1][-1].ordinal
    provenance = Provenance.for_qa(
        first_ordinal=first,
        covered_through_ordinal=through,
        model=runner.model,
        created_at=runner.now(),
        context_time=context_time or (previous.provenance.context_time if previous is not None else None),
    )
    return StoredQASummary(
        document=document,
        provenance=provenance,
        first_ordinal=first,
        covered_through_ordinal=through,
        tokens=estimate_text(render_summary(document, provenance)),
    )
