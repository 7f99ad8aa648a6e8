"""Stage ``compacting_context`` (SPEC §6.2, §6.6, §6.7): a compacted *copy* of the main context.

In order, the cheapest way that fits wins:

1. **hit** — the cache holds the summary of exactly the prefix the cut summarises: no call;
2. **grown snapshot** (§6.7) — a cached summary covers a shorter prefix, and that summary followed by
   *every* later message verbatim (more than the 8000-token recent budget of them) fits the input
   budget: answered at once (``cache: "prefix"``, 0 calls), and a background job extends the summary
   afterwards. Such a request never waits for a job;
3. **wait** — a background job is making this summary (for this snapshot, or for the same content
   under another id): wait for it within the deadline and use it (``made_by: "background"``);
4. **make it** — registered for single flight, summarise the part after the longest cached prefix
   (``prefix``) or everything before the cut (``miss``), and cache it (guarded by ``clear_version``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from service import vocabulary
from service.budget import RECENT_BUDGET_TOKENS, CutPlan, CutRefusal, plan_cut
from service.budget.prepared import PreparedSnapshot
from service.pipeline.failures import RequestLost
from service.pipeline.prepare import Prepared, parse_cache
from service.pipeline.runtime import RequestRuntime
from service.pipeline.waiting import registered, wait_for_background_jobs
from service.store import jobs, memory
from service.summary.context import (
    CachedContextSummary,
    CacheHit,
    ContextCompaction,
    compact_snapshot,
    find_reusable,
    longest_cached_prefix,
)
from service.summary.runner import SummaryRunner
from service.vocabulary import JobKind

# "Does it fit?" for a context made of this summary text and these kept messages (their estimate).
FitCheck = Callable[[str | None, Sequence[dict[str, Any]], int], bool]


def snapshot_job_key(snapshot_id: str) -> str:
    """The key a snapshot-stored job is queued under, before it knows its summary's cache key."""
    return f"snapshot:{snapshot_id}"


@dataclass
class ContextPlan:
    """The compacted copy: the summary in front (None: none) and the messages kept verbatim."""

    summary: CachedContextSummary | None
    kept_from: int
    cache: str = "none"
    calls: int = 0
    chunks: int = 0
    made_by: str | None = None
    waited_ms: int = 0
    # §6.7: answered with a cached prefix and a long verbatim tail; a job should extend the summary.
    extend_later: bool = False

    def kept_messages(self, snapshot: PreparedSnapshot | None) -> list[dict[str, Any]]:
        return list(snapshot.messages[self.kept_from :]) if snapshot else []

    def kept_tokens(self, snapshot: PreparedSnapshot | None) -> int:
        return snapshot.tokens_of(self.kept_from) if snapshot else 0


def uncompacted() -> ContextPlan:
    """The whole snapshot verbatim."""
    return ContextPlan(summary=None, kept_from=0)


def _record(rt: RequestRuntime, plan: ContextPlan, snapshot: PreparedSnapshot) -> None:
    info = rt.info.context_summary
    assert info is not None
    info.used = plan.summary is not None
    info.cache = plan.cache  # type: ignore[assignment]
    info.summarized_messages = plan.kept_from if plan.summary is not None else 0
    info.kept_messages = len(snapshot.messages) - plan.kept_from
    info.calls += plan.calls
    info.chunks += plan.chunks
    info.made_by = plan.made_by  # type: ignore[assignment]
    info.waited_ms += plan.waited_ms
    rt.sync_calls()


async def _reload_cache(rt: RequestRuntime) -> list[CachedContextSummary]:
    async with rt.db.connection() as conn:
        mem = await memory.load_memory(conn, rt.claimed.session_id)
    return parse_cache(mem.get("context_summaries") or [])


async def _wait_for_jobs(rt: RequestRuntime, keys: set[str]) -> int | None:
    """Wait for the session's active context jobs with one of ``keys``; ms waited, None if none."""
    async with rt.db.connection() as conn:
        active = await jobs.active_jobs(conn, rt.claimed.session_id, JobKind.CONTEXT_SUMMARY)
    return await wait_for_background_jobs(
        rt, [job for job in active if job.key in keys and job.made_by == "background"]
    )


def _hit(entry: CachedContextSummary, until: int, waited_ms: int = 0) -> ContextPlan:
    made_by = "background" if entry.made_by == "background" else "request"
    return ContextPlan(summary=entry, kept_from=until, cache="hit", made_by=made_by, waited_ms=waited_ms)


async def compact(
    rt: RequestRuntime,
    prepared: Prepared,
    runner: SummaryRunner,
    fits: FitCheck,
    *,
    recent_budget: int = RECENT_BUDGET_TOKENS,
    min_summarized: int | None = None,
    current: ContextPlan | None = None,
) -> ContextPlan | None:
    """Compact the snapshot copy; None (with a progress event saying why) when it cannot help."""
    snapshot = prepared.snapshot
    if snapshot is None or not snapshot.messages:
        await rt.progress(vocabulary.compaction_skipped("no snapshot messages"), defer=True)
        return None
    kwargs: dict[str, int] = {"recent_budget": recent_budget}
    if min_summarized is not None:
        kwargs["min_summarized_tokens"] = min_summarized
    cut = plan_cut(snapshot.groups, **kwargs)
    if isinstance(cut, CutRefusal):
        await rt.progress(vocabulary.compaction_refused(cut.reason, cut.explanation))
        return None
    if current is not None and current.summary is not None and cut.summarize_until <= current.kept_from:
        await rt.progress(vocabulary.compaction_refused("no_further_cut"), defer=True)
        return None
    plan = await _plan(rt, prepared, runner, fits, cut, retrying=current is not None)
    _record(rt, plan, snapshot)
    return plan


