"""What of a real agent session reaches the model, masking on and off (SPEC 6.2, 6.8–6.10, 11.2).

Run: ``.venv/bin/python benchmarks/bench_fidelity.py [--runs 3] [--corpus DIR]`` (a PostgreSQL is found
the same way as the tests'; the script creates and drops its own database). The corpus is read from
``../shared/corpus`` beside the repository (``--corpus`` or ``SIDEQUEST_BENCH_CORPUS`` override it);
it is never copied into the repository.

Every transcript of the corpus is asked one question at windows 64000 and 32000, with masking on (the
default) and off (``PUT …/settings {"mask_tool_results": false}``: summaries only, the
baseline), in the same run, through ``sidequest serve`` in its own process whose model is the scripted
OpenAI-compatible server of ``tests/`` (every call 0.05 s). Each case is a fresh session with the
snapshot inline. Per case, from what the *model received* (the scripted server's record of every
request, by ``X-Sidequest-Purpose`` and ``X-Sidequest-Request-Id``):

- the tier (``context_info.fidelity.tier``);
- artifacts in the answer prompt / all: "all" are the transcript's distinct (tool, artifact) pairs,
  computed here from the corpus's ``tool_use`` blocks with ``service.budget.masking.artifact_of``; one
  is in the prompt when its text occurs in a decoded string of the answer request (message contents,
  text parts, tool-call arguments decoded from their JSON) — never the raw escaped body;
- summary calls and the characters of the messages sent to them;
- the answer prompt's estimate against the input budget (``context_info``);
- whether ``context_info.fidelity.artifacts`` agrees with the benchmark's own count.

Targets (masking on, every case): artifacts in the prompt ≥ 95 %; summary calls ≤ ⅓ of the baseline's
in total and 0 on at least two thirds of the cases at 64000; characters sent to summary calls ≤ 25 %
of the baseline's. Where a case misses the artifact target, the script computes the *ceiling* under
SPEC's own rules — the best artifacts-in-prompt any plan could reach: over every feasible summarise
point ``s`` (the summary at its reserved size, its bounded trail, every later group masked except the
recent part, within the same room), the artifacts of ``groups[s:]`` plus those of the bounded trail of
``groups[:s]`` — and says whether the case reached it.

Calibration (SPEC 5.1) is off in the deployed service: the scripted model's "tokenizer" counts only
message text (not tool-call arguments), so a learned ratio would drift with the order of the cases and
make the fits of one case depend on the cases before it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deployed import ROOT, deployed

from service.budget.cut import MIN_SUMMARIZED_TOKENS, CutRefusal, recent_start
from service.budget.ladder import SUMMARY_RESERVE_TOKENS, Compaction, decide, recent_budget_for
from service.budget.masking import Artifact, artifact_of, artifact_text, key_argument
from service.budget.prepared import PreparedSnapshot, prepare_snapshot
from service.budget.trail import TRAIL_HEADING, TrailSizes
from service.summary.prompts import build_answer_request
from tests.scripted_provider import RecordedRequest, ScriptedServer, Step

WINDOWS: Final = (64000, 32000)
CALL_DELAY_S: Final = 0.05
SUMMARY_PURPOSES: Final = ("context_summary", "qa_summary")
TERMINAL: Final = ("succeeded", "failed", "cancelled")
QUESTION: Final = "By the way: which files has the agent touched so far, and what is it doing now?"
CORPUS_ENV: Final = "SIDEQUEST_BENCH_CORPUS"
ARTIFACT_TARGET: Final = 0.95
CALLS_TARGET: Final = 1 / 3
ZERO_CALL_SHARE_TARGET: Final = 2 / 3
CHARS_TARGET: Final = 0.25


def default_corpus() -> Path:
    """``../shared/corpus`` relative to the repository root (this file's parent's parent)."""
    return (ROOT.parent / "shared" / "corpus").resolve()


def load_corpus(directory: Path) -> dict[str, dict[str, Any]]:
    """Every ``*.json`` snapshot of ``directory`` by name; exits with a clear message when absent."""
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    if not files:
        raise SystemExit(
            f"bench_fidelity: no corpus at {directory} (expected the shared corpus's *.json snapshots;"
            f" give another directory with --corpus or {CORPUS_ENV})"
        )
    return {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in files}


def corpus_artifacts(snapshot: Mapping[str, Any]) -> set[Artifact]:
    """What "all" means: the distinct artifacts of the transcript's ``tool_use`` blocks (the corpus
    is canonical, Anthropic-style), counted here rather than taken from the service."""
    found: set[Artifact] = set()
    for message in snapshot["messages"]:
        content = message.get("content")
        if message.get("role") == "assistant" and isinstance(content, list):
            for block in content:
                artifact = artifact_of(block) if isinstance(block, Mapping) else None
                if artifact is not None:
                    found.add(artifact)
    return found


# ---- what the model received --------------------------------------------------------------------


def decoded_strings(value: Any) -> Iterator[str]:
    """Every string of a received JSON value, with tool-call ``arguments`` decoded from their JSON
    (what the model reads, not the escaped wire form)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from decoded_strings(item)
    elif isinstance(value, dict):
        for name, item in value.items():
            if name == "arguments" and isinstance(item, str):
                try:
                    yield from decoded_strings(json.loads(item))
                    continue
                except ValueError:
                    pass
            yield from decoded_strings(item)


