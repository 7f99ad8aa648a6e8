"""``sidequest sessions``: the tenant's sessions over HTTP, one line each, page by page."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from service.api.app import create_app
from service.config import Settings
from service.store.db import Database
from tests.api.conftest import serve
from tests.cli.test_ask import _env, sidequest, sidequest_in_process


@pytest.fixture
async def url(db: Database, settings: Settings) -> AsyncIterator[str]:
    """An API (no worker: admitted questions stay queued) with two tenants."""
    app = create_app(
        settings.model_copy(update={"api_tokens": "acme:tok-acme,globex:tok-globex"}),
        settings.database_url or "",
    )
    async with serve(app) as base:
        async with (
            httpx.AsyncClient(base_url=base, headers={"Authorization": "Bearer tok-acme"}) as acme,
            httpx.AsyncClient(base_url=base, headers={"Authorization": "Bearer tok-globex"}) as globex,
        ):
            for parent in ("task-1", "task-2", "task-3"):
                assert (
                    await acme.post(f"/v1/sessions/{parent}/questions", json={"question": "q"})
                ).status_code == 202
            assert (
                await globex.post("/v1/sessions/task-g/questions", json={"question": "q"})
            ).status_code == 202
        yield base


async def test_sessions_lists_the_tenants_sessions_newest_first(url: str) -> None:
    run = await sidequest_in_process("sessions", "--url", url, "--token", "tok-acme")
    assert run.code == 0, run.err
    lines = run.out.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["task-3", "task-2", "task-1"]
    assert "1 queued" in lines[0] and "clear 0" in lines[0]
    assert "task-g" not in run.out and run.err == ""


async def test_sessions_pages_with_before_or_all(url: str) -> None:
    first = await sidequest_in_process("sessions", "--limit", "2", "--url", url, "--token", "tok-acme")
    assert [line.split("\t")[0] for line in first.out.splitlines()] == ["task-3", "task-2"]
    hint = first.err.strip()
    assert hint.startswith("more sessions: sidequest sessions --before ")
    cursor = hint.rsplit(" ", 1)[1]
    rest = await sidequest_in_process("sessions", "--before", cursor, "--url", url, "--token", "tok-acme")
    assert [line.split("\t")[0] for line in rest.out.splitlines()] == ["task-1"] and rest.err == ""
    every = await sidequest_in_process(
        "sessions", "--all", "--limit", "1", "--json", "--url", url, "--token", "tok-acme"
    )
    items = [json.loads(line) for line in every.out.splitlines()]
    assert [i["parent_id"] for i in items] == ["task-3", "task-2", "task-1"]
    assert items[0]["counts"]["queued"] == 1


async def test_sessions_refusals_exit_2(url: str) -> None:
    bad = await sidequest_in_process("sessions", "--before", "nonsense", "--url", url, "--token", "tok-acme")
    assert bad.code == 2 and "invalid_cursor" in bad.err
    anonymous = await sidequest("sessions", "--url", url, env=_env())
    assert anonymous.code == 2 and "unauthorized" in anonymous.err
    by_env = await sidequest("sessions", env=_env(SIDEQUEST_URL=url, SIDEQUEST_TOKEN="tok-globex"))
    assert by_env.code == 0 and by_env.out.split("\t")[0] == "task-g"
