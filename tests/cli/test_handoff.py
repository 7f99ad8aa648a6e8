"""``sidequest handoff`` against a real server (uvicorn on 127.0.0.1): prints the block to stdout."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from service import client
from service.api.app import create_app
from service.budget.handoff import FRAMING
from service.cli import build_parser
from service.config import Settings
from service.store.db import Database
from tests.api.conftest import serve
from tests.api.helpers import ask, finish, mark_running

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def url(db: Database, settings: Settings) -> AsyncIterator[str]:
    async with serve(create_app(settings, settings.database_url or "")) as base:
        yield base


async def answered(base: str, db: Database, parent: str, question: str) -> None:
    async with httpx.AsyncClient(base_url=base) as http:
        record = await ask(http, parent, question)
    await mark_running(db, record["id"])
    await finish(db, record["id"], answer=f"answer to {question}")


async def run(*args: str) -> tuple[int, str, str]:
    def call() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = client.main(build_parser().parse_args(list(args)), out=out, err=err)
        return code, out.getvalue(), err.getvalue()

    return await asyncio.wait_for(asyncio.to_thread(call), 60)


async def test_handoff_prints_the_text_block_then_nothing_new_and_all_brings_everything(
    url: str, db: Database
) -> None:
    await answered(url, db, "task-7", "which file?")
    code, out, err = await run("handoff", "task-7", "--url", url)
    assert code == 0, err
    assert out.startswith(FRAMING) and "Side question #1 " in out and "Q: which file?" in out
    assert "handed off 1 side answer (#1)" in err
    code, out, err = await run("handoff", "task-7", "--url", url)
    assert code == 0 and out == "" and "nothing to hand off" in err
    await answered(url, db, "task-7", "and the tests?")
    code, out, _ = await run("handoff", "task-7", "--all", "--max-tokens", "256", "--url", url)
    assert code == 0 and "#2 " in out
    code, out, _ = await run("handoff", "task-7", "--all", "--format", "openai", "--url", url)
    message = json.loads(out)
    assert message["role"] == "user" and message["content"].startswith(FRAMING)


async def test_what_is_left_out_to_fit_is_said_on_stderr(url: str, db: Database) -> None:
    for i in range(1, 7):
        async with httpx.AsyncClient(base_url=url) as http:
            record = await ask(http, "task-long", f"question {i}?")
        await mark_running(db, record["id"])
        await finish(db, record["id"], answer=f"answer {i}: " + "details of the parser " * 60)
    code, out, err = await run("handoff", "task-long", "--max-tokens", "256", "--url", url)
    assert code == 0, err
    assert "Side question #6 " in out and "left out to fit: #1" in out
    assert "side answers (#1" in err and "left out to fit (each not handed off before is pinned" in err
    code, out, err = await run("handoff", "task-long", "--all", "--url", url)
    assert code == 0 and "Side question #1 " in out and "left out" not in err


async def test_bad_arguments_and_refusals_exit_2(url: str, db: Database) -> None:
    code, _, err = await run("handoff", "nobody", "--url", url)
    assert code == 2 and "404" in err and "not_found" in err
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "service.cli",
        "handoff",
        "p",
        "--max-tokens",
        "100",
        "--url",
        url,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _out, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"256 to 32768" in stderr
