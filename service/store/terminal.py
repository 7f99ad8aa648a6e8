"""THE terminal transition of a side request (:func:`finish_request`) and the worker's ways to it; every way a
request ends but two, on purpose, goes through it (docs/architecture.md, "Data flow of one side question", 4).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from service.store import calibration, jobs, ledger, queries
from service.store.execute import Executor, execute, fetch_one, json_text
from service.store.lease import emit_if_held
from service.store.records import record_of_row
from service.vocabulary import QUEUE_CHANNEL, JobKind, Status, TerminalStatus, utc_iso


@dataclass(frozen=True)
class Ended:
    """A request :func:`finish_request` ended: its session and final record (a success's, for ``done``)."""

    session_id: uuid.UUID
    record: dict[str, Any] | None


async def finish_request(
    tx: Executor,
    request_id: uuid.UUID,
    *,
    status: TerminalStatus,
    owner: str | None,
    from_statuses: tuple[str, ...] = (Status.RUNNING,),
    answer: str | None = None,
    truncated: bool = False,
    stop_reason: str | None = None,
    model: str | None = None,
    qa_tokens: int | None = None,
    error: dict[str, Any] | None = None,
    context_info: dict[str, Any] | None = None,
) -> Ended | None:
    """sql/terminal.sql: the UPDATE guarded by the status it leaves and, given ``owner``, the worker's lease,
    so the first terminal write wins and every other is a no-op (None); then the ``status`` event, ``done``
    (with the record) or ``error``, and the NOTIFY of a free slot."""
    if status == Status.SUCCEEDED:
        error = None
    elif error is None:
        raise ValueError("a failed or cancelled request needs its error object")
    ended = await fetch_one(
        tx,
        queries.finish_request,
        {
            "status": str(status),
            "answer": answer,
            "truncated": truncated,
            "stop_reason": stop_reason,
            "model": model,
            "qa_tokens": qa_tokens,
            "error": None if error is None else json_text(error),
            "info": json_text(context_info or {}),
            "id": request_id,
            "from_statuses": [str(s) for s in from_statuses],
            "owner": owner,
        },
    )
    if ended is None:
        return None
    row = dict(ended)
    parent_id = str(row.pop("parent_of_row"))
    record = record_of_row(row, parent_id) if status == Status.SUCCEEDED else None
    session_id, stage = row["session_id"], row["stage"]
    last_type, last_fields = ("done", {"record": record}) if status == Status.SUCCEEDED else ("error", error)
    await execute(
        tx,
        queries.end_request,
        {
            "id": request_id,
            "sid": session_id,
            "status": str(status),
            "stage": stage,
            "type": last_type,
            "fields": json_text(last_fields),
            "at": utc_iso(),
            "channel": QUEUE_CHANNEL,
        },
    )
    return Ended(session_id=session_id, record=record)


@dataclass(frozen=True)
class FollowUp:
    """A background job to queue in the same transaction as a request's success (SPEC §6.6)."""

    kind: JobKind
    key: str
    params: dict[str, Any]


@dataclass(frozen=True)
class AnswerTail:
    """What a streamed answer leaves to write when it ends (see :func:`finish_succeeded`)."""

    delta: str | None = None
    call: ledger.CallEntry | None = None
    sample: calibration.Sample | None = None


async def finish_succeeded(
    tx: Executor,
    request_id: uuid.UUID,
    owner: str,
    *,
    answer: str,
    truncated: bool,
    stop_reason: str | None,
    model: str | None,
    context_info: dict[str, Any],
    qa_tokens: int | None = None,
    follow_ups: tuple[FollowUp, ...] = (),
    tail: AnswerTail | None = None,
) -> dict[str, Any] | None:
    """The worker's success and its follow-up background jobs; None if the request is no longer the worker's.
    ``tail`` (the answer's last text, call and calibration sample) is written first, so an answer ends in one
    commit, not four; its ledger entry and sample even for a lost request: the tokens were spent."""
    usage = None
    if tail is not None:
        added = True  # a retried end whose first COMMIT was applied finds its call recorded
        if tail.call is not None:
            appended = await ledger.append_calls(tx, request_id, [tail.call])
            usage, added = (appended.usage if appended.added else None), appended.added
        if tail.sample is not None and added:
            sample = tail.sample
            await calibration.add_sample(
                tx, sample.provider, sample.model, sample.estimate, sample.reported_prompt_tokens
            )
        events: list[tuple[str, dict[str, Any]]] = []
        if tail.delta:
            events.append(("delta", {"text": tail.delta}))
        if usage is not None:
            events.append(("usage", {"usage": usage}))
        if events and not await emit_if_held(tx, request_id, owner, events):
            return None
    ended = await finish_request(
        tx,
        request_id,
        status=Status.SUCCEEDED,
        owner=owner,
        answer=answer,
        truncated=truncated,
        stop_reason=stop_reason,
        model=model,
        qa_tokens=qa_tokens,
        context_info=context_info,
    )
    if ended is None:
        return None
    assert ended.record is not None
    for job in follow_ups:
        await jobs.enqueue_job(
            tx,
            ended.session_id,
            kind=job.kind,
            key=job.key,
            params=job.params,
            clear_version=int(ended.record["clear_version"]),
        )
    return ended.record
