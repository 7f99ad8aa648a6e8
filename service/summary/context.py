"""Context compaction with a content-keyed summary cache (SPEC §6.2).

The old part of the snapshot *copy* (``messages[:cut_plan.summarize_until]``) is replaced by a summary.
Summaries are cached under :func:`prefix_key` — a hash of the summarised messages' content, the
summariser model and :data:`PROMPT_VERSION` — so:

- the same content costs no summary call the second time (``hit``), whatever its snapshot id;
- another snapshot never reuses a summary of different content (the key would differ);
- a snapshot that extends an earlier one reuses the summary of their common prefix and summarises only
  the new messages, as an update of the cached document (``prefix``).

The key is a hash *chain* over messages, so the key of every prefix of a transcript comes out of one
pass, and "does the new transcript start with exactly the messages this entry covered?" is one lookup.
Saving is the store's job: this module only returns what to save, and only validated documents.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from service.budget import CutPlan, MessageGroup, estimate_text, group_messages
from service.summary.document import Provenance, SummaryDocument, render_summary
from service.summary.material import render_messages
from service.summary.policy import SummaryRunner
from service.summary.prompts import PROMPT_VERSION

CacheOutcome = Literal["hit", "prefix", "miss"]


def _canonical(value: Any) -> bytes:
    # Sorted keys and no whitespace: equal content gives equal bytes, however the JSON was written.
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str).encode()


def _chain(messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """``digests[k]`` = content digest of ``messages[:k]`` (k = 0..len)."""
    state = hashlib.sha256(b"sidequest-context-prefix-v1").digest()
    digests = [state]
    for message in messages:
        state = hashlib.sha256(state + hashlib.sha256(_canonical(message)).digest()).digest()
        digests.append(state)
    return digests


def _key(digest: bytes, model: str, prompt_version: str) -> str:
    return hashlib.sha256(digest + _canonical({"model": model, "prompt_version": prompt_version})).hexdigest()


def prefix_key(
    messages_prefix: Sequence[Mapping[str, Any]], model: str, prompt_version: str = PROMPT_VERSION
) -> str:
    """Cache key of a summary of exactly ``messages_prefix`` by ``model`` with these prompts (hex sha256)."""
    return _key(_chain(messages_prefix)[-1], model, prompt_version)


@dataclass(frozen=True)
class CachedContextSummary:
    """One validated context summary as kept in ``memory.context_summaries``.

    It covers ``messages[:covered_messages]`` of any snapshot whose prefix of that length has ``key``.
    ``snapshot_id`` is the snapshot it was first made for (informational: reuse goes by content).
    """

    key: str
    snapshot_id: str | None
    covered_messages: int
    document: SummaryDocument
    provenance: Provenance
    tokens: int
    created_at: str

    def rendered(self) -> str:
        """The summary as prompt text (provenance header + body)."""
        return render_summary(self.document, self.provenance)

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
    messages: Sequence[Mapping[str, Any]],
    groups: Sequence[MessageGroup],
    cut_plan: CutPlan,
    cache_entries: Sequence[CachedContextSummary],
    *,
    model: str,
    prompt_version: str = PROMPT_VERSION,
) -> Reuse:
    """Find the best cached summary for ``messages[:cut_plan.summarize_until]``.

    Exact key → :class:`CacheHit`. Otherwise the entry covering the *longest* prefix whose content hash
    matches the new transcript's prefix of the same length → :class:`PrefixReuse`. A prefix must end on a
    group boundary of the new transcript (a tool call and its result are never split between the cached
    summary and the new material) and be non-empty and shorter than the part to summarise.
    """
    until = cut_plan.summarize_until
    digests = _chain(messages[:until])
    keys_by_length = {
        length: _key(digests[length], model, prompt_version)
        for length in {g.start for g in groups if 0 < g.start <= until} | {until}
    }
    by_key = {entry.key: entry for entry in cache_entries}
    exact = by_key.get(keys_by_length[until])
    if exact is not None and exact.covered_messages == until:
        return CacheHit(exact)
    best: PrefixReuse | None = None
    for entry in cache_entries:
        length = entry.covered_messages
        if not 0 < length < until or keys_by_length.get(length) != entry.key:
            continue
        if best is None or length > best.covered_messages:
            best = PrefixReuse(entry, length)
    return best if best is not None else CacheMiss()


@dataclass(frozen=True)
class ContextCompaction:
    """What compaction produced: the summary to put in front of the kept messages, and what to cache.

    ``new_entry`` is None on a hit (already cached); otherwise the store saves it (guarded by
    ``clear_version``). ``calls`` counts provider attempts made here, ``chunks`` the chunks summarised.
    """

    document: SummaryDocument
    provenance: Provenance
    rendered_text: str
    tokens: int
    cache: CacheOutcome
    calls: int
    chunks: int
    summarized_messages: int
    kept_messages: int
    new_entry: CachedContextSummary | None


def _pieces(
    messages: Sequence[Mapping[str, Any]], groups: Sequence[MessageGroup], start: int, end: int
) -> list[str]:
    """One transcript piece per group in ``[start, end)`` (the chunker prefers to cut between them)."""
    return [
        render_messages([dict(m) for m in messages[g.start : g.end]], g.start)
        for g in groups
        if g.start >= start and g.end <= end
    ]


async def compact_context(
    runner: SummaryRunner,
    snapshot_id: str | None,
    messages: Sequence[Mapping[str, Any]],
    cut_plan: CutPlan,
    cache_entries: Sequence[CachedContextSummary],
    context_time: str | None,
) -> ContextCompaction:
    """Summarise ``messages[:cut_plan.summarize_until]`` (canonical messages), reusing the cache.

    Hit: no call. Prefix: only the messages after the cached prefix are summarised, as an update of the
    cached document. Miss: everything before the cut is summarised. Material larger than one call is
    chunked (each chunk an update of the running summary); the whole plan is checked against the call
    cap before the first call. Raises the summary / provider errors of the runner.
    """
    until = cut_plan.summarize_until
    groups = group_messages(messages)
    reuse = find_reusable(
        messages, groups, cut_plan, cache_entries, model=runner.model, prompt_version=runner.prompt_version
    )
    kept = len(messages) - until

    async def report(outcome: CacheOutcome, **extra: Any) -> None:
        if runner.on_progress is not None:
            await runner.on_progress(
                {"stage": "compacting_context", "what": "context_summary_cache", "cache": outcome, **extra}
            )

    if isinstance(reuse, CacheHit):
        await report("hit", key=reuse.entry.key, covered_messages=until)
        entry = reuse.entry
        return ContextCompaction(
            document=entry.document,
            provenance=entry.provenance,
            rendered_text=entry.rendered(),
            tokens=entry.tokens,
            cache="hit",
            calls=0,
            chunks=0,
            summarized_messages=until,
            kept_messages=kept,
            new_entry=None,
        )

    outcome: CacheOutcome
    previous: SummaryDocument | None
    if isinstance(reuse, PrefixReuse):
        start, previous, outcome = reuse.covered_messages, reuse.entry.document, "prefix"
        await report("prefix", key=reuse.entry.key, covered_messages=start, new_messages=until - start)
    else:
        start, previous, outcome = 0, None, "miss"
        await report("miss", new_messages=until)

    chunks = runner.chunk("context", _pieces(messages, groups, start, until))
    calls_before = runner.attempts_made
    document = await runner.summarize("context", chunks, previous)
    key = prefix_key(messages[:until], runner.model, runner.prompt_version)
    created_at = runner.now()
    provenance = Provenance.for_context(
        prefix_hash=key,
        start=0,
        end=until,
        model=runner.model,
        created_at=created_at,
        context_time=context_time,
    )
    rendered = render_summary(document, provenance)
    tokens = estimate_text(rendered)
    return ContextCompaction(
        document=document,
        provenance=provenance,
        rendered_text=rendered,
        tokens=tokens,
        cache=outcome,
        calls=runner.attempts_made - calls_before,
        chunks=len(chunks),
        summarized_messages=until,
        kept_messages=kept,
        new_entry=CachedContextSummary(
            key=key,
            snapshot_id=snapshot_id,
            covered_messages=until,
            document=document,
            provenance=provenance,
            tokens=tokens,
            created_at=created_at,
        ),
    )


__all__ = [
    "CacheHit",
    "CacheMiss",
    "CacheOutcome",
    "CachedContextSummary",
    "ContextCompaction",
    "PrefixReuse",
    "Reuse",
    "compact_context",
    "find_reusable",
    "prefix_key",
]
