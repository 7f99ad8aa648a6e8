"""``sidequest ask`` and ``sidequest archive`` as a user runs them: a subprocess talking to a real
server (uvicorn on a free 127.0.0.1 port, API and worker in one process) whose model is the scripted
OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import pytest

from service import client
from service.cli import build_parser
from service.config import Settings
from service.serve import create_serving_app
from service.store.db import Database
from tests.api.conftest import serve
from tests.api.tool_snapshots import tool_heavy_snapshot
from tests.scripted_provider import ScriptedServer, Step, Usage

ROOT = Path(__file__).resolve().parents[2]
CLI_TIMEOUT_S = 60.0


@dataclass
class Run:
    """A finished CLI run."""

    code: int
    out: str
    err: str


@dataclass
class Stack:
    """The running service and its scripted model."""

    url: str
    model: ScriptedServer


@pytest.fixture
def model() -> Iterator[ScriptedServer]:
    with ScriptedServer() as server:
        yield server


@asynccontextmanager
async def running_stack(
    settings: Settings, model: ScriptedServer, **overrides: object
) -> AsyncIterator[Stack]:
    chosen = settings.model_copy(
        update={
            "provider": "openai",
            "base_url": model.base_url,
            "api_key": "sk-scripted",
            "model": "scripted-model",
            "request_timeout_s": 30.0,
            **overrides,
        }
    )
    app = create_serving_app(chosen, settings.database_url or "")
    async with serve(app) as url:
        yield Stack(url=url, model=model)


@pytest.fixture
async def stack(db: Database, settings: Settings, model: ScriptedServer) -> AsyncIterator[Stack]:
    async with running_stack(settings, model) as running:
        yield running


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIDEQUEST_", "OPENAI_"))}
    env.update(extra)
    return env


async def sidequest(*args: str, env: dict[str, str] | None = None) -> Run:
    """Run ``python -m service.cli ARGS`` (what the ``sidequest`` script runs) without blocking the loop."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "service.cli",
        *args,
        cwd=ROOT,
        env=env or _env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        raise AssertionError(f"sidequest {args} did not finish:\n{err.decode()}") from None
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(), err.decode())


async def sidequest_in_process(*args: str) -> Run:
    """The same command parsed and run inside this process (in a thread: the server shares our loop).

    Faster than a subprocess; used where the process boundary itself is not what a test is about.
    """

    def run() -> Run:
        out, err = io.StringIO(), io.StringIO()
        code = client.main(build_parser().parse_args(list(args)), out=out, err=err)
        return Run(code, out.getvalue(), err.getvalue())

    return await asyncio.wait_for(asyncio.to_thread(run), CLI_TIMEOUT_S)


def snapshot_file(tmp_path: Path) -> Path:
    snapshot = {
        "snapshot_id": "s-1",
        "taken_at": "2026-11-29T10:00:00Z",
        "system": "You are a coding agent working on the billing service.",
        "tools": [{"name": "grep", "description": "search files", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Fix the rounding bug in invoice totals."},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Searching for the rounding helper."},
                    {"type": "tool_use", "id": "t1", "name": "grep", "input": {"pattern": "round_half"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "billing/invoice.py:42"}],
            },
        ],
        "context_window": 200000,
        "max_output_tokens": 32000,
    }
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(snapshot), encoding="utf-8")
    return path