def tool_call_artifacts(body: Mapping[str, Any]) -> set[Artifact]:
    """The artifacts of the tool calls an OpenAI-form request carries (masked or not)."""
    found: set[Artifact] = set()
    for message in body.get("messages") or []:
        for call in message.get("tool_calls") or [] if isinstance(message, dict) else []:
            function = call.get("function") or {}
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except ValueError:
                continue
            key = key_argument(arguments) if isinstance(arguments, dict) else None
            text = artifact_text(str(arguments[key])) if key is not None else ""
            if text:
                found.add(Artifact(str(function.get("name") or ""), text))
    return found


# One line of the trail (service/budget/trail.py renders "- tool: text", then " (xN)" when used more
# than once and " [last result an error]"): the part before the suffixes is "tool: text".
TRAIL_LINE: Final = re.compile(r"- (?P<entry>.*?)(?: \(x\d+\))?(?: \[last result an error\])?")


def trail_entries(strings: Sequence[str]) -> set[str]:
    """The "tool: text" of every line after the trail's heading in any of ``strings``."""
    entries: set[str] = set()
    for text in strings:
        at = text.find(TRAIL_HEADING)
        if at < 0:
            continue
        for line in text[at + len(TRAIL_HEADING) :].splitlines():
            match = TRAIL_LINE.fullmatch(line)
            if match is not None:
                entries.add(match["entry"])
    return entries


def artifacts_in_prompt(
    body: Mapping[str, Any], everything: set[Artifact]
) -> tuple[set[Artifact], set[Artifact]]:
    """The artifacts of ``everything`` the answer request carries, counted two ways from its decoded
    strings: (anywhere — the text occurs in any message content, text part or decoded tool-call
    argument; where SPEC 6.10 counts them — as a kept tool call of the same tool, masked or not, or
    as a line of the artifact trail)."""
    strings = list(decoded_strings(body.get("messages") or []))
    # An artifact is one line, so joining the strings with newlines creates no false match across two.
    haystack = "\n".join(strings)
    anywhere = {a for a in everything if a.text in haystack}
    calls = tool_call_artifacts(body)
    trail = trail_entries(strings)
    placed = {a for a in everything if a in calls or f"{a.tool}: {a.text}" in trail}
    return anywhere, placed


def message_chars(body: Any) -> int:
    """Characters of the message contents of a received chat request (text parts and strings)."""
    total = 0
    for message in (body or {}).get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return total


# ---- the ceiling under SPEC's rules ---------------------------------------------------------------


