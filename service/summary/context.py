"""Context compaction with a content-keyed summary cache (SPEC §6.2; docs/summaries.md, "Context
compaction and its cache"): the same content is a ``hit`` whatever its snapshot id, and a snapshot
that extends an earlier one summarises only its new messages (``prefix``). Returns what to save, and
only validated documents."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from service import vocabulary
from service.budget import MessageGroup, estimate_text
from service.budget.prepared import PreparedSnapshot
from service.budget.trail import render_trail
from service.summary.document import Provenance, SummaryDocument, render_summary
from service.summary.material import render_messages
from service.summary.prompts import PROMPT_VERSION
from service.summary.runner import SummaryRunner
from service.vocabulary import Stage

CacheOutcome = Literal["hit", "prefix", "miss"]


@dataclass(frozen=True)
class CachedContextSummary:
    """One validated context summary as kept in ``memory.context_summaries``: it covers
    ``messages[:covered_messages]`` of any snapshot whose prefix of that length has ``key``
    (``snapshot_id``, the one it was first made for, is informational: reuse goes by content)."""

    key: str
    snapshot_id: str | None
    covered_messages: int
    document: SummaryDocument
    provenance: Provenance
    tokens: int
    created_at: str
    # Who made it: a request, or a background job (SPEC §3 ``context_summary.made_by``).
    made_by: str = "request"
    # The artifact trail of the summarised groups (SPEC §6.9), for a summary of masked material;
    # deterministic, so it is cached with the summary it follows.
    trail: str | None = None

    def prompt_text(self) -> str:
        """What stands for the summarised messages in the answer request: the summary (provenance
        header + body), then its trail."""
        rendered = render_summary(self.document, self.provenance)
        return f"{rendered}\n\n{self.trail}" if self.trail else rendered

    def to_json(self) -> dict[str, Any]:
        """JSON form for the session memory (and v3 archives)."""
        return {
            "key": self.key,
            "snapshot_id": self.snapshot_id,
            "covered_messages": self.covered_messages,
            "document": self.document.to_json(),
            "provenance": self.provenance.to_json(),
            "tokens": self.tokens,
            "created_at": self.created_at,
            "made_by": self.made_by,
            **({"trail": self.trail} if self.trail else {}),
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> CachedContextSummary:
        """Inverse of :meth:`to_json`; the document is re-validated."""
        return cls(
            key=str(value["key"]),
            snapshot_id=value.get("snapshot_id"),
            covered_messages=int(value["covered_messages"]),
            document=SummaryDocument.from_json(value["document"]),
            provenance=Provenance.from_json(dict(value["provenance"])),
            tokens=int(value["tokens"]),
            created_at=str(value["created_at"]),
            made_by=str(value.get("made_by") or "request"),
            trail=value["trail"] if isinstance(value.get("trail"), str) else None,
        )


@dataclass(frozen=True)
class CacheHit:
    """An entry covers exactly the part to summarise: no call needed."""

    entry: CachedContextSummary


@dataclass(frozen=True)
class PrefixReuse:
    """An entry covers ``messages[:covered_messages]``, an exact prefix of the part to summarise."""

    entry: CachedContextSummary
    covered_messages: int


@dataclass(frozen=True)
class CacheMiss:
    """No entry is usable: summarise from scratch."""


Reuse = CacheHit | PrefixReuse | CacheMiss


def find_reusable(
    prepared: PreparedSnapshot,
    cache_entries: Sequence[CachedContextSummary],
    until: int,
    *,
    model: str,
    prompt_version: str = PROMPT_VERSION,
) -> Reuse:
    """The best cached summary for ``prepared.messages[:until]``: the exact key (:class:`CacheHit`),
    else the entry covering the *longest* non-empty shorter prefix that ends on a group boundary of
    this transcript (:class:`PrefixReuse`), else :class:`CacheMiss`."""
    exact = _cached_prefixes(prepared, cache_entries, {until}, model=model, prompt_version=prompt_version)
    if exact:
        return CacheHit(exact[-1].entry)  # a later entry of the same key stands for an earlier one
    boundaries = {g.start for g in prepared.groups if 0 < g.start < until}
    found = _cached_prefixes(prepared, cache_entries, boundaries, model=model, prompt_version=prompt_version)
    return max(found, key=lambda reuse: reuse.covered_messages, default=CacheMiss())


@dataclass(frozen=True)
class ContextCompaction:
    """What compaction produced: the summary to put in front of the kept messages, and what to cache
    (``new_entry``, None on a hit). ``calls`` counts the provider attempts made here, ``chunks`` the
    chunks of material summarised (a merge call is not a chunk)."""

    document: SummaryDocument
    provenance: Provenance
    tokens: int
    cache: CacheOutcome
    calls: int
    chunks: int
    new_entry: CachedContextSummary | None


def _piece(messages: Sequence[Mapping[str, Any]], group: MessageGroup) -> str:
    return render_messages(messages[group.start : group.end], group.start)


# Where a preparation keeps the transcript pieces rendered so far (PreparedSnapshot.memo), by group,
# and those of the groups' masked forms (SPEC §6.8: tier 2 summarises masked groups).
_PIECES = "summary.group_pieces"
_MASKED_PIECES = "summary.masked_group_pieces"
# Groups rendered per turn of the event loop while warming: ~0.3 ms of CPU at a time.
WARM_SLICE = 64


def snapshot_pieces(prepared: PreparedSnapshot, start: int, end: int, *, masked: bool = False) -> list[str]:
    """One transcript piece per group in ``[start, end)`` (the chunker prefers to cut between them), of
    the masked groups when ``masked``; each group is rendered at most once per snapshot (what
    :func:`warm_snapshot_pieces` rendered already is reused)."""
    raw: dict[int, str] = prepared.memo.setdefault(_PIECES, {})
    rendered: dict[int, str] = prepared.memo.setdefault(_MASKED_PIECES, {}) if masked else raw
    forms = prepared.masked() if masked else None
    pieces = []
    for index, group in enumerate(prepared.groups):
        if group.start >= start and group.end <= end:
            piece = rendered.get(index)
            if piece is None:
                if forms is not None and forms[index].masked_messages:
                    piece = render_messages(forms[index].messages, group.start)
                else:  # a group masking leaves as it is reads as itself (and may be warmed already)
                    piece = raw.get(index) or _piece(prepared.messages, group)
                    raw[index] = piece
                rendered[index] = piece
            pieces.append(piece)
    return pieces


async def warm_snapshot_pieces(prepared: PreparedSnapshot, slice_groups: int = WARM_SLICE) -> None:
    """Render every group's piece ahead of time, a slice per turn of the event loop: for a long
    snapshot a summary will likely be made of, ~7 ms of CPU then fills the wait on the database while it
    is stored, instead of delaying the summary's first call; slices keep other tasks waiting at most one."""
    rendered: dict[int, str] = prepared.memo.setdefault(_PIECES, {})
    for index, group in enumerate(prepared.groups):
        if index not in rendered:
            rendered[index] = _piece(prepared.messages, group)
        if index % slice_groups == slice_groups - 1:
            await asyncio.sleep(0)