async def test_ask_renders_the_stages_then_the_answer_and_exits_0(stack: Stack, tmp_path: Path) -> None:
    answer = "It is fixing the rounding in billing/invoice.py line 42."
    stack.model.script("answer", Step.text(answer, chunks=4, usage=Usage(900, 14, cached_tokens=512)))
    run = await sidequest(
        "ask",
        "task-7",
        "What is the agent doing?",
        "--snapshot",
        str(snapshot_file(tmp_path)),
        "--url",
        stack.url,
    )
    assert run.code == 0, run.err
    assert run.out == answer + "\n"  # stdout holds the answer and nothing else
    lines = run.err.splitlines()
    assert "question #1 admitted" in lines[0]
    stages = [line.split("stage ", 1)[1] for line in lines if "] stage " in line]
    assert stages[:1] == ["preparing"] and "answering" in stages
    assert stages.index("organizing_history") < stages.index("answering")
    assert any("usage: in 900 (cached 512) · out 14 · 1 call · last: answer ok" in line for line in lines)
    assert lines[-1].endswith("] succeeded · in 900 (cached 512) · out 14 · 1 call")
    # Three small messages fit the window as they are: the fidelity line says so, just before the end.
    assert lines[-2].endswith(
        "] context: not compacted — the whole snapshot went verbatim (3 messages);"
        " artifacts 1 of 1 in the prompt"
    )

    # The second question replays the first Q&A; the CLI says so.
    stack.model.script("answer", Step.text("Yes, twice.", usage=Usage(950, 4)))
    again = await sidequest(
        "ask", "task-7", "Did it run the tests?", "--snapshot-id", "s-1", "--url", stack.url
    )
    assert again.code == 0, again.err
    assert again.out == "Yes, twice.\n"
    assert "question #2 admitted" in again.err
    assert "replaying 1 Q&A group (#1)" in again.err


async def test_ask_says_what_of_a_masked_snapshot_reached_the_model(stack: Stack, tmp_path: Path) -> None:
    # 16 file reads of ~800 bytes each in a 4096-token window: the oldest results must be masked
    # (tier 1, no summary call) for the question to fit.
    snapshot = tool_heavy_snapshot("s-tools", groups=16, context_window=4096, max_output_tokens=256)
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(snapshot), encoding="utf-8")
    run = await sidequest(
        "ask", "task-tools", "Which modules did it read?", "--snapshot", str(path), "--url", stack.url
    )
    assert run.code == 0, run.err
    assert run.out == "Scripted answer.\n"  # the line is status (stderr), never part of the answer
    assert not stack.model.requests(purpose="context_summary")
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as http:
        (record,) = (await http.get("/v1/sessions/task-tools/questions")).json()["items"]
    fidelity = record["context_info"]["fidelity"]
    assert fidelity["tier"] == "masked" and fidelity["summarized_messages"] == 0
    assert 0 < fidelity["masked_messages"] < fidelity["verbatim_messages"]
    # Every message is one of the three; masking never elides an artifact (a Read's file_path).
    assert fidelity["verbatim_messages"] + fidelity["masked_messages"] == len(snapshot["messages"])
    assert fidelity["artifacts"] == {"total": 16, "in_prompt": 16}
    kilobytes = fidelity["masked_payload_bytes"] / 1000
    elided = f"{kilobytes:.1f} KB" if kilobytes < 9.95 else f"{kilobytes:.0f} KB"
    lines = run.err.splitlines()
    assert lines[-2].split("] ", 1)[1] == (
        f"context: masked — {fidelity['verbatim_messages']} verbatim, {fidelity['masked_messages']} masked"
        f" ({elided} elided), 0 summarised messages; artifacts 16 of 16 in the prompt"
    )
    assert lines[-1].split("] ", 1)[1].startswith("succeeded")


def long_snapshot_file(tmp_path: Path) -> Path:
    """A main session far larger than its own 32k window: the copy must be compacted.

    About 89k tokens of plain text, nearly three windows: tier 2 summarises only the fewest oldest
    groups that make the question fit (SPEC 6.2), and those must still be more than one summary chunk
    (at 44k tokens they were one since the compaction ladder)."""
    messages: list[dict[str, str]] = []
    for i in range(150):
        messages.append({"role": "user", "content": f"step {i}: " + f"please look at module {i}. " * 40})
        messages.append({"role": "assistant", "content": f"done {i}: " + f"changed line {i}. " * 40})
    snapshot = {
        "snapshot_id": "long",
        "system": "You are a coding agent.",
        "messages": messages,
        "context_window": 32768,
        "max_output_tokens": 1024,
    }
    path = tmp_path / "long.json"
    path.write_text(json.dumps(snapshot), encoding="utf-8")
    return path