def artifact_ceiling(prepared: PreparedSnapshot, room: int) -> tuple[int, int | None]:
    """(the most distinct artifacts any plan within SPEC's rules could carry in ``room`` tokens, the
    summarise point that reaches it; None when no summary is needed): over every summarise point ``s``
    with at least the minimum material, the summary at its reserved size plus the bounded trail of
    ``groups[:s]`` plus every later group masked up to the recent part, which stays verbatim."""
    groups = prepared.groups
    verbatim = [g.tokens for g in groups]
    masked = list(prepared.masked_tokens())
    per_group = prepared.artifacts()
    everything = {a for found in per_group for a, _ in found}
    recent = recent_start(verbatim, recent_budget_for(room))
    tail = sum(verbatim[recent:])
    if sum(masked[:recent]) + tail <= room:
        return len(everything), None
    trail_tokens = TrailSizes(per_group)
    best, best_at = 0, 0
    for s in range(1, recent + 1):
        if sum(masked[:s]) < MIN_SUMMARIZED_TOKENS:
            continue
        if SUMMARY_RESERVE_TOKENS + trail_tokens(s) + sum(masked[s:recent]) + tail > room:
            continue
        carried = {a for found in per_group[s:] for a, _ in found}
        carried.update(entry.artifact for entry in prepared.trail(s))
        if len(carried & everything) > best:
            best, best_at = len(carried & everything), s
    return best, best_at


# ---- one case --------------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    window: int
    mask: bool
    status: str = ""
    error: str = ""
    tier: str = ""
    artifacts_all: int = 0
    in_prompt: int = 0
    in_prompt_placed: int = 0
    info_total: int | None = None
    info_in_prompt: int | None = None
    summary_calls: int = 0
    summary_chars: int = 0
    job_calls: int = 0
    stray_calls: int = 0
    estimate: int = 0
    budget: int = 0
    room: int = 0
    planned: tuple[str, int, int] = ("", 0, 0)
    fidelity_plan: tuple[str, int, int] = ("", 0, 0)
    ceiling: int | None = None
    seconds: float = 0.0
    missing: list[str] = field(default_factory=list)

    @property
    def share(self) -> float:
        return self.in_prompt / self.artifacts_all if self.artifacts_all else 1.0

    @property
    def agrees(self) -> bool:
        """context_info says what the benchmark counted where SPEC 6.10 counts (a kept tool call or
        the trail), out of the same total."""
        return (self.info_total, self.info_in_prompt) == (self.artifacts_all, self.in_prompt_placed)

    @property
    def agrees_anywhere(self) -> bool:
        return (self.info_total, self.info_in_prompt) == (self.artifacts_all, self.in_prompt)


async def wait_terminal(client: httpx.AsyncClient, rid: str, within: float = 180.0) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        record: dict[str, Any] = (await client.get(f"/v1/questions/{rid}")).json()
        if record["status"] in TERMINAL:
            return record
        await asyncio.sleep(0.05)
    raise SystemExit(f"request {rid} did not end within {within:.0f} s")


