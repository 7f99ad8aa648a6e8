"""The inspector shows what of the snapshot reached the model (``context_info.fidelity``, SPEC §6.10,
§12) in real headless chromium, against a real service: the tier, one stacked bar of summarised /
masked / verbatim messages with a legend, and the artifacts in the prompt of all."""

from __future__ import annotations

import json
from typing import Any

from tests.api.cdp import Browser
from tests.api.helpers import ask
from tests.api.inspector_support import (
    Stack,
    artifacts_dir,
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

PARTS = ("summarized", "masked", "verbatim")


async def _answered(stack: Stack, parent: str, question: str, **body: Any) -> dict[str, Any]:
    async with stack.client("tok-acme") as client:
        record = await ask(client, parent, question, **body)
    finished = await stack.until_finished("tok-acme", record["id"])
    assert finished["status"] == "succeeded", finished
    return finished


def _kilobytes(n: int) -> str:
    return f"{n / 1000:.1f} KB" if n / 1000 < 9.95 else f"{n / 1000:.0f} KB"


async def test_fidelity_bar_shows_summarised_masked_and_verbatim_messages_and_the_artifacts(
    stack: Stack, browser: Browser
) -> None:
    stack.model.set_default("answer", Step.text("It read module_118.py last.", usage=Usage(12000, 9)))
    # 120 file reads (~800 bytes each) in a 16000-token window: masking alone cannot make it fit, so
    # the oldest groups are summarised, the next masked, and the newest kept verbatim (SPEC §6.2).
    snapshot = tool_heavy_snapshot("s-reads", groups=120, context_window=16000, max_output_tokens=1024)
    record = await _answered(stack, "p-fidelity", "Which file did it read last?", snapshot=snapshot)
    fidelity = record["context_info"]["fidelity"]
    assert fidelity["tier"] == "summary"
    counts = {part: fidelity[f"{part}_messages"] for part in PARTS}
    assert all(n > 0 for n in counts.values()), counts
    assert sum(counts.values()) == len(snapshot["messages"])
    artifacts = fidelity["artifacts"]
    assert artifacts["total"] == 120 and 0 < artifacts["in_prompt"] <= 120
    # A request without a snapshot: no bar, and the page says why.
    bare = await _answered(stack, "p-fidelity", "Anything else?")
    assert bare["context_info"]["fidelity"] is None

    await connect(browser, stack.url, "tok-acme")
    await open_session(browser, "p-fidelity")
    await open_request(browser, record["id"])
    await browser.wait_for("!!document.querySelector('#fidelity-bar rect[data-part]')")
    assert await browser.evaluate("document.getElementById('fidelity').dataset.tier") == "summary"
    tier = await browser.evaluate("document.getElementById('fidelity-tier').innerText")
    assert tier.startswith("tier summary") and "summary" in tier
    # One bar, oldest first, each segment's width proportional to its messages.
    segments = await browser.evaluate(
        "[...document.querySelectorAll('#fidelity-bar rect')]"
        ".map(r => [r.dataset.part, +r.dataset.messages, parseFloat(r.getAttribute('width'))])"
    )
    assert [part for part, _n, _w in segments] == list(PARTS)
    total = sum(counts.values())
    for part, messages, width in segments:
        assert messages == counts[part]
        assert abs(width - 1000 * messages / total) < 0.01, (part, width)
    assert await browser.evaluate("document.querySelectorAll('svg#fidelity-bar').length") == 1
    # The same in words: the legend and the bar's accessible name (nothing depends on the colours).
    elided = f"({_kilobytes(fidelity['masked_payload_bytes'])} of tool output elided)"
    legend = await browser.evaluate(
        "[...document.querySelectorAll('#fidelity-legend li')].map(li => li.innerText.trim())"
    )
    assert legend == [
        f"summarised {counts['summarized']:,}",
        f"masked {counts['masked']:,} {elided}",
        f"verbatim {counts['verbatim']:,}",
    ]
    label = await browser.evaluate("document.getElementById('fidelity-bar').getAttribute('aria-label')")
    assert label == (
        f"{total:,} snapshot messages: {counts['summarized']:,} summarised,"
        f" {counts['masked']:,} masked {elided}, {counts['verbatim']:,} verbatim"
    )
    assert await browser.evaluate("document.getElementById('fidelity-bar').getAttribute('role')") == "img"
    shown = await browser.evaluate("document.getElementById('fidelity-artifacts').innerText")
    assert shown == f"artifacts in the prompt: {artifacts['in_prompt']:,} of {artifacts['total']:,}"
    # Kept messages are not all called verbatim when some were masked.
    memory = await browser.evaluate("document.getElementById('memory').innerText")
    assert f"({counts['masked']} with their tool output masked)" in memory
    assert "recent kept verbatim" not in memory
    # Fidelity replaces the context summary's two-part strip: one bar of the snapshot, not two.
    assert await browser.evaluate("document.getElementById('messages-bar')") is None
    assert await no_horizontal_scroll(browser)
    # The whole stream replayed (the timeline is complete), so the page's height holds still for the shot.
    await browser.wait_for("document.getElementById('timeline').innerText.includes('succeeded')")
    timeline = await browser.evaluate("document.getElementById('timeline').innerText")
    payload = _kilobytes(fidelity["masked_payload_bytes"])
    assert f"masked the tool output of {counts['masked']} older messages ({payload} elided)" in timeline
    await browser.screenshot(artifacts_dir() / "inspector-fidelity-1280x720.png")

    selector = json.dumps(f'#history button[data-request-id="{bare["id"]}"]')
    await browser.evaluate(f"document.querySelector({selector}).click()")
    await browser.wait_for("!!document.getElementById('fidelity-none')")
    assert await browser.evaluate("document.getElementById('fidelity')") is None
    assert await browser.evaluate("document.getElementById('fidelity-none').innerText") == (
        "Snapshot fidelity: no snapshot."
    )
    # The phone width: the bar, its legend and the artifacts line fit without scrolling sideways.
    await open_request(browser, record["id"])
    await browser.wait_for("!!document.querySelector('#fidelity-bar rect')")
    await browser.viewport(390, 844)
    assert await no_horizontal_scroll(browser), "horizontal scrolling at 390×844"
    await browser.screenshot(artifacts_dir() / "inspector-fidelity-390x844.png")
    assert browser.console_errors == []
