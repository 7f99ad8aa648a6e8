"""The inspector page (GET /, SPEC §12) in real headless chromium, against a real service.

The browser talks to the service exactly as a person's would: the page's own fetch and EventSource
calls, with the token typed into its field. The model is the scripted server, so answers stream in
deltas at a pace the test chooses. Screenshots at 390×844 and 1280×720 go to the artefacts
directory (``$PYTEST_ARTIFACTS``, else ``tests/artifacts``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import update

from service.api.routes_inspector import inspector_page
from service.store.db import Database
from service.store.models import SessionRow
from tests.api.cdp import Browser
from tests.api.conftest import Server
from tests.api.helpers import ask
from tests.api.inspector_support import (
    Stack,
    artifacts_dir,
    big_snapshot,
    browser,
    connect,
    no_horizontal_scroll,
    open_request,
    open_session,
    stack,
)
from tests.api.tool_snapshots import tool_heavy_snapshot
from tests.scripted_provider import Step, Usage

__all__ = ["browser", "stack"]  # fixtures

SEGMENTS = ("system", "tools", "context", "qa_summary", "qa_raw", "question", "envelope")


def _wait_for_download(directory: Path, within: float = 20) -> list[Path]:
    """The finished ``.json`` downloads in ``directory`` (chromium renames them when complete)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        files = [p for p in directory.iterdir() if p.suffix == ".json"]
        if files:
            return files
        time.sleep(0.1)
    raise AssertionError(f"nothing was downloaded into {directory}")


async def _answered(stack: Stack, parent: str, question: str, **body: Any) -> dict[str, Any]:
    async with stack.client("tok-acme") as client:
        record = await ask(client, parent, question, **body)
    finished = await stack.until_finished("tok-acme", record["id"])
    assert finished["status"] == "succeeded", finished
    return finished