async def settle(client: httpx.AsyncClient, parent: str, within: float = 60.0) -> None:
    """Wait until the session has no queued or running background job (their calls belong to it)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        jobs = (await client.get(f"/v1/sessions/{parent}")).json()["background"]["jobs"]
        if jobs["queued"] + jobs["running"] == 0:
            return
        await asyncio.sleep(0.1)


def script(server: ScriptedServer) -> None:
    """Forget what was received (a case reads only its own) and give every purpose a short delay."""
    server.reset()
    for purpose in SUMMARY_PURPOSES:
        server.set_default(purpose, Step.valid_summary().with_delay(before_s=CALL_DELAY_S))
    server.set_default(
        "answer", Step.text("Scripted side answer.", chunks=2).with_delay(before_s=CALL_DELAY_S)
    )


async def one_case(
    client: httpx.AsyncClient,
    server: ScriptedServer,
    name: str,
    snapshot: dict[str, Any],
    prepared: PreparedSnapshot,
    everything: set[Artifact],
    window: int,
    mask: bool,
) -> Result:
    result = Result(name, window, mask, artifacts_all=len(everything))
    parent = f"fidelity-{name}-{window}-{'on' if mask else 'off'}-{uuid.uuid4().hex[:8]}"
    script(server)
    if not mask:
        r = await client.put(f"/v1/sessions/{parent}/settings", json={"mask_tool_results": False})
        assert r.status_code == 200, r.text
    started = time.perf_counter()
    r = await client.post(
        f"/v1/sessions/{parent}/questions",
        json={"question": QUESTION, "snapshot": snapshot, "context_window": window},
    )
    if r.status_code != 202:
        result.status, result.error = f"HTTP {r.status_code}", r.text[:300]
        return result
    rid = r.json()["id"]
    record = await wait_terminal(client, rid)
    result.seconds = time.perf_counter() - started
    await settle(client, parent)
    result.status = record["status"]
    if record.get("error"):
        result.error = json.dumps(record["error"])[:300]
    info = record.get("context_info") or {}
    fidelity = info.get("fidelity") or {}
    result.tier = str(fidelity.get("tier") or "")
    artifacts = fidelity.get("artifacts") or {}
    result.info_total, result.info_in_prompt = artifacts.get("total"), artifacts.get("in_prompt")
    estimate = info.get("estimate") or {}
    result.estimate, result.budget = int(estimate.get("total") or 0), int(info.get("input_budget") or 0)
    result.room = transcript_room(prepared, result.budget)
    result.planned = plan_of(prepared, decide(prepared, result.room, mask=mask))
    result.fidelity_plan = (
        str(fidelity.get("tier") or ""),
        int(fidelity.get("summarized_messages") or 0),
        int(fidelity.get("masked_messages") or 0),
    )

    received = server.requests()
    answers = [q for q in received if q.purpose == "answer" and _of(q, rid)]
    summaries = [q for q in received if q.purpose in SUMMARY_PURPOSES]
    result.summary_calls = sum(1 for q in summaries if _of(q, rid))
    result.job_calls = sum(1 for q in summaries if "x-sidequest-job-id" in q.headers)
    # Neither this request's nor a job's: a call the headers do not account for (SPEC 6.6 says every
    # call carries one of them).
    result.stray_calls = len(summaries) - result.summary_calls - result.job_calls
    result.summary_chars = sum(message_chars(q.body) for q in summaries)
    if answers:
        # The last answer call is the one the model answered (an overflow retry would come after).
        anywhere, placed = artifacts_in_prompt(answers[-1].body, everything)
        result.in_prompt, result.in_prompt_placed = len(anywhere), len(placed)
        result.missing = sorted(f"{a.tool}: {a.text}" for a in everything - anywhere)[:5]
    if mask and result.in_prompt_placed < result.artifacts_all:
        # Not every artifact is where SPEC 6.10 counts: how many could any plan within SPEC's rules carry?
        result.ceiling = artifact_ceiling(prepared, result.room)[0]
    return result


def transcript_room(prepared: PreparedSnapshot, budget: int) -> int:
    """The tokens the transcript may take, as the service computes them before compacting
    (service/pipeline/run.py): the budget less the whole snapshot's answer request, its messages
    excepted — the system prompt, tools, Sidequest's instructions, the question and the envelopes
    around them. Calibration is off, so the budget is in raw estimate tokens."""
    provisional = build_answer_request(
        question=QUESTION,
        system=prepared.snapshot.system,
        system_blocks=prepared.snapshot.system_blocks,
        tools=prepared.snapshot.tools,
        messages=prepared.messages,
        messages_tokens=prepared.tokens_of(0),
        context_time=prepared.taken_at,
    )
    return budget - (provisional.estimate.total - prepared.tokens_of(0))


def plan_of(prepared: PreparedSnapshot, decision: Compaction | CutRefusal) -> tuple[str, int, int]:
    """(tier, summarised messages, masked messages) of a ladder decision, in fidelity's terms: what
    the service's own fidelity must say if the benchmark's room is the service's."""
    if isinstance(decision, CutRefusal):
        return ("refused", 0, 0)
    masked = prepared.masked()[decision.summarize_until : decision.mask_until]
    return (
        decision.tier,
        prepared.boundary(decision.summarize_until) if decision.summarize_until else 0,
        sum(group.masked_messages for group in masked),
    )


def _of(request: RecordedRequest, rid: str) -> bool:
    return request.headers.get("x-sidequest-request-id") == rid


# ---- report ------------------------------------------------------------------------------------


def spread(values: Sequence[float], fmt: str = "{:g}") -> str:
    """One value when every run gave it, else ``min–max``."""
    low, high = min(values), max(values)
    return fmt.format(low) if low == high else f"{fmt.format(low)}–{fmt.format(high)}"