def _cached_prefixes(
    prepared: PreparedSnapshot,
    cache_entries: Sequence[CachedContextSummary],
    boundaries: set[int],
    *,
    model: str,
    prompt_version: str,
) -> list[PrefixReuse]:
    """The entries that summarise this transcript's prefix of their length, among the lengths in
    ``boundaries`` (group boundaries: a tool call and its results are never split between a cached
    summary and what follows it)."""
    return [
        PrefixReuse(entry, entry.covered_messages)
        for entry in cache_entries
        if entry.covered_messages in boundaries
        and prepared.cache_key(entry.covered_messages, model, prompt_version) == entry.key
    ]


def longest_cached_prefix(
    prepared: PreparedSnapshot,
    cache_entries: Sequence[CachedContextSummary],
    *,
    model: str,
    prompt_version: str = PROMPT_VERSION,
) -> PrefixReuse | None:
    """The cached summary covering the longest prefix of the transcript (ending on a group boundary,
    shorter than the whole transcript), whatever the cut: SPEC §6.7's "grown snapshot" candidate."""
    boundaries = {g.start for g in prepared.groups if g.start > 0}
    found = _cached_prefixes(prepared, cache_entries, boundaries, model=model, prompt_version=prompt_version)
    return max(found, key=lambda reuse: reuse.covered_messages, default=None)