async def test_ask_shows_summary_chunks_and_then_the_cache_hit(stack: Stack, tmp_path: Path) -> None:
    first = await sidequest(
        "ask",
        "task-long",
        "Where is it?",
        "--snapshot",
        str(long_snapshot_file(tmp_path)),
        "--url",
        stack.url,
    )
    assert first.code == 0, first.err
    assert first.out == "Scripted answer.\n"  # the scripted server's default answer
    assert "] stage compacting_context" in first.err
    assert "compacting_context: context summary cache miss" in first.err
    chunks = [line.rsplit(" ", 1)[1] for line in first.err.splitlines() if "context summary chunk" in line]
    assert len(chunks) >= 2 and chunks == [f"{i}/{len(chunks)}" for i in range(1, len(chunks) + 1)]
    # Plain text has no tool payload to mask: the oldest messages are summarised, the rest verbatim.
    fidelity = first.err.splitlines()[-2].split("] ", 1)[1]
    assert re.fullmatch(
        r"context: summary — \d+ verbatim, 0 masked, \d+ summarised messages;"
        r" no tool-call artifacts in the snapshot",
        fidelity,
    ), fidelity

    second = await sidequest("ask", "task-long", "And now?", "--snapshot-id", "long", "--url", stack.url)
    assert second.code == 0, second.err
    assert "compacting_context: context summary cache hit" in second.err
    assert "context summary chunk" not in second.err


async def test_a_provider_failure_exits_1_with_the_error_code(stack: Stack) -> None:
    stack.model.script("answer", Step.server_error(500))
    run = await sidequest("ask", "task-8", "Anything new?", env=_env(SIDEQUEST_URL=stack.url))
    assert run.code == 1, run.err
    assert run.out == ""
    last = run.err.splitlines()[-1]
    assert last.split("] ", 1)[1].startswith("failed: provider_error:")
    assert "status=500" in last


async def test_a_cancelled_request_exits_1_and_says_cancelled(stack: Stack) -> None:
    stack.model.script("answer", Step.hang(text="Thinking"))
    task = asyncio.create_task(sidequest("ask", "task-9", "Slow one?", "--url", stack.url))
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
        for _ in range(200):
            page = (await client.get("/v1/sessions/task-9/questions")).json() if not task.done() else None
            items = page["items"] if page and "items" in page else []
            if items and items[0]["status"] == "running" and stack.model.requests(purpose="answer"):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the request never started")
        await client.post(f"/v1/questions/{items[0]['id']}/cancel")
    run = await task
    assert run.code == 1, run.err
    assert "cancelled: cancelled" in run.err.splitlines()[-1]