def print_table(runs: list[list[Result]]) -> None:
    keys = [(r.name, r.window) for r in runs[0] if r.mask]
    by = {(r.name, r.window, r.mask): [run[i] for run in runs] for i, r in enumerate(runs[0])}
    head = (
        f"{'case':22} {'window':>6} {'mask':4} {'tier':8} {'in prompt: anywhere':>20} {'call/trail':>10}"
        f" {'ctx_info':>9} {'agree':5} {'summ calls':>10} {'summ chars':>10} {'estimate/budget':>19}"
        f" {'ceiling':>7} {'s':>9}"
    )
    print(head)
    print("-" * len(head))
    for name, window in keys:
        for mask in (True, False):
            rs = by[(name, window, mask)]
            r = rs[0]
            share = spread([x.share * 100 for x in rs], "{:.1f}")
            anywhere = f"{spread([x.in_prompt for x in rs])}/{r.artifacts_all} {share}%"
            info = f"{spread([x.info_in_prompt or 0 for x in rs])}/{r.info_total}"
            agree = "yes" if all(x.agrees for x in rs) else "NO"
            ratio = spread([x.estimate / x.budget * 100 if x.budget else 0 for x in rs], "{:.1f}")
            est = f"{spread([x.estimate for x in rs])}/{r.budget} {ratio}%"
            ceiling = "" if r.ceiling is None else f"{r.ceiling}/{r.artifacts_all}"
            tier = r.tier if r.status == "succeeded" else r.status
            print(
                f"{name:22} {window:>6} {'on' if mask else 'off':4} {tier:8} {anywhere:>20}"
                f" {spread([x.in_prompt_placed for x in rs]):>10} {info:>9} {agree:5}"
                f" {spread([x.summary_calls for x in rs]):>10} {spread([x.summary_chars for x in rs]):>10}"
                f" {est:>19} {ceiling:>7} {spread([x.seconds for x in rs], '{:.2f}'):>9}"
            )
            for x in rs:
                if x.error:
                    print(f"    {x.status}: {x.error}")
                if x.planned != x.fidelity_plan and x.status == "succeeded":
                    print(
                        f"    the ladder replayed here plans (tier, summarised, masked) {x.planned},"
                        f" the service's fidelity says {x.fidelity_plan}: the ceiling's room may be off"
                    )
                if x.job_calls:
                    print(f"    {x.job_calls} background summary call(s) during this case")
                if x.stray_calls:
                    print(f"    {x.stray_calls} summary call(s) with neither this request's id nor a job id")
            if mask and r.missing:
                print("    not in the prompt, e.g.: " + "; ".join(m[:60] for m in r.missing[:3]))