def covering_summary(
    prepared: PreparedSnapshot,
    cache_entries: Sequence[CachedContextSummary],
    until: int,
    *,
    model: str,
    prompt_version: str = PROMPT_VERSION,
) -> PrefixReuse | None:
    """The cached summary covering the *shortest* prefix of at least ``until`` messages (ending on a
    group boundary): with masking on, one made for a longer question covers a shorter one's needs as
    well (what it summarised beyond them is masked or verbatim in the other's plan, never both)."""
    boundaries = {g.start for g in prepared.groups if g.start >= until} | {len(prepared.digests) - 1}
    found = _cached_prefixes(prepared, cache_entries, boundaries, model=model, prompt_version=prompt_version)
    return min(found, key=lambda reuse: reuse.covered_messages, default=None)


async def compact_snapshot(
    runner: SummaryRunner,
    snapshot_id: str | None,
    prepared: PreparedSnapshot,
    until: int,
    cache_entries: Sequence[CachedContextSummary],
    context_time: str | None,
    *,
    masked: bool = False,
) -> ContextCompaction:
    """Summarise ``prepared.messages[:until]`` (a group boundary), reusing the cache: a hit makes no
    call, a prefix summarises only the messages after it, a miss everything before the cut. ``masked``:
    the summarised groups go in their masked form (SPEC §6.2 tier 2), and the new entry carries their
    artifact trail (§6.9). Raises the summary / provider errors of the runner."""
    reuse = find_reusable(
        prepared, cache_entries, until, model=runner.model, prompt_version=runner.prompt_version
    )

    async def report(outcome: CacheOutcome, **extra: Any) -> None:
        if runner.on_progress is not None:
            await runner.on_progress(
                vocabulary.context_summary_cache(outcome, stage=Stage.COMPACTING_CONTEXT, **extra)
            )

    calls = chunks = 0
    new_entry: CachedContextSummary | None = None
    if isinstance(reuse, CacheHit):
        await report("hit", key=reuse.entry.key, covered_messages=until)
        outcome: CacheOutcome = "hit"
        used = reuse.entry
    else:
        if isinstance(reuse, PrefixReuse):
            start, previous, outcome = reuse.covered_messages, reuse.entry.document, "prefix"
            await report("prefix", key=reuse.entry.key, covered_messages=start, new_messages=until - start)
        else:
            start, previous, outcome = 0, None, "miss"
            await report("miss", new_messages=until)
        chunk_texts = runner.chunk("context", snapshot_pieces(prepared, start, until, masked=masked))
        before = runner.attempts_made
        document = await runner.summarize("context", chunk_texts, previous)
        calls, chunks = runner.attempts_made - before, len(chunk_texts)
        key = prepared.cache_key(until, runner.model, runner.prompt_version)
        provenance = Provenance.for_context(
            prefix_hash=key,
            end=until,
            model=runner.model,
            created_at=runner.now(),
            context_time=context_time,
        )
        trail = render_trail(prepared.trail(prepared.group_index(until))) if masked else ""
        used = new_entry = CachedContextSummary(
            key=key,
            snapshot_id=snapshot_id,
            covered_messages=until,
            document=document,
            provenance=provenance,
            tokens=estimate_text(render_summary(document, provenance)),
            created_at=provenance.created_at,
            trail=trail or None,
        )
    return ContextCompaction(
        document=used.document,
        provenance=used.provenance,
        tokens=used.tokens,
        cache=outcome,
        calls=calls,
        chunks=chunks,
        new_entry=new_entry,
    )