async def test_page_is_one_self_contained_document(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as client:
        response = await client.get("/")  # no token needed for the page itself: it holds no data
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp
    # Nothing to fetch from anywhere: no src/href to another document, script or stylesheet.
    assert "<script src" not in html and '<link rel="stylesheet"' not in html
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
    assert '<label for="token">API token</label>' in html and '<input id="token"' in html
    assert inspector_page() == (html, csp)
    # The policy allows exactly the inline script and stylesheet that are there, by hash.
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        assert len(blocks) == 1
        digest = base64.b64encode(hashlib.sha256(blocks[0].encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}'" in csp


async def test_page_loads_with_no_external_request_and_no_console_error(
    stack: Stack, browser: Browser
) -> None:
    await browser.goto(f"{stack.url}/")
    await browser.wait_for("document.getElementById('token') !== null")
    label = await browser.evaluate("document.getElementById('token').labels[0].textContent")
    assert label == "API token"
    assert await browser.evaluate("document.getElementById('token').tagName") == "INPUT"
    await connect(browser, stack.url, "tok-acme")
    await asyncio.sleep(0.5)
    assert browser.requests, "the browser reported no request at all"
    foreign = [u for u in browser.requests if not u.startswith((stack.url, "data:", "about:"))]
    assert foreign == [], foreign
    assert browser.console_errors == []
    # Accessible basics: every field has a label; every control is a real button or field.
    unlabelled = await browser.evaluate(
        "[...document.querySelectorAll('input, select, textarea')]"
        ".filter(e => !e.labels || e.labels.length === 0).map(e => e.id)"
    )
    assert unlabelled == []
    clickable_non_buttons = await browser.evaluate(
        "[...document.querySelectorAll('[onclick], a[href]')].filter(e => e.tagName !== 'BUTTON').length"
    )
    assert clickable_non_buttons == 0


async def test_lists_the_tenants_sessions_and_not_another_tenants(stack: Stack, browser: Browser) -> None:
    async with stack.client("tok-acme") as acme, stack.client("tok-globex") as globex:
        await ask(acme, "acme-first", "one?")
        await ask(globex, "globex-secret", "theirs?")
        await ask(acme, "acme-second", "two?")
    await connect(browser, stack.url, "tok-acme")
    await browser.wait_for("document.querySelectorAll('#session-list button').length === 2")
    entries = await browser.evaluate(
        "[...document.querySelectorAll('#session-list button')]"
        ".map(b => [b.dataset.parentId, b.querySelector('.pid').textContent])"
    )
    assert entries == [["acme-second", "acme-second"], ["acme-first", "acme-first"]]  # newest activity first
    assert "globex-secret" not in await browser.evaluate("document.body.innerText")
    # The token is kept in sessionStorage: a reload reconnects by itself.
    assert await browser.evaluate("sessionStorage.getItem('sidequest.token')") == "tok-acme"
    await browser.goto(f"{stack.url}/")
    await browser.wait_for("document.querySelectorAll('#session-list button').length === 2")
    await browser.evaluate("document.querySelector('#session-list button').click()")
    await browser.wait_for("location.hash.includes('session=acme-second')")
    # Another tenant's token sees only its own session; forgetting the token forgets the address too.
    await browser.evaluate("document.getElementById('forget').click()")
    assert await browser.evaluate("sessionStorage.getItem('sidequest.token')") is None
    assert "acme" not in await browser.evaluate("location.hash")
    await connect(browser, stack.url, "tok-globex")
    await browser.wait_for("document.querySelectorAll('#session-list button').length === 1")
    assert (
        await browser.evaluate("document.querySelector('#session-list .pid').textContent") == "globex-secret"
    )
    # Keyboard: the entry is a focusable button and Enter opens it.
    await browser.evaluate("document.querySelector('#session-list button').focus()")
    await browser.press("Enter", 13)
    await browser.wait_for("document.getElementById('session-title').textContent === 'globex-secret'")
    # Another token typed in and connected without Forget (or a reload): nothing of the last tenant's
    # stays on screen — not its session, request or answer.
    await browser.evaluate("document.getElementById('token').value = ''")
    await browser.type_text("#token", "tok-acme")
    await browser.evaluate("document.getElementById('connect').click()")
    await browser.wait_for("document.querySelectorAll('#session-list button').length === 2")
    assert await browser.evaluate("document.getElementById('session').hidden") is True
    assert "globex-secret" not in await browser.evaluate("document.body.innerText")
    assert "globex" not in await browser.evaluate("location.hash")
    assert browser.console_errors == []


async def test_a_wrong_token_is_told_and_a_server_without_auth_needs_none(
    stack: Stack, server: Server, browser: Browser
) -> None:
    await browser.goto(f"{stack.url}/")
    await browser.type_text("#token", "tok-wrong")
    await browser.press("Enter", 13)  # submits the token form from the keyboard
    await browser.wait_for("document.getElementById('notice').classList.contains('bad')")
    notice = await browser.evaluate("document.getElementById('notice').textContent")
    assert notice == "listing sessions failed: unauthorized: a valid bearer token is required"
    # A refused token is not kept, and the list does not claim the token has no sessions.
    assert await browser.evaluate("sessionStorage.getItem('sidequest.token')") is None
    hint = await browser.evaluate("document.getElementById('sessions-empty').textContent")
    assert "No sessions yet" not in hint and "Paste a token" in hint
    async with server.client() as client:  # no auth configured: tenant "default"
        await ask(client, "p-open", "anyone?")
    await browser.goto(f"{server.url}/")
    await browser.evaluate("document.getElementById('connect').click()")  # with an empty token
    await browser.wait_for("document.querySelectorAll('#session-list button').length === 1")
    assert await browser.evaluate("document.querySelector('#session-list .pid').textContent") == "p-open"
    await browser.goto(f"{server.url}/")  # a reload reconnects without asking again
    await browser.wait_for("document.querySelectorAll('#session-list button').length === 1")


async def test_request_detail_draws_the_budget_bar_in_proportion_to_the_estimate(
    stack: Stack, browser: Browser
) -> None:
    stack.model.set_default("answer", Step.text("module_3.py parses invoice batch 3.", usage=Usage(9000, 12)))
    await _answered(stack, "p-budget", "What does module_1 do?", snapshot=big_snapshot())
    record = await _answered(stack, "p-budget", "Which module parses batch 3?", snapshot_id="s-big")
    info = record["context_info"]
    assert info["context_summary"]["used"] and info["replayed_ordinals"] == [1, 1]
    await connect(browser, stack.url, "tok-acme")
    await open_session(browser, "p-budget")
    await open_request(browser, record["id"])
    await browser.wait_for("!!document.querySelector('#budget-bar rect[data-segment]')")
    bar: dict[str, float] = dict(
        await browser.evaluate(
            "[...document.querySelectorAll('#budget-bar rect[data-segment]')]"
            ".map(r => [r.dataset.segment, parseFloat(r.getAttribute('width'))])"
        )
    )
    assert await browser.evaluate("document.getElementById('budget-bar').tagName") == "svg"
    estimate = info["estimate"]
    expected = {s: estimate[s] for s in SEGMENTS}
    expected["free"] = info["input_budget"] - sum(expected.values())
    expected["output"] = info["max_output_tokens"]
    expected["margin"] = info["safety_margin"]
    assert set(bar) == set(expected)
    scale = 1000 / info["window"]  # the whole bar is the window: input budget + output cap + margin
    for segment, tokens in expected.items():
        assert abs(bar[segment] - tokens * scale) < 0.01, (segment, bar[segment], tokens)
    assert bar["context"] > bar["qa_raw"] > 0 and abs(sum(bar.values()) - 1000) < 0.05
    # The rendered bar really spans the panel, and the segments keep their proportions on screen.
    drawn = await browser.evaluate(
        "(() => { const r = s => document.querySelector(`#budget-bar rect[data-segment=${s}]`)"
        ".getBoundingClientRect().width; return [r('context'), r('output')]; })()"
    )
    assert (
        drawn[0] > 100 and abs(drawn[0] / drawn[1] - estimate["context"] / info["max_output_tokens"]) < 0.05
    )
    # What was summarised and kept, replayed ordinals, the stage timeline, usage per call.
    memory = await browser.evaluate("document.getElementById('memory').innerText")
    summarized = info["context_summary"]["summarized_messages"]
    kept = info["context_summary"]["kept_messages"]
    assert f"{summarized} older messages summarised, {kept} recent kept verbatim" in memory
    assert "1 groups verbatim, ordinals #1" in memory
    await browser.wait_for("document.querySelectorAll('#timeline-bar rect').length >= 3")
    phases = await browser.evaluate(
        "[...document.querySelectorAll('#timeline-bar rect')].map(r => r.dataset.phase)"
    )
    # In stage order; a phase shorter than the page's millisecond clock (a claim within the admission's
    # millisecond) has no width and is not drawn.
    order = ["queued", "preparing", "organizing_history", "compacting_context", "answering"]
    assert phases == [phase for phase in order if phase in phases] and "answering" in phases
    # A progress line sits under the stage it names, even when events of one batch share a moment.
    lines = await browser.evaluate(
        "[...document.querySelectorAll('#timeline tbody tr')].map(r => r.cells[0].innerText.trim())"
    )
    assert lines[0] == "queued"  # listed, however short it was
    where = {line: i for i, line in enumerate(lines)}
    replay = next(i for i, line in enumerate(lines) if line.startswith("↳ replaying"))
    cache = next(i for i, line in enumerate(lines) if line.startswith("↳ context summary cache"))
    assert where["organizing_history"] < replay < where["compacting_context"] < cache < where["answering"]
    calls = await browser.evaluate("document.querySelectorAll('#usage tbody tr').length")
    assert calls == len(record["usage"]["calls"])
    usage_text = await browser.evaluate("document.getElementById('usage').innerText")
    assert "9,000" in usage_text
    assert browser.console_errors == []


async def test_a_question_asked_from_the_page_streams_its_answer_into_the_page(
    stack: Stack, browser: Browser, tmp_path: Path
) -> None:
    parts = ["The rounding ", "helper lives ", "in billing/", "invoice.py, ", "line 42."]
    answer = "".join(parts)
    stack.model.script(
        "answer",
        Step.text(answer, chunks=len(parts), delay_before_s=0.3, delay_between_s=0.6, usage=Usage(50, 9)),
    )
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text(
        json.dumps(
            {
                "snapshot_id": "s-file",
                "system": "You are the main agent.",
                "messages": [{"role": "user", "content": "Fix the rounding bug in invoice totals."}],
            }
        ),
        encoding="utf-8",
    )
    await connect(browser, stack.url, "tok-acme")
    await browser.type_text("#open-parent", "p-live")
    await browser.evaluate("document.querySelector('#open-form button').click()")
    await browser.wait_for("!document.getElementById('session').hidden")
    await browser.type_text("#question", "Where is the rounding helper?")
    await browser.set_files("#snapshot-file", snapshot)
    await browser.evaluate("document.getElementById('ask').click()")
    # Part of the answer is on the page while the request is still running: it streams.
    partial = await browser.wait_for(
        "(() => { const t = document.getElementById('answer').textContent;"
        f" return t.length > 0 && t.length < {len(answer)} ? t : null; }})()"
    )
    assert answer.startswith(partial)
    request_id = await browser.evaluate("new URLSearchParams(location.hash.slice(1)).get('request')")
    async with stack.client("tok-acme") as client:
        running = (await client.get(f"/v1/questions/{request_id}")).json()
    assert running["status"] == "running" and running["snapshot_id"] == "s-file"
    await browser.wait_for(f"document.getElementById('answer').textContent === {json.dumps(answer)}")
    deltas = int(await browser.evaluate("document.getElementById('answer').dataset.deltas"))
    assert deltas >= 2
    await browser.wait_for("document.querySelector('#request-facts .status-succeeded') !== null")
    assert any("/events?token=" in u for u in browser.requests)  # EventSource with a stream token
    assert not any("/events" in u and "token=" not in u for u in browser.requests)
    # Every other call is a /v1 route with the bearer token: the page has no way around the API's auth.
    api_calls = [(u, h) for u, h in browser.request_headers if "/v1/" in u and "/events?token=" not in u]
    assert len(api_calls) >= 5
    assert all(h.get("authorization") == "Bearer tok-acme" for _u, h in api_calls), api_calls
    # The new session is in the list, and the history shows the request as succeeded.
    await browser.wait_for("!!document.querySelector('#session-list button[data-parent-id=\"p-live\"]')")
    await browser.wait_for("document.querySelector('#history .meta')?.textContent.startsWith('succeeded')")
    assert browser.console_errors == []


async def test_summary_coverage_starts_where_the_summary_does_after_a_clear(
    stack: Stack, browser: Browser, db: Database
) -> None:
    """Ordinals go on counting after a clear, so a rolling summary made since covers #26–#29, not #1–#29:
    the page reads the summary's first ordinal rather than assuming #1."""
    await _answered(stack, "p-cover", "First question?")
    qa = {"first_ordinal": 26, "covered_through_ordinal": 29, "tokens": 120, "updated_at": None}
    async with db.sessions() as tx:
        await tx.execute(
            update(SessionRow).where(SessionRow.parent_id == "p-cover").values(memory={"qa_summary": qa})
        )
        await tx.commit()
    await connect(browser, stack.url, "tok-acme")
    await open_session(browser, "p-cover")
    await browser.wait_for("document.getElementById('session-memory').innerText.includes('Rolling')")
    memory = await browser.evaluate("document.getElementById('session-memory').innerText")
    assert "Rolling Q&A summary covers #26–#29" in memory
    assert browser.console_errors == []


async def test_cancel_clear_after_confirmation_and_archive_download(
    stack: Stack, browser: Browser, tmp_path: Path
) -> None:
    stack.model.script("answer", Step.hang(text="Thinking about "))
    async with stack.client("tok-acme") as client:
        record = await ask(client, "p-actions", "Will this ever finish?")
    await connect(browser, stack.url, "tok-acme")
    await open_session(browser, "p-actions")
    await open_request(browser, record["id"])
    await browser.wait_for("document.getElementById('answer').textContent === 'Thinking about '")
    await browser.evaluate("document.getElementById('cancel').click()")
    cancelled = await stack.until_finished("tok-acme", record["id"])
    assert cancelled["status"] == "cancelled"
    await browser.wait_for("document.getElementById('answer-state').textContent === 'cancelled'")
    # The call the cancel stopped is recorded just after it: the page reads the record again and
    # shows it, rather than "No provider calls yet" and "model —" until it is reopened.
    await browser.wait_for("document.getElementById('usage').textContent.includes('cancelled')", within=10)
    # Archive: downloaded through the page, the same document the API exports.
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    await browser.allow_downloads(downloads)
    await browser.evaluate("document.getElementById('archive').click()")
    files = await asyncio.to_thread(_wait_for_download, downloads)
    archive = json.loads(files[0].read_text(encoding="utf-8"))
    assert files[0].name == "p-actions-archive-v3.json"
    assert archive["version"] == 3 and [q["ordinal"] for q in archive["questions"]] == [1]
    # Clear asks first; "Keep it" keeps everything.
    await browser.evaluate("document.getElementById('clear').click()")
    assert await browser.evaluate("document.getElementById('confirm-clear').open") is True
    await browser.evaluate("document.getElementById('confirm-no').click()")
    assert await browser.evaluate("document.getElementById('confirm-clear').open") is False
    async with stack.client("tok-acme") as client:
        assert (await client.get("/v1/sessions/p-actions")).json()["clear_version"] == 0
    await browser.evaluate("document.getElementById('clear').click()")
    await browser.evaluate("document.getElementById('confirm-yes').click()")
    await browser.wait_for("!document.getElementById('history-empty').hidden")
    async with stack.client("tok-acme") as client:
        overview = (await client.get("/v1/sessions/p-actions")).json()
        history = (await client.get("/v1/sessions/p-actions/questions")).json()
    assert overview["clear_version"] == 1 and history["items"] == []
    assert browser.console_errors == []


async def test_what_changed_elsewhere_shows_on_refresh_and_forget_leaves_no_draft(
    stack: Stack, browser: Browser, tmp_path: Path
) -> None:
    """Refresh shows what changed elsewhere: a clear's deleted requests go, and the session list's
    counts move (not "1 in progress" forever). Forget empties the Ask form, so the next tenant's
    question cannot take the last tenant's draft question or snapshot file along."""
    async with stack.client("tok-acme") as client:
        first = await ask(client, "p-elsewhere", "Before the clear?")
    await stack.until_finished("tok-acme", first["id"])
    await connect(browser, stack.url, "tok-acme")
    await open_session(browser, "p-elsewhere")
    await browser.wait_for("document.querySelectorAll('#history button').length === 1")
    async with stack.client("tok-acme") as client:
        assert (await client.delete("/v1/sessions/p-elsewhere/questions")).status_code == 200
        second = await ask(client, "p-elsewhere", "After the clear?")
    await stack.until_finished("tok-acme", second["id"])
    await browser.evaluate("document.getElementById('refresh').click()")
    await browser.wait_for(
        "(() => { const b = [...document.querySelectorAll('#history button .q')];"
        " return b.length === 1 && b[0].textContent === '#2 After the clear?'; })()"
    )
    # The list entry says what the session holds now: one question, none in progress.
    entry = json.dumps('#session-list button[data-parent-id="p-elsewhere"] .meta')
    await browser.wait_for(f"document.querySelector({entry}).textContent.startsWith('1 question · ')")
    assert "in progress" not in await browser.evaluate(f"document.querySelector({entry}).textContent")

    # A draft and a chosen snapshot file do not outlive Forget.
    snapshot = tmp_path / "acme-snapshot.json"
    snapshot.write_text(
        json.dumps({"messages": [{"role": "user", "content": "acme only"}]}), encoding="utf-8"
    )
    await browser.evaluate("document.getElementById('question').value = 'acme draft'")
    await browser.set_files("#snapshot-file", snapshot)
    assert await browser.evaluate("document.getElementById('snapshot-file').files.length") == 1
    await browser.evaluate("document.getElementById('forget').click()")
    assert await browser.evaluate("document.getElementById('question').value") == ""
    assert await browser.evaluate("document.getElementById('snapshot-file').files.length") == 0


async def test_a_request_that_ended_before_the_page_opened_it_leaves_the_list_current(
    stack: Stack, browser: Browser
) -> None:
    """The list loaded while a request ran drops its "1 in progress" once it ends, also when the page
    opens that request only after its end (its stream then only replays, so no live event says so)."""
    stack.model.script("answer", Step.text("late but done").with_delay(before_s=1.5))
    async with stack.client("tok-acme") as client:
        record = await ask(client, "p-ended", "Still running when the page lists it?")
    await connect(browser, stack.url, "tok-acme")
    entry = json.dumps('#session-list button[data-parent-id="p-ended"] .meta')
    await browser.wait_for(f"document.querySelector({entry}).textContent.includes('1 in progress')")
    await stack.until_finished("tok-acme", record["id"])
    await open_session(browser, "p-ended")
    await browser.evaluate("document.querySelector('#history button').click()")
    await browser.wait_for("document.querySelector('#request-facts .status-succeeded') !== null")
    await browser.wait_for(f"!document.querySelector({entry}).textContent.includes('in progress')")


async def test_the_budget_follows_a_running_request_and_a_narrow_screen_shows_the_opened_session(
    stack: Stack, browser: Browser
) -> None:
    """Opened before it is compacted, a request's budget follows it, not stuck at the pre-compaction
    one ("over budget", "sent verbatim") all through answering; at 390 px, tapping a session scrolls
    to it, since it opens below the whole list."""
    stack.model.script("answer", Step.hang(text="Still answering "))
    # The compaction's summary takes a while, so the page opens the request before it is compacted.
    stack.model.script("context_summary", Step.valid_summary().with_delay(before_s=3))
    async with stack.client("tok-acme") as client:
        record = await ask(client, "p-live-budget", "Which module parses batch 3?", snapshot=big_snapshot())
    await connect(browser, stack.url, "tok-acme")
    await open_session(browser, "p-live-budget")
    await open_request(browser, record["id"])
    assert "older messages summarised" not in await browser.evaluate(
        "document.getElementById('memory').innerText"
    )
    await browser.wait_for("document.getElementById('answer').textContent === 'Still answering '")
    await browser.wait_for(
        "document.getElementById('memory').innerText.includes('older messages summarised')", within=10
    )
    async with stack.client("tok-acme") as client:
        assert (await client.post(f"/v1/questions/{record['id']}/cancel")).status_code == 200

    async with stack.client("tok-acme") as client:  # a list long enough to push the panel off screen
        for n in range(19):
            assert (await client.put(f"/v1/sessions/p-filler-{n}/settings", json={})).status_code == 200
    await browser.viewport(390, 844)
    await browser.goto(f"{stack.url}/")
    await browser.wait_for("document.querySelectorAll('#session-list button').length > 0")
    selector = json.dumps('#session-list button[data-parent-id="p-live-budget"]')
    await browser.evaluate(f"document.querySelector({selector}).click()")
    await browser.wait_for("window.scrollY > 500")  # the panel is below the whole list
    # In view (below the page's sticky header), not ~1500 px down below the list.
    await browser.wait_for(
        "(() => { const t = document.getElementById('session').getBoundingClientRect().top;"
        " return t >= 0 && t < window.innerHeight / 2; })()"
    )


async def test_screenshots_at_phone_and_desktop_sizes_without_horizontal_scrolling(
    stack: Stack, browser: Browser
) -> None:
    stack.model.set_default(
        "answer",
        Step.text(
            "module_3.py parses invoice batch 3; the rounding is in invoice.py.", usage=Usage(9000, 20)
        ),
    )
    # Mostly file reads, as real agent sessions are, so the picture (docs/inspector.png is the
    # 1280×720 one) shows every part of the fidelity bar: summarised, masked and verbatim messages.
    reads = tool_heavy_snapshot("s-reads", groups=120, context_window=16000, max_output_tokens=1024)
    await _answered(stack, "task-billing", "What does module_1 do?", snapshot=reads)
    await _answered(stack, "task-billing", "Where is rounding handled?", snapshot_id="s-reads")
    record = await _answered(stack, "task-billing", "Which module parses batch 3?", snapshot_id="s-reads")
    fidelity = record["context_info"]["fidelity"]
    assert min(fidelity[f"{part}_messages"] for part in ("summarized", "masked", "verbatim")) > 0
    await _answered(stack, "task-docs", "Is the README current?")
    shots = artifacts_dir()
    for width, height in ((1280, 720), (390, 844)):
        await browser.viewport(width, height)
        await connect(browser, stack.url, "tok-acme")
        await open_session(browser, "task-billing")
        await open_request(browser, record["id"])
        await browser.wait_for("document.querySelectorAll('#timeline-bar rect').length >= 3")
        await browser.wait_for("!!document.querySelector('#budget-bar rect')")
        await browser.wait_for("!!document.querySelector('#fidelity-bar rect')")
        # Every replayed event drawn (the timeline ends with the outcome): a shot taken while the
        # stream still replays measures the page before its last rows and cuts off its bottom.
        await browser.wait_for("document.getElementById('timeline').innerText.includes('succeeded')")
        await browser.evaluate("window.scrollTo(0, 0)")
        assert await no_horizontal_scroll(browser), f"horizontal scrolling at {width}×{height}"
        assert await browser.evaluate("window.innerWidth") == width
        path = shots / f"inspector-{width}x{height}.png"
        await browser.screenshot(path)
        assert path.stat().st_size > 10_000
        await browser.screenshot(shots / f"inspector-{width}x{height}-viewport.png", full_page=False)
    assert browser.console_errors == []