def verdicts(runs: list[list[Result]]) -> bool:
    """Print each target's verdict, per run; True when every target is met (or at its ceiling)."""
    ok_all = True
    for number, run in enumerate(runs, 1):
        on = [r for r in run if r.mask]
        off = [r for r in run if not r.mask]
        failed = [r for r in run if r.status != "succeeded"]
        # A transcript that fits as it is keeps every artifact either way: it says nothing of the baseline.
        compacted = [r for r in off if r.tier != "none"] or off
        artifact_misses = [r for r in on if r.share < ARTIFACT_TARGET]
        below_ceiling = [r for r in artifact_misses if r.ceiling is None or r.in_prompt_placed < r.ceiling]
        calls_on, calls_off = sum(r.summary_calls for r in on), sum(r.summary_calls for r in off)
        chars_on, chars_off = sum(r.summary_chars for r in on), sum(r.summary_chars for r in off)
        at64 = [r for r in on if r.window == 64000]
        zero64 = sum(1 for r in at64 if r.summary_calls == 0)
        agree = sum(1 for r in on if r.agrees)
        agree_off = sum(1 for r in off if r.agrees)
        anywhere = sum(1 for r in run if r.agrees_anywhere)
        calls_ratio = calls_on / calls_off if calls_off else 0.0
        chars_ratio = chars_on / chars_off if chars_off else 0.0
        checks = [
            (
                f"artifacts in prompt ≥ 95 % on every case: {len(on) - len(artifact_misses)}/{len(on)}"
                f" (min {min(r.share for r in on) * 100:.1f} %; baseline where it compacted"
                f" {min(r.share for r in compacted) * 100:.1f}–{max(r.share for r in compacted) * 100:.1f} %)"
                + (
                    f"; {len(artifact_misses) - len(below_ceiling)} below 95 % at their SPEC ceiling"
                    if artifact_misses
                    else ""
                ),
                not below_ceiling,
                not artifact_misses,
            ),
            (
                f"summary calls ≤ 1/3 of baseline: {calls_on} vs {calls_off} ({calls_ratio:.3f})",
                calls_ratio <= CALLS_TARGET,
                True,
            ),
            (
                f"0 summary calls on ≥ 2/3 of the 64000 cases: {zero64}/{len(at64)}",
                zero64 >= ZERO_CALL_SHARE_TARGET * len(at64),
                True,
            ),
            (
                f"summary characters ≤ 25 % of baseline: {chars_on} vs {chars_off}"
                f" ({chars_ratio * 100:.1f} %)",
                chars_ratio <= CHARS_TARGET,
                True,
            ),
            (
                f"context_info.fidelity.artifacts = the benchmark's count as a kept tool call or trail"
                f" line: {agree}/{len(on)} masking on, {agree_off}/{len(off)} off (= the count of the text"
                f" anywhere in the request: {anywhere}/{len(run)})",
                agree == len(on) and agree_off == len(off),
                True,
            ),
            (f"every request succeeded: {len(run) - len(failed)}/{len(run)}", not failed, True),
        ]
        print(f"\nrun {number}:")
        for text, ok, clean in checks:
            verdict = "met" if ok and clean else ("at SPEC ceiling" if ok else "MISSED")
            print(f"  {verdict:15} {text}")
            ok_all = ok_all and ok
    return ok_all


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--corpus",
        type=Path,
        default=Path(os.environ[CORPUS_ENV]) if os.environ.get(CORPUS_ENV) else default_corpus(),
        help=f"the corpus directory (default ../shared/corpus beside the repository, or ${CORPUS_ENV})",
    )
    parser.add_argument("--only", action="append", help="only this transcript (repeatable)")
    args = parser.parse_args()
    corpus = load_corpus(args.corpus)
    if args.only:
        corpus = {k: v for k, v in corpus.items() if k in args.only}
    snapshots = {name: {k: v for k, v in s.items() if k != "source"} for name, s in corpus.items()}
    prepared = {name: prepare_snapshot(s) for name, s in snapshots.items()}
    everything = {name: corpus_artifacts(s) for name, s in snapshots.items()}
    for name, s in snapshots.items():
        print(
            f"{name:22} {len(s['messages']):4} messages, {prepared[name].total_tokens:6} tokens (estimate),"
            f" {len(everything[name]):3} distinct artifacts"
        )
    runs: list[list[Result]] = []
    started = time.perf_counter()
    async with (
        deployed(SIDEQUEST_CALIBRATION="off") as service,
        httpx.AsyncClient(base_url=service.url, timeout=120) as client,
    ):
        print(f"sidequest serve pid {service.pid}; load average {os.getloadavg()[0]:.1f}")
        for run in range(args.runs):
            results = []
            for name in snapshots:
                for window in WINDOWS:
                    for mask in (True, False):
                        results.append(
                            await one_case(
                                client,
                                service.scripted,
                                name,
                                snapshots[name],
                                prepared[name],
                                everything[name],
                                window,
                                mask,
                            )
                        )
            runs.append(results)
            print(f"run {run + 1} done after {time.perf_counter() - started:.0f} s")
    print(f"\n{args.runs} run(s); calls {CALL_DELAY_S} s each; calibration off; ranges: min–max over runs\n")
    print_table(runs)
    ok = verdicts(runs)
    times = [r.seconds for run in runs for r in run]
    print(
        f"\nsummary: {'every target met' if ok else 'targets MISSED'}; {len(runs)} run(s) of"
        f" {len(runs[0])} cases in {time.perf_counter() - started:.0f} s (median case"
        f" {statistics.median(times):.2f} s); load average after {os.getloadavg()[0]:.1f}"
    )
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    asyncio.run(main())