async def _plan(
    rt: RequestRuntime,
    prepared: Prepared,
    runner: SummaryRunner,
    fits: FitCheck,
    cut: CutPlan,
    *,
    retrying: bool,
) -> ContextPlan:
    snapshot = prepared.snapshot
    assert snapshot is not None
    until = cut.summarize_until
    model = runner.model
    version = runner.prompt_version  # the session's summary instructions are part of the key
    cache = list(prepared.cache)
    key = snapshot.cache_key(until, model, version)

    def find_hit(entries: Sequence[CachedContextSummary]) -> CachedContextSummary | None:
        reuse = find_reusable(
            snapshot.messages,
            snapshot.groups,
            cut,
            entries,
            model=model,
            prompt_version=version,
            digests=snapshot.digests,
        )
        return reuse.entry if isinstance(reuse, CacheHit) else None

    entry = find_hit(cache)
    if entry is not None:
        await rt.progress(
            vocabulary.context_summary_cache("hit", key=entry.key, covered_messages=until), defer=True
        )
        return _hit(entry, until)

    if not retrying:
        grown = longest_cached_prefix(
            snapshot.groups, cache, snapshot.digests, model=model, prompt_version=version
        )
        if grown is not None and grown.covered_messages < until:
            tail = snapshot.tokens_of(grown.covered_messages)
            if tail > RECENT_BUDGET_TOKENS and fits(
                grown.entry.rendered(), snapshot.messages[grown.covered_messages :], tail
            ):
                await rt.progress(
                    vocabulary.context_summary_cache(
                        "prefix",
                        key=grown.entry.key,
                        covered_messages=grown.covered_messages,
                        verbatim_tail_tokens=tail,
                        answered_without_waiting=True,
                    ),
                    defer=True,
                )
                return ContextPlan(
                    summary=grown.entry,
                    kept_from=grown.covered_messages,
                    cache="prefix",
                    made_by="background" if grown.entry.made_by == "background" else "request",
                    extend_later=True,
                )

    waited_ms = 0
    keys = {key}
    if prepared.claimed.snapshot_id is not None:
        keys.add(snapshot_job_key(prepared.claimed.snapshot_id))
    for attempt in range(2):
        if rt.deps.settings.background_on and (attempt > 0 or rt.claimed.jobs_active):
            waited = await _wait_for_jobs(rt, keys)
            if waited is not None:
                waited_ms += waited
                cache = await _reload_cache(rt)
                entry = find_hit(cache)
                if entry is not None:
                    await rt.progress(
                        vocabulary.context_summary_cache("hit", key=entry.key, waited_ms=waited_ms),
                        defer=True,
                    )
                    return _hit(entry, until, waited_ms)
        async with registered(
            rt.db,
            rt.claimed.session_id,
            kind=JobKind.CONTEXT_SUMMARY,
            key=key,
            request_id=rt.claimed.id,
            owner=rt.owner,
            clear_version=rt.claimed.clear_version,
            lease_s=rt.remaining_s() + 30.0,
        ) as mine:
            if mine or attempt == 1 or not rt.deps.settings.background_on:
                result = await _make(rt, prepared, runner, cut, cache)
                return ContextPlan(
                    summary=result.new_entry or _entry_of(result, key, prepared),
                    kept_from=until,
                    cache=result.cache,
                    calls=result.calls,
                    chunks=result.chunks,
                    made_by="request",
                    waited_ms=waited_ms,
                )
    raise AssertionError("unreachable: the second attempt always makes the summary")


def _entry_of(result: ContextCompaction, key: str, prepared: Prepared) -> CachedContextSummary:
    return CachedContextSummary(
        key=key,
        snapshot_id=prepared.claimed.snapshot_id,
        covered_messages=result.summarized_messages,
        document=result.document,
        provenance=result.provenance,
        tokens=result.tokens,
        created_at=result.provenance.created_at,
    )


async def _make(
    rt: RequestRuntime,
    prepared: Prepared,
    runner: SummaryRunner,
    cut: CutPlan,
    cache: Sequence[CachedContextSummary],
) -> ContextCompaction:
    snapshot = prepared.snapshot
    assert snapshot is not None
    before = runner.attempts_made
    try:
        result = await compact_snapshot(
            runner, prepared.claimed.snapshot_id, snapshot, cut, cache, prepared.context_time
        )
    except BaseException:
        if rt.info.context_summary is not None:  # a failed compaction's record counts its calls too
            rt.info.context_summary.calls += runner.attempts_made - before
        raise
    finally:
        rt.sync_calls()
    if result.new_entry is not None:
        async with rt.db.connection() as conn:
            if not await memory.save_memory(
                conn, rt.claimed.id, owner=rt.owner, context_summary=result.new_entry.to_json()
            ):
                raise RequestLost()
    return result


__all__ = ["ContextPlan", "FitCheck", "compact", "snapshot_job_key", "uncompacted"]