async def test_ctrl_c_cancels_the_request_and_exits_130(stack: Stack) -> None:
    stack.model.script("answer", Step.hang(text="Partial"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "service.cli",
        "ask",
        "task-int",
        "Will you wait?",
        "--url",
        stack.url,
        cwd=ROOT,
        env=_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    # The answer started streaming: the request is running on the server.
    assert await asyncio.wait_for(proc.stdout.read(7), CLI_TIMEOUT_S) == b"Partial"
    proc.send_signal(signal.SIGINT)
    _out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    assert proc.returncode == 130, err.decode()
    assert "interrupted: cancelling the request" in err.decode()
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
        (record,) = (await client.get("/v1/sessions/task-int/questions")).json()["items"]
    assert record["status"] == "cancelled"


async def test_the_token_comes_from_the_flag_or_the_environment(
    db: Database, settings: Settings, model: ScriptedServer
) -> None:
    async with running_stack(settings, model, api_tokens="acme:tok-acme") as secured:
        anonymous = await sidequest("ask", "task-auth", "Who am I?", "--url", secured.url)
        assert anonymous.code == 2 and "unauthorized" in anonymous.err
        by_env = await sidequest(
            "ask", "task-auth", "Who am I?", env=_env(SIDEQUEST_URL=secured.url, SIDEQUEST_TOKEN="tok-acme")
        )
        assert by_env.code == 0, by_env.err
        by_flag = await sidequest_in_process(
            "ask", "task-auth", "Again?", "--url", secured.url, "--token", "tok-acme"
        )
        assert by_flag.code == 0 and "question #2 admitted" in by_flag.err


async def test_a_refused_question_or_unreachable_server_exits_2(stack: Stack, tmp_path: Path) -> None:
    missing = await sidequest_in_process("ask", "task-10", "q?", "--snapshot-id", "nope", "--url", stack.url)
    assert missing.code == 2
    assert "snapshot_missing" in missing.err
    bad_file = tmp_path / "bad.json"
    bad_file.write_text("{", encoding="utf-8")
    unreadable = await sidequest_in_process(
        "ask", "task-10", "q?", "--snapshot", str(bad_file), "--url", stack.url
    )
    assert unreadable.code == 2 and "not valid JSON" in unreadable.err
    # A closed port on loopback: nothing listens there once the probe socket is gone.
    nowhere = await sidequest("ask", "task-10", "q?", "--url", "http://127.0.0.1:9")
    assert nowhere.code == 2 and "cannot reach" in nowhere.err


async def test_archive_export_and_import_round_trip_through_the_cli(stack: Stack, tmp_path: Path) -> None:
    assert (await sidequest_in_process("ask", "origin", "First?", "--url", stack.url)).code == 0
    assert (await sidequest_in_process("ask", "origin", "Second?", "--url", stack.url)).code == 0
    exported = tmp_path / "origin.json"
    run = await sidequest_in_process("archive", "export", "origin", "-o", str(exported), "--url", stack.url)
    assert run.code == 0, run.err
    document = json.loads(exported.read_text(encoding="utf-8"))
    assert document["version"] == 3 and [q["ordinal"] for q in document["questions"]] == [1, 2]
    # What the real worker writes (usage, context_info, memory) fits the published schema.
    schema = json.loads((ROOT / "docs" / "archive" / "v3.schema.json").read_text(encoding="utf-8"))
    jsonschema.validate(document, schema)
    assert document["questions"][1]["context_info"]["replayed_ordinals"] == [1, 1]

    imported = await sidequest_in_process(
        "archive", "import", str(exported), "--parent-id", "copy", "--url", stack.url
    )
    assert imported.code == 0, imported.err
    assert "restored 2 requests into copy (archive version 3); next ordinal 3" in imported.out

    again = await sidequest_in_process(
        "archive", "import", str(exported), "--parent-id", "copy", "--url", stack.url
    )
    assert again.code == 2 and "session_has_history" in again.err
    replaced = await sidequest_in_process(
        "archive", "import", str(exported), "--parent-id", "copy", "--replace", "--url", stack.url
    )
    assert replaced.code == 0 and "replacing 2" in replaced.out

    copy = await sidequest_in_process("archive", "export", "copy", "--url", stack.url)
    assert copy.code == 0
    copied = json.loads(copy.out)
    assert {k: v for k, v in copied.items() if k not in ("parent_id", "exported_at")} == {
        k: v for k, v in document.items() if k not in ("parent_id", "exported_at")
    }
    v1 = await sidequest_in_process("archive", "export", "copy", "--version", "1", "--url", stack.url)
    assert json.loads(v1.out)["version"] == 1
    # A file that is JSON but no archive object says so, rather than asking for --parent-id.
    listed = tmp_path / "list.json"
    listed.write_text("[1]", encoding="utf-8")
    for extra in ((), ("--parent-id", "copy")):
        refused = await sidequest_in_process("archive", "import", str(listed), *extra, "--url", stack.url)
        assert refused.code == 2 and "is not an archive: an archive is a JSON object" in refused.err
