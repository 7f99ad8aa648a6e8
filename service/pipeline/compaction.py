"""Stage ``compacting_context`` (SPEC §6.2, §6.6–§6.9; docs/pipeline.md, step 3): a compacted *copy* of the
main context, the cheapest way that fits — a cache hit, a grown snapshot's cached prefix, waiting for a
background job making the summary, else making it. The ladder's cut: :func:`service.budget.ladder.decide`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from service import vocabulary
from service.budget import RECENT_BUDGET_TOKENS, CutRefusal
from service.budget.estimate import estimate_text
from service.budget.fidelity import measure_fidelity
from service.budget.ladder import (
    MASKED,
    NONE,
    SUMMARY_TURN_TOKENS,
    decide,
    plan_after_summary,
    recent_budget_for,
)
from service.budget.masking import MaskedGroup
from service.budget.prepared import PreparedSnapshot
from service.context_info import FidelityInfo
from service.pipeline.prepare import Prepared, parse_cache
from service.pipeline.runtime import RequestRuntime
from service.pipeline.waiting import registered, wait_for_background_jobs
from service.summary.context import (
    CachedContextSummary,
    CacheHit,
    ContextCompaction,
    compact_snapshot,
    covering_summary,
    find_reusable,
    longest_cached_prefix,
)
from service.summary.runner import SummaryRunner
from service.vocabulary import JobKind

# Where masking must stop (a message index; 0: none) for a context made of this cached summary of the
# first ``covered`` messages and every later message; None: that does not fit (§6.7's grown snapshot).
PrefixFit = Callable[[CachedContextSummary, int], int | None]


def snapshot_job_key(snapshot_id: str) -> str:
    """The key a snapshot-stored job is queued under, before it knows its summary's cache key."""
    return f"snapshot:{snapshot_id}"


@dataclass
class ContextPlan:
    """The compacted copy: the summary in front (None: none) and the messages kept verbatim (default: all)."""

    summary: CachedContextSummary | None = None
    kept_from: int = 0
    cache: str = "none"
    calls: int = 0
    chunks: int = 0
    made_by: str | None = None
    waited_ms: int = 0
    # §6.7: answered with a cached prefix and a long verbatim tail; a job should extend the summary.
    extend_later: bool = False
    # §6.8: messages [kept_from, mask_until) go in their masked form (a group boundary; ≤ kept_from: none).
    mask_until: int = 0

    def _masked_forms(self, snapshot: PreparedSnapshot) -> Sequence[MaskedGroup]:
        # Only asked for when there are some: the masked forms are computed on first use.
        if self.mask_until <= self.kept_from:
            return ()
        return snapshot.masked()[snapshot.group_index(self.kept_from) : snapshot.group_index(self.mask_until)]

    def kept_messages(self, snapshot: PreparedSnapshot | None) -> list[dict[str, Any]]:
        if snapshot is None:
            return []
        masked = [message for form in self._masked_forms(snapshot) for message in form.messages]
        return masked + snapshot.messages[max(self.kept_from, self.mask_until) :]

    def kept_tokens(self, snapshot: PreparedSnapshot | None) -> int:
        if snapshot is None:
            return 0
        masked = sum(form.tokens for form in self._masked_forms(snapshot))
        return masked + snapshot.tokens_of(max(self.kept_from, self.mask_until))


