"""How ``sidequest ask`` shows a request's events: the status line, progress words, the answer text."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from service.vocabulary import ACTIVE, TERMINAL, Status


def plural(n: object, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _tokens(usage: dict[str, Any], *, last_call: bool = True) -> str:
    calls = usage.get("calls") or []
    cached = f" (cached {usage['cached_tokens']})" if usage.get("cached_tokens") else ""
    parts = [f"in {usage.get('input_tokens', 0)}{cached}", f"out {usage.get('output_tokens', 0)}"]
    if usage.get("reasoning_tokens"):
        parts.append(f"reasoning {usage['reasoning_tokens']}")
    parts.append(plural(len(calls), "call"))
    if last_call and calls and isinstance(last := calls[-1], dict):
        parts.append(f"last: {last.get('purpose', '?')} {last.get('status', '?')}")
    return " · ".join(parts)


_ENVELOPE = frozenset({"request_id", "ordinal", "seq", "at", "stage", "what", "kind"})


def describe_progress(data: dict[str, Any]) -> str:
    """One human line for a ``progress`` event: the pipeline's known steps in words, others as k=v."""
    what = data.get("what") or data.get("kind")
    if what == "replay":
        replayed, folded = data.get("replayed_groups") or 0, data.get("folded_groups") or 0
        if not replayed and not folded:
            return "no earlier Q&A in this session"
        text = f"replaying {plural(replayed, 'Q&A group')}"
        match data.get("replayed_ordinals"):
            case [first, last]:
                text += f" (#{first}–#{last})" if first != last else f" (#{first})"
        if folded:
            text += f", folding {folded} into the rolling summary"
        return text
    if what == "summary_chunk":
        purpose = str(data.get("purpose") or "summary").replace("_", " ")
        return f"{purpose} chunk {data.get('chunk')}/{data.get('chunks')}"
    if what == "context_summary_cache":
        text = f"context summary cache {data.get('cache')}"
        if data.get("covered_messages") is not None:
            text += f" ({data['covered_messages']} messages)"
        return text
    if what == "context_masked":
        return (
            f"masked the tool output of {plural(data.get('masked_messages'), 'older message')}"
            f" ({_size(_count(data.get('payload_bytes')))} elided) for tier {data.get('tier')}"
        )
    if what in ("compaction_skipped", "compaction_refused"):
        reason = data.get("explanation") or data.get("reason") or ""
        return f"{str(what).replace('_', ' ')}: {reason}".rstrip(": ")
    if what == "overflow_retry":
        if "estimate_after" in data:
            return f"context overflow: retrying once with a smaller prompt (~{data['estimate_after']} tokens)"
        return f"context overflow reported by the provider (prompt ~{data.get('estimate_before')} tokens)"
    if what == "worker_lost_rerun":
        return f"the worker was lost; running again (attempt {data.get('attempt', '?')})"
    words = [str(what).replace("_", " ")] if isinstance(what, str) else []
    words.extend(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in data.items() if k not in _ENVELOPE)
    return " ".join(words) or "working"


def _size(n_bytes: int) -> str:
    """Bytes as a person reads them: 950 bytes, 1.5 KB, 310 KB, 1.2 MB (decimal, as the inspector has it)."""
    if n_bytes < 1000:
        return plural(n_bytes, "byte")
    value, unit = n_bytes / 1000, "KB"
    for larger in ("MB", "GB"):
        if round(value) < 1000:
            break
        value, unit = value / 1000, larger
    return f"{value:.1f} {unit}" if value < 9.95 else f"{value:.0f} {unit}"


def _count(value: object) -> int:
    # A field another server version leaves out (or sends oddly) counts as 0, never a crash at the end.
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def describe_fidelity(fidelity: object) -> str | None:
    """One line saying what of the snapshot reached the model (SPEC §6.10 ``context_info.fidelity``),
    or None when the request had no snapshot or never built its answer request (``fidelity`` null)."""
    if not isinstance(fidelity, dict):
        return None
    verbatim = _count(fidelity.get("verbatim_messages"))
    masked = _count(fidelity.get("masked_messages"))
    summarized = _count(fidelity.get("summarized_messages"))
    artifacts = found if isinstance(found := fidelity.get("artifacts"), dict) else {}
    total, in_prompt = _count(artifacts.get("total")), _count(artifacts.get("in_prompt"))
    tier = fidelity.get("tier")
    if tier == "none":
        # Nothing compacted: the counts would only repeat "all of it"; say so in words.
        text = f"context: not compacted — the whole snapshot went verbatim ({plural(verbatim, 'message')})"
    else:
        elided = f" ({_size(_count(fidelity.get('masked_payload_bytes')))} elided)" if masked else ""
        text = (
            f"context: {tier} — {verbatim} verbatim, {masked} masked{elided},"
            f" {summarized} summarised {'message' if summarized == 1 else 'messages'}"
        )
    if total:
        return f"{text}; artifacts {in_prompt} of {total} in the prompt"
    return f"{text}; no tool-call artifacts in the snapshot"


@dataclass
class Outcome:
    """How the stream ended."""

    status: str
    error: dict[str, Any] | None = None


