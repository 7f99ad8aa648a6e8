"""The inspector's pin and hand-off actions (SPEC §11.1, §12) in real headless chromium.

These need the pin and hand-off routes (``POST/DELETE /v1/questions/{id}/pin``,
``POST/GET /v1/sessions/{parent_id}/handoffs``) and the session's ``handed_off_through``.
"""

from __future__ import annotations

import json

from service.budget.handoff import ordinal_runs
from tests.api.cdp import Browser
from tests.api.helpers import ask
from tests.api.inspector_support import Stack, browser, connect, open_request, open_session, stack
from tests.scripted_provider import Step, Usage

__all__ = ["browser", "stack"]  # fixtures


async def _two_answers(stack: Stack, parent: str) -> list[dict[str, object]]:
    stack.model.set_default(
        "answer", Step.text("The totals are rounded in billing/invoice.py.", usage=Usage(40, 9))
    )
    records = []
    async with stack.client("tok-acme") as client:
        for question in ("Where are totals rounded?", "Which test covers it?"):
            record = await ask(client, parent, question)
            finished = await stack.until_finished("tok-acme", record["id"])
            assert finished["status"] == "succeeded", finished
            records.append(finished)
    return records


async def test_pin_and_unpin_from_the_page(stack: Stack, browser: Browser) -> None:
    first, _second = await _two_answers(stack, "p-pin")
    await connect(browser, stack.url, "tok-acme")
    await open_session(browser, "p-pin")
    await open_request(browser, str(first["id"]))
    await browser.wait_for("!document.getElementById('pin').disabled")
    assert await browser.evaluate("document.getElementById('pin').getAttribute('aria-pressed')") == "false"
    await browser.evaluate("document.getElementById('pin').click()")
    await browser.wait_for("document.getElementById('pin').getAttribute('aria-pressed') === 'true'")
    async with stack.client("tok-acme") as client:
        assert (await client.get(f"/v1/questions/{first['id']}")).json()["pinned"] is True
    entry = json.dumps(f'#history button[data-request-id="{first["id"]}"] .meta')
    await browser.wait_for(f"document.querySelector({entry})?.textContent.includes('pinned')")
    await browser.evaluate("document.getElementById('pin').click()")
    await browser.wait_for("document.getElementById('pin').getAttribute('aria-pressed') === 'false'")
    async with stack.client("tok-acme") as client:
        assert (await client.get(f"/v1/questions/{first['id']}")).json()["pinned"] is False
    assert browser.console_errors == []


async def test_hand_off_shows_the_block_and_moves_handed_off_through(stack: Stack, browser: Browser) -> None:
    first, second = await _two_answers(stack, "p-handoff")
    await connect(browser, stack.url, "tok-acme")
    await open_session(browser, "p-handoff")
    await browser.evaluate("document.getElementById('handoff').click()")
    await browser.wait_for("!document.getElementById('handoff-result').hidden")
    block = await browser.evaluate("document.getElementById('handoff-text').textContent")
    assert str(first["question"]) in block and str(second["question"]) in block
    meta = await browser.evaluate("document.getElementById('handoff-meta').textContent")
    assert meta.startswith("ordinals #1, #2")
    await browser.wait_for("document.getElementById('session-overview').textContent.includes('#2')")
    overview = await browser.evaluate("document.getElementById('session-overview').innerText")
    assert "handed off through" in overview
    async with stack.client("tok-acme") as client:
        session = (await client.get("/v1/sessions/p-handoff")).json()
        listed = (await client.get("/v1/sessions/p-handoff/handoffs")).json()
    assert session["handed_off_through"] == 2
    items = listed["items"] if isinstance(listed, dict) else listed
    assert len(items) == 1 and items[0]["ordinals"] == [1, 2]
    # Nothing new since: the page says so (the API answers 200 with no ordinals, records nothing).
    await browser.evaluate("document.getElementById('handoff').click()")
    await browser.wait_for(
        "document.getElementById('handoff-meta').textContent === 'nothing new to hand off'"
    )
    # A pinned older answer goes into the next hand-off; the block is shown as the message for
    # the anthropic format.
    await open_request(browser, str(first["id"]))
    await browser.wait_for("!document.getElementById('pin').disabled")
    await browser.evaluate("document.getElementById('pin').click()")
    await browser.wait_for("document.getElementById('pin').getAttribute('aria-pressed') === 'true'")
    await browser.evaluate("document.getElementById('handoff-format').value = 'anthropic'")
    await browser.evaluate("document.getElementById('handoff').click()")
    await browser.wait_for("document.getElementById('handoff-meta').textContent.startsWith('ordinals #1')")
    message = json.loads(await browser.evaluate("document.getElementById('handoff-text').textContent"))
    assert message["role"] == "user" and str(first["question"]) in json.dumps(message)
    # The hand-off unpinned what it carried, and the open request shows it.
    await browser.wait_for("document.getElementById('pin').getAttribute('aria-pressed') === 'false'")
    assert browser.console_errors == []


async def test_the_page_says_which_answers_were_left_out_to_fit(stack: Stack, browser: Browser) -> None:
    stack.model.set_default("answer", Step.text("The parser details: " + "token stream, " * 300))
    async with stack.client("tok-acme") as client:
        for i in range(1, 7):
            record = await ask(client, "p-long-handoff", f"What about parser part {i}?")
            finished = await stack.until_finished("tok-acme", record["id"])
            assert finished["status"] == "succeeded", finished
    await connect(browser, stack.url, "tok-acme")
    await open_session(browser, "p-long-handoff")
    await browser.evaluate("document.getElementById('handoff').click()")
    await browser.wait_for("!document.getElementById('handoff-result').hidden")
    meta = await browser.evaluate("document.getElementById('handoff-meta').textContent")
    async with stack.client("tok-acme") as client:
        (made,) = (await client.get("/v1/sessions/p-long-handoff/handoffs")).json()["items"]
    omitted = made["omitted_ordinals"]
    assert omitted, made  # six long answers do not fit 2000 tokens, even shortened
    assert f"left out to fit: {ordinal_runs(omitted)}" in meta, meta  # as the block writes them
    assert browser.console_errors == []