async def compact_snapshot_copy(
    rt: RequestRuntime, prepared: Prepared, fits: Callable[[ContextPlan], bool], room: int
) -> ContextPlan | None:
    """The compaction ladder (SPEC §6.2) for a request whose transcript must fit ``room`` tokens
    (``fits``: whether the answer request fits with a context): masking alone (no call), or a summary
    of the oldest groups; None (with a progress event saying why) when nothing can help."""
    snapshot = prepared.snapshot
    if snapshot is None or not snapshot.messages:
        await rt.progress(vocabulary.compaction_skipped("no snapshot messages"), defer=True)
        return None
    mask = prepared.mask_tool_results
    decision = decide(snapshot, room, mask=mask)
    if isinstance(decision, CutRefusal):
        await rt.progress(vocabulary.compaction_refused(decision.reason, decision.explanation))
        return None
    if decision.tier == NONE:
        return None
    forms = snapshot.masked()[decision.summarize_until : decision.mask_until]
    if forms:
        await rt.progress(
            vocabulary.context_masked(
                tier=decision.tier,
                groups=len(forms),
                masked_messages=sum(form.masked_messages for form in forms),
                payload_bytes=sum(form.payload_bytes for form in forms),
            ),
            defer=True,
        )

    def prefix_fit(entry: CachedContextSummary, covered: int) -> int | None:
        if not mask:  # the rest verbatim, more than the recent budget of it (§6.7)
            tail = snapshot.tokens_of(covered)
            fit = tail > RECENT_BUDGET_TOKENS and fits(ContextPlan(summary=entry, kept_from=covered))
            return 0 if fit else None
        after = plan_after_summary(
            snapshot.groups,
            snapshot.masked_tokens(),
            room,
            covered=snapshot.group_index(covered),
            summary_tokens=estimate_text(entry.prompt_text()) + SUMMARY_TURN_TOKENS,
            recent_budget=recent_budget_for(room),
        )
        return None if after is None else snapshot.boundary(after.mask_until)

    if decision.tier == MASKED:
        # Tier 1 (SPEC §6.8): no summary, the oldest messages masked, the rest verbatim.
        plan = ContextPlan(mask_until=snapshot.boundary(decision.mask_until))
    else:
        plan = await compact(
            rt,
            prepared,
            snapshot.boundary(decision.summarize_until),
            masked=mask,
            mask_until=snapshot.boundary(decision.mask_until) if mask else 0,
            prefix_fit=prefix_fit,
        )
    record_compaction(rt, plan, snapshot)
    return plan


def record_fidelity(rt: RequestRuntime, snapshot: PreparedSnapshot | None, plan: ContextPlan) -> None:
    """``context_info.fidelity`` (SPEC §6.10) of the context the answer request is built from."""
    if snapshot is None:
        rt.info.fidelity = None
        return
    summarized = snapshot.group_index(plan.kept_from) if plan.summary is not None else 0
    mask_until = snapshot.group_index(plan.mask_until) if plan.mask_until > plan.kept_from else summarized
    trail = snapshot.trail(summarized) if plan.summary is not None and plan.summary.trail else []
    fidelity = measure_fidelity(
        snapshot.groups,
        snapshot.masked(),
        snapshot.artifacts(),
        summarize_until=summarized,
        mask_until=mask_until,
        trail=trail,
    )
    rt.info.fidelity = FidelityInfo.model_validate(fidelity.to_json())


def record_compaction(rt: RequestRuntime, plan: ContextPlan, snapshot: PreparedSnapshot) -> None:
    """Mirror a compaction into ``context_info.context_summary`` (SPEC §3)."""
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


def _reuse(
    entry: CachedContextSummary, until: int, mask_until: int, waited_ms: int = 0, cache: str = "hit"
) -> ContextPlan:
    """A context made with a cached summary (a ``prefix`` one is extended afterwards, §6.7)."""
    return ContextPlan(
        summary=entry,
        kept_from=until,
        cache=cache,
        made_by="background" if entry.made_by == "background" else "request",
        waited_ms=waited_ms,
        extend_later=cache == "prefix",
        mask_until=mask_until,
    )