# Error codes of a cancelled request (SPEC §8): cancelled, and superseded by a newer question (§11.2).
_CANCELLED_CODES = frozenset({"cancelled", "superseded"})

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


@dataclass
class Renderer:
    """Turns events into output: status on ``err`` (live line on a TTY), answer text on ``out``."""

    out: TextIO
    err: TextIO
    live: bool
    started: float = field(default_factory=time.monotonic)
    stage: str = Status.QUEUED
    answer: str = ""
    answering: bool = False
    # The terminal status the stream announced (SPEC §4: right before done / error).
    terminal: str | None = None
    _live_line: bool = False
    _frame: int = 0

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.started:6.1f}s"

    def _clear_live(self) -> None:
        if self._live_line:
            self.err.write("\r\x1b[2K")
            self._live_line = False

    def note(self, text: str) -> None:
        """A status line: rewritten in place on a TTY (until the answer streams), appended otherwise."""
        if self.live and not self.answering:
            self._frame = (self._frame + 1) % len(SPINNER)
            self.err.write(f"\r\x1b[2K{SPINNER[self._frame]} {self._elapsed()} {text}")
            self._live_line = True
        elif self.live:
            return  # the answer owns the terminal now; the summary line comes at the end
        else:
            self.err.write(f"[{self._elapsed()}] {text}\n")
        self.err.flush()

    def lasting(self, text: str) -> None:
        """A line that stays, also on a TTY (stage changes, restarts, the final summary)."""
        self._clear_live()
        if self.answering and self.answer and not self.answer.endswith("\n"):
            self.out.write("\n")
            self.out.flush()
        self.err.write(f"[{self._elapsed()}] {text}\n")
        self.err.flush()

    def handle(self, event: str, data: dict[str, Any]) -> Outcome | None:
        """Render one event; returns the outcome on the terminal event."""
        if event == "status":
            status = data.get("status")
            stage = data.get("stage")
            self.stage = str(stage or status)
            if isinstance(status, str) and status in TERMINAL:
                self.terminal = status
                return None  # the done / error event right after it carries the result
            active = isinstance(status, str) and status in ACTIVE
            label = f"{status}" if active and not stage else f"stage {self.stage}"
            if data.get("reason"):
                label += f" ({data['reason']})"
            (self.note if self.live else self.lasting)(label)
        elif event == "progress":
            if data.get("discard_streamed_text"):
                # The request runs again from the start (worker lost): what streamed is void.
                self.lasting("the worker was lost; the request runs again and the answer restarts")
                self.answer, self.answering = "", False
            self.note(f"{data.get('stage') or self.stage}: {describe_progress(data)}")
        elif event == "usage" and isinstance(data.get("usage"), dict):
            self.note(f"usage: {_tokens(data['usage'])}")
        elif event == "delta":
            text = str(data.get("text", ""))
            if not self.answering:
                self._clear_live()
                self.answering = True
            self.answer += text
            self.out.write(text)
            self.out.flush()
        elif event == "done":
            record = found if isinstance(found := data.get("record"), dict) else {}
            self._finish_answer(record.get("answer"))
            # What of the snapshot the model saw, before the final line (the outcome and usage).
            info = record.get("context_info")
            fidelity = describe_fidelity(info.get("fidelity")) if isinstance(info, dict) else None
            if fidelity is not None:
                self.lasting(fidelity)
            summary = str(Status.SUCCEEDED)
            if record.get("truncated"):
                summary += f" (answer truncated: stop reason {record.get('stop_reason')})"
            if isinstance(record.get("usage"), dict):
                summary += f" · {_tokens(record['usage'], last_call=False)}"
            self.lasting(summary)
            return Outcome(Status.SUCCEEDED)
        elif event == "error":
            # The status event right before says which (a superseded request is cancelled), else the code.
            if self.terminal in (Status.CANCELLED, Status.FAILED):
                status = Status(self.terminal)
            else:
                status = Status.CANCELLED if data.get("code") in _CANCELLED_CODES else Status.FAILED
            self.lasting(f"{status}: {format_error(data)}")
            return Outcome(status, error=data)
        return None

    def _finish_answer(self, final: object) -> None:
        """Print whatever part of the final answer did not stream (or all of it), then a newline."""
        if isinstance(final, str):
            if final.startswith(self.answer):
                rest = final[len(self.answer) :]
            else:  # streamed text diverged (should not happen): show the authoritative answer
                rest = ("\n" if self.answer else "") + final
            if rest:
                self._clear_live()
                self.out.write(rest)
                self.answer += rest
        if self.answer and not self.answer.endswith("\n"):
            self.out.write("\n")
        self.out.flush()
        self.answering = False


def format_error(error: dict[str, Any]) -> str:
    """``code: message`` plus the detail fields, e.g. ``provider_error: … (status=500)``."""
    text = f"{error.get('code', 'error')}: {error.get('message', '')}".rstrip(": ")
    detail = error.get("detail")
    if isinstance(detail, dict) and detail:
        text += " (" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in detail.items()) + ")"
    return text
