"""SPEC §1, the CLI: `sidequest ask` and `sidequest archive` against a running service.

Checked from the outside over HTTP, against the shared ``sidequest serve`` processes (conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.e2e.contract.helpers import (
    SNAPSHOT,
    Service,
    ask,
    new_parent,
    wait_for,
)
from tests.scripted_provider import ScriptedServer, Step


def _cli(*args: str, url: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDEQUEST_")}
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args, "--url", url],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )


async def test_cli_ask_prints_the_answer_and_exits_0_or_names_the_error_code_and_exits_nonzero(
    services: dict[str, Service], scripted: ScriptedServer, tmp_path: Path
) -> None:
    url = services["open"].url
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text(json.dumps(SNAPSHOT))
    parent = new_parent()
    scripted.script("answer", Step.text("The agent edits billing/invoice.py.", chunks=3))
    ok = await asyncio.to_thread(
        _cli, "ask", parent, "Which file?", "--snapshot", str(snapshot), url=url, cwd=tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    assert "The agent edits billing/invoice.py." in ok.stdout

    scripted.script("answer", Step.server_error(500))
    failed = await asyncio.to_thread(_cli, "ask", parent, "And now?", url=url, cwd=tmp_path)
    assert failed.returncode != 0
    assert "provider_error" in failed.stdout + failed.stderr

    missing = await asyncio.to_thread(
        _cli, "ask", parent, "Unknown snapshot?", "--snapshot-id", "nope", url=url, cwd=tmp_path
    )
    assert missing.returncode != 0 and "snapshot_missing" in missing.stderr


async def test_cli_archive_export_then_import_round_trips(
    services: dict[str, Service], client: httpx.AsyncClient, tmp_path: Path
) -> None:
    url = services["open"].url
    parent = new_parent()
    await wait_for(client, (await ask(client, parent, "Archived?"))["id"])
    archive = tmp_path / "archive.json"
    exported = await asyncio.to_thread(
        _cli, "archive", "export", parent, "--output", str(archive), url=url, cwd=tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    document = json.loads(archive.read_text())
    assert document["version"] == 3 and [q["question"] for q in document["questions"]] == ["Archived?"]
    copy = new_parent()
    imported = await asyncio.to_thread(
        _cli, "archive", "import", str(archive), "--parent-id", copy, url=url, cwd=tmp_path
    )
    assert imported.returncode == 0, imported.stderr
    again = (await client.get(f"/v1/sessions/{copy}/archive")).json()
    assert {k: v for k, v in again.items() if k not in ("parent_id", "exported_at")} == {
        k: v for k, v in document.items() if k not in ("parent_id", "exported_at")
    }
    refused = await asyncio.to_thread(
        _cli, "archive", "import", str(archive), "--parent-id", copy, url=url, cwd=tmp_path
    )
    assert refused.returncode != 0
    assert "session_has_history" in refused.stderr