async def compact(
    rt: RequestRuntime,
    prepared: Prepared,
    until: int,
    *,
    masked: bool,
    mask_until: int = 0,
    prefix_fit: PrefixFit | None = None,
) -> ContextPlan:
    """Summarise the messages before ``until`` (``masked``: in their masked form, with a trail, those up to
    ``mask_until`` after it masked), or reuse a summary that serves; ``prefix_fit`` None: overflow
    recovery, where no shorter prefix serves. The caller records the plan (:func:`record_compaction`)."""
    snapshot = prepared.snapshot
    assert snapshot is not None
    mask_until = max(until, mask_until)
    runner = rt.summary_runner(prepared)
    model = runner.model
    version = runner.prompt_version  # the session's summary instructions are part of the key
    cache = list(prepared.cache)
    key = snapshot.cache_key(until, model, version)

    def find_hit(entries: Sequence[CachedContextSummary]) -> tuple[CachedContextSummary, int] | None:
        reuse = find_reusable(snapshot, entries, until, model=model, prompt_version=version)
        if isinstance(reuse, CacheHit):
            return reuse.entry, until
        if masked:
            longer = covering_summary(snapshot, entries, until, model=model, prompt_version=version)
            if longer is not None:
                return longer.entry, longer.covered_messages
        return None

    found = find_hit(cache)
    if found is not None:
        entry, covered = found
        await rt.progress(
            vocabulary.context_summary_cache("hit", key=entry.key, covered_messages=covered), defer=True
        )
        return _reuse(entry, covered, max(covered, mask_until))

    if prefix_fit is not None:
        grown = longest_cached_prefix(snapshot, cache, model=model, prompt_version=version)
        if grown is not None and grown.covered_messages < until:
            grown_mask = prefix_fit(grown.entry, grown.covered_messages)
            if grown_mask is not None:
                # With masking, a summary made for this very snapshot (by a question whose cut was
                # deeper, or by its job) serves as it is: a hit, and nothing to extend. A summary of a
                # shorter snapshot is §6.7's grown-snapshot prefix, extended afterwards.
                same = masked and grown.entry.snapshot_id == prepared.claimed.snapshot_id
                outcome = "hit" if same and grown.entry.snapshot_id is not None else "prefix"
                await rt.progress(
                    vocabulary.context_summary_cache(
                        outcome,
                        key=grown.entry.key,
                        covered_messages=grown.covered_messages,
                        verbatim_tail_tokens=snapshot.tokens_of(grown.covered_messages),
                        answered_without_waiting=True,
                    ),
                    defer=True,
                )
                return _reuse(grown.entry, grown.covered_messages, grown_mask, cache=outcome)

    waited_ms = 0
    keys = {key}
    if prepared.claimed.snapshot_id is not None:
        keys.add(snapshot_job_key(prepared.claimed.snapshot_id))
    for attempt in range(2):
        if rt.deps.settings.background_on and (attempt > 0 or rt.claimed.jobs_active):
            waited = await wait_for_background_jobs(rt, JobKind.CONTEXT_SUMMARY, keys)
            if waited is not None:
                waited_ms += waited
                cache = parse_cache((await rt.load_memory()).get("context_summaries") or [])
                found = find_hit(cache)
                if found is not None:
                    entry, covered = found
                    await rt.progress(
                        vocabulary.context_summary_cache("hit", key=entry.key, waited_ms=waited_ms),
                        defer=True,
                    )
                    return _reuse(entry, covered, max(covered, mask_until), waited_ms)
        async with registered(rt, JobKind.CONTEXT_SUMMARY, key) as mine:
            if mine or attempt == 1 or not rt.deps.settings.background_on:
                result = await _make(rt, prepared, runner, until, cache, masked=masked)
                return ContextPlan(
                    summary=result.new_entry,
                    kept_from=until,
                    cache=result.cache,
                    calls=result.calls,
                    chunks=result.chunks,
                    made_by="request",
                    waited_ms=waited_ms,
                    mask_until=mask_until,
                )
    raise AssertionError("unreachable: the second attempt always makes the summary")


async def _make(
    rt: RequestRuntime,
    prepared: Prepared,
    runner: SummaryRunner,
    until: int,
    cache: Sequence[CachedContextSummary],
    *,
    masked: bool,
) -> ContextCompaction:
    snapshot = prepared.snapshot
    assert snapshot is not None
    before = runner.attempts_made
    try:
        result = await compact_snapshot(
            runner, prepared.claimed.snapshot_id, snapshot, until, cache, prepared.context_time, masked=masked
        )
    except BaseException:
        if rt.info.context_summary is not None:  # a failed compaction's record counts its calls too
            rt.info.context_summary.calls += runner.attempts_made - before
        raise
    finally:
        rt.sync_calls()
    # A new summary, never a cache hit: the caller found no hit in this very cache (the same lookup).
    assert result.new_entry is not None
    await rt.save_memory(context_summary=result.new_entry.to_json())
    return result
