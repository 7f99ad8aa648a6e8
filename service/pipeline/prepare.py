"""Stage ``preparing`` (SPEC §5, §11.2; docs/pipeline.md): the claim's request, memory and settings,
the snapshot as prepared when it was stored, and the window numbers and models they resolve to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from service.budget import WindowPlan, plan_window, positive_setting, resolve_output_cap, resolve_window
from service.budget.prepared import PreparedSnapshot
from service.config import Settings
from service.context_info import CalibrationInfo
from service.pipeline.failures import PipelineFailure
from service.pipeline.runtime import RequestRuntime
from service.store import queue
from service.summary.context import CachedContextSummary
from service.summary.rolling import StoredQASummary
from service.vocabulary import masks_tool_results


def text_setting(values: Mapping[str, Any], name: str) -> str | None:
    """``values[name]`` when it is a non-empty string (a model name, summary instructions), else None."""
    value = values.get(name)
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True)
class ModelChoice:
    """Which model answers and which one summarises (SPEC §11.2)."""

    answer: str
    summary: str


def choose_models(
    settings: Settings, session_settings: Mapping[str, Any], request_model: str | None, provider_default: str
) -> ModelChoice:
    """SPEC §11.2's model order for a request (``request_model`` None: a background job's)."""
    answer = (
        request_model or text_setting(session_settings, "answer_model") or settings.model or provider_default
    )
    summary = text_setting(session_settings, "summary_model") or settings.summary_model or answer
    return ModelChoice(answer=answer, summary=summary)


def plan_numbers(
    settings: Settings,
    session_settings: Mapping[str, Any],
    options: Mapping[str, Any],
    snapshot: PreparedSnapshot | None,
) -> WindowPlan:
    """SPEC §5's window and output cap, request → session settings → snapshot → service."""
    window = resolve_window(
        positive_setting(options.get("context_window")),
        snapshot.snapshot.context_window if snapshot else None,
        settings.context_window,
        session_window=positive_setting(session_settings.get("context_window")),
    )
    main_cap = positive_setting(options.get("main_max_output_tokens")) or (
        snapshot.snapshot.max_output_tokens if snapshot else None
    )
    output_cap = resolve_output_cap(
        positive_setting(options.get("max_output_tokens")),
        settings.max_output_tokens,
        main_cap,
        session_cap=positive_setting(session_settings.get("max_output_tokens")),
    )
    return plan_window(window, output_cap)


def parse_qa_summary(value: Any) -> StoredQASummary | None:
    """The session's rolling Q&A summary; an unreadable one is as good as none (rebuilt from history)."""
    if not value:
        return None
    try:
        return StoredQASummary.from_json(value)
    except Exception:
        return None


def parse_cache(values: Sequence[Any]) -> list[CachedContextSummary]:
    """The session's context-summary cache; an unreadable entry is a cache miss."""
    entries = []
    for value in values:
        with contextlib.suppress(Exception):
            entries.append(CachedContextSummary.from_json(value))
    return entries


@dataclass(frozen=True)
class Prepared:
    """The output of ``preparing``: the request's inputs, resolved, plus what the session remembers."""

    claimed: queue.Claimed
    snapshot: PreparedSnapshot | None
    plan: WindowPlan
    models: ModelChoice
    qa: StoredQASummary | None
    cache: tuple[CachedContextSummary, ...]
    summary_instructions: str | None
    # SPEC §11.2 ``mask_tool_results`` (unset: on): tier 1 of the ladder, and tier 2 on masked groups.
    mask_tool_results: bool = True

    @property
    def context_time(self) -> str | None:
        """When the main context was taken (the snapshot's ``taken_at``)."""
        return self.snapshot.taken_at if self.snapshot else None


async def prepare(rt: RequestRuntime) -> Prepared:
    """Stage ``preparing``; raises ``snapshot_missing`` when the named snapshot is not stored and
    ``context_overflow`` when the window cannot hold the output cap and the margin (budget ≤ 0)."""
    claimed = rt.claimed
    snapshot: PreparedSnapshot | None = None
    if claimed.snapshot_id is not None:
        snapshot = await rt.deps.snapshots.load(
            rt.db, claimed.session_id, claimed.snapshot_id, claimed.snapshot_hash
        )
        if snapshot is None:
            raise PipelineFailure(
                "snapshot_missing",
                f"snapshot {claimed.snapshot_id!r} is not stored for this session",
                {"snapshot_id": claimed.snapshot_id},
            )
    session_settings = claimed.session_settings
    models = choose_models(
        rt.deps.settings,
        session_settings,
        text_setting(claimed.options, "model") or claimed.model,
        rt.deps.provider.default_model,
    )
    rt.answer_model = models.answer
    if snapshot is not None and rt.info.context_summary is not None:
        # Until compaction says otherwise, every message of the snapshot goes verbatim.
        rt.info.context_summary.kept_messages = len(snapshot.messages)
    plan = plan_numbers(rt.deps.settings, session_settings, claimed.options, snapshot)
    for name, value in asdict(plan).items():
        setattr(rt.info, name, value)
    if plan.input_budget <= 0:
        # Nothing can fit (SPEC §5: input budget = window − output cap − margin): say so before any
        # call rather than send a prompt with a max_tokens the window cannot hold.
        raise PipelineFailure(
            "context_overflow",
            f"a {plan.window}-token window leaves no room for input once the {plan.max_output_tokens}"
            f"-token output cap and the {plan.safety_margin}-token safety margin are reserved; ask with a "
            "larger context_window or a smaller max_output_tokens",
            asdict(plan),
        )
    rt.calibration = await rt.book.snapshot(models.answer)
    rt.summary_calibration = (
        rt.calibration if models.summary == models.answer else await rt.book.snapshot(models.summary)
    )
    rt.info.calibration = CalibrationInfo(**rt.calibration.info())
    return Prepared(
        claimed=claimed,
        snapshot=snapshot,
        plan=plan,
        models=models,
        qa=parse_qa_summary(claimed.memory.get("qa_summary")),
        cache=tuple(parse_cache(claimed.memory.get("context_summaries") or [])),
        summary_instructions=text_setting(session_settings, "summary_instructions"),
        mask_tool_results=masks_tool_results(session_settings),
    )
