"""What the inspector's browser tests share: a real service (API + worker, two tenants) whose model
is the scripted server, a headless chromium attached over CDP, and helpers to drive the page."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api.app import create_app
from service.config import Settings
from service.store.db import Database
from service.worker import start_worker
from tests.api.cdp import Browser, chromium
from tests.api.conftest import TOKENS, serve
from tests.factories import scripted_settings
from tests.scripted_provider import ScriptedServer

ROOT = Path(__file__).resolve().parents[2]


def artifacts_dir() -> Path:
    """Where screenshots go: ``$PYTEST_ARTIFACTS`` or ``tests/artifacts`` (ignored by git)."""
    return Path(os.environ.get("PYTEST_ARTIFACTS") or ROOT / "tests" / "artifacts")


def big_snapshot(snapshot_id: str = "s-big", pairs: int = 30) -> dict[str, Any]:
    """A main context too large for its 16000-token window: the request must compact it."""
    messages: list[dict[str, Any]] = []
    for i in range(pairs):
        messages.append(
            {"role": "user", "content": f"Step {i}: look at billing/module_{i}.py. " + "detail " * 200}
        )
        messages.append(
            {
                "role": "assistant",
                "content": f"module_{i}.py parses invoice batch {i}. " + "explanation " * 200,
            }
        )
    return {
        "snapshot_id": snapshot_id,
        "taken_at": "2026-11-29T10:00:00Z",
        "system": "You are the main agent working on the billing service.",
        "tools": [{"name": "grep", "description": "search files", "input_schema": {"type": "object"}}],
        "messages": messages,
        "context_window": 16000,
        "max_output_tokens": 2048,
    }


@dataclass
class Stack:
    """The running service and its scripted model."""

    url: str
    model: ScriptedServer

    def client(self, token: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    async def until_finished(self, token: str, request_id: str, within: float = 60) -> dict[str, Any]:
        """Poll the record until it is terminal; the record."""
        async with self.client(token) as client, asyncio.timeout(within):
            while True:
                record: dict[str, Any] = (await client.get(f"/v1/questions/{request_id}")).json()
                if record["status"] in ("succeeded", "failed", "cancelled"):
                    return record
                await asyncio.sleep(0.2)


@pytest.fixture
async def stack(db: Database, settings: Settings) -> AsyncIterator[Stack]:
    """API and worker in one process (as ``sidequest serve``), tenants acme and globex.

    The worker is started here on the app's own pool and LISTEN connection, once the app is up (what
    ``sidequest serve`` composes), and stopped before the app.
    """
    with ScriptedServer() as model:
        chosen = scripted_settings(settings.database_url or "", model.base_url, api_tokens=TOKENS)
        app = create_app(chosen, settings.database_url or "")
        async with serve(app) as url:
            worker = await start_worker(chosen, app.state.db, listener=app.state.listener)
            try:
                yield Stack(url=url, model=model)
            finally:
                await worker.stop()


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """Headless chromium with one page, at the desktop size."""
    async with chromium() as page:
        await page.viewport(1280, 720)
        yield page


async def connect(browser: Browser, url: str, token: str) -> None:
    """Open the page, type the token into its labelled field and press Connect."""
    await browser.goto(f"{url}/")
    await browser.evaluate("document.getElementById('token').value = ''")  # a reload refills it
    await browser.type_text("#token", token)
    await browser.evaluate("document.getElementById('connect').click()")
    await browser.wait_for(
        "document.getElementById('sessions-empty').hidden || "
        "document.getElementById('sessions-empty').textContent.startsWith('No sessions')"
    )


async def open_session(browser: Browser, parent_id: str) -> None:
    """Click the session's entry and wait for its history."""
    selector = json.dumps(f'#session-list button[data-parent-id="{parent_id}"]')
    await browser.wait_for(f"!!document.querySelector({selector})")
    await browser.evaluate(f"document.querySelector({selector}).click()")
    await browser.wait_for(
        f"document.getElementById('session-title').textContent === {json.dumps(parent_id)}"
    )
    await browser.wait_for(
        "document.querySelectorAll('#history button').length > 0 || "
        "!document.getElementById('history-empty').hidden"
    )


async def open_request(browser: Browser, request_id: str) -> None:
    """Click the request in the history and wait until its detail and stream are shown."""
    selector = json.dumps(f'#history button[data-request-id="{request_id}"]')
    await browser.wait_for(f"!!document.querySelector({selector})")
    await browser.evaluate(f"document.querySelector({selector}).click()")
    await browser.wait_for("!document.getElementById('request').hidden")


async def no_horizontal_scroll(browser: Browser) -> bool:
    """Whether the page fits its viewport's width (nothing to scroll sideways)."""
    fits = await browser.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    return bool(fits)
