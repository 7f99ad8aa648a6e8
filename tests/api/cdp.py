"""A small Chrome DevTools Protocol client for headless chromium, over ``--remote-debugging-pipe``.

No websocket library is needed: with ``--remote-debugging-pipe`` chromium reads CDP commands from
file descriptor 3 and writes replies and events to descriptor 4, each message a JSON object ended
by a NUL byte. One page target is attached in flat mode; the test drives it with ``evaluate``,
``wait_for`` and ``screenshot``, and reads what the page did from the collected ``console_errors``
and ``requests``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-features=Translate,MediaRouter,OptimizationHints",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-pipe",
)


class CdpError(Exception):
    """A CDP command failed, or the page threw while evaluating."""


class Browser:
    """One chromium process and one attached page."""

    def __init__(self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader, write_fd: int) -> None:
        self.proc = proc
        self._reader = reader
        self._write_fd = write_fd
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._session: str | None = None
        self.console_errors: list[str] = []
        self.console: list[str] = []
        self.requests: list[str] = []
        self.request_headers: list[tuple[str, dict[str, str]]] = []
        self.events: list[dict[str, Any]] = []
        self._pump = asyncio.create_task(self._read_loop())

    async def _read_loop(self) -> None:
        buffer = b""
        while True:
            chunk = await self._reader.read(1 << 16)
            if not chunk:
                for future in self._pending.values():
                    if not future.done():
                        future.set_exception(CdpError("chromium closed the pipe"))
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                self._dispatch(json.loads(raw))

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "id" in message:
            future = self._pending.pop(message["id"], None)
            if future is not None and not future.done():
                if "error" in message:
                    future.set_exception(CdpError(json.dumps(message["error"])))
                else:
                    future.set_result(message.get("result", {}))
            return
        method = message.get("method", "")
        params = message.get("params", {})
        self.events.append(message)
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append(f"{params.get('type')}: {text}")
            if params.get("type") in ("error", "assert"):
                self.console_errors.append(text)
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exception = details.get("exception", {})
            self.console_errors.append(str(exception.get("description") or details.get("text")))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            if entry.get("level") == "error":
                self.console_errors.append(
                    f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}"
                )
        elif method == "Network.requestWillBeSent":
            request = params.get("request", {})
            self.requests.append(request.get("url", ""))
            headers = {k.lower(): v for k, v in (request.get("headers") or {}).items()}
            self.request_headers.append((request.get("url", ""), headers))

    async def send(self, method: str, params: dict[str, Any] | None = None, *, page: bool = True) -> Any:
        """Send one command (to the attached page unless ``page=False``) and await its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if page and self._session is not None:
            message["sessionId"] = self._session
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        os.write(self._write_fd, json.dumps(message).encode() + b"\0")
        async with asyncio.timeout(30):
            return await future

    async def attach(self) -> None:
        """Open a fresh page and route further commands to it; collect console, errors, requests."""
        target = await self.send("Target.createTarget", {"url": "about:blank"}, page=False)
        attached = await self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, page=False
        )
        self._session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            await self.send(f"{domain}.enable")

    async def viewport(self, width: int, height: int) -> None:
        """Emulate a screen of ``width`` × ``height`` CSS pixels (a phone when narrow)."""
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600},
        )

    async def goto(self, url: str) -> None:
        """Navigate and wait for the document to be complete."""
        await self.send("Page.navigate", {"url": url})
        await self.wait_for("document.readyState === 'complete'")

    async def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (promises are awaited)."""
        result = await self.send(
            "Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True}
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CdpError(str(details.get("exception", {}).get("description") or details.get("text")))
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, within: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy; its value. Fails with the page's notice text."""
        try:
            async with asyncio.timeout(within):
                while True:
                    value = await self.evaluate(expression)
                    if value:
                        return value
                    await asyncio.sleep(0.1)
        except TimeoutError:
            notice = await self.evaluate("(document.getElementById('notice') || {}).textContent")
            raise AssertionError(
                f"timed out waiting for {expression!r}; notice: {notice!r}; errors: {self.console_errors}"
            ) from None

    async def type_text(self, selector: str, text: str) -> None:
        """Focus the element and type ``text`` into it as keyboard input would."""
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.send("Input.insertText", {"text": text})

    async def press(self, key: str, code: int) -> None:
        """Press and release one key (e.g. ``"Enter", 13``) on the focused element."""
        for kind in ("keyDown", "keyUp"):
            await self.send(
                "Input.dispatchKeyEvent",
                {"type": kind, "key": key, "code": key, "windowsVirtualKeyCode": code, "text": "\r"}
                if kind == "keyDown" and key == "Enter"
                else {"type": kind, "key": key, "code": key, "windowsVirtualKeyCode": code},
            )

    async def set_files(self, selector: str, *paths: Path) -> None:
        """Choose files in an ``<input type=file>`` (what the file picker would do)."""
        document = await self.send("DOM.getDocument", {"depth": 0})
        node = await self.send(
            "DOM.querySelector", {"nodeId": document["root"]["nodeId"], "selector": selector}
        )
        await self.send("DOM.setFileInputFiles", {"nodeId": node["nodeId"], "files": [str(p) for p in paths]})

    async def allow_downloads(self, directory: Path) -> None:
        """Save downloads into ``directory`` instead of asking."""
        await self.send(
            "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(directory)}, page=False
        )

    async def screenshot(self, path: Path, *, full_page: bool = True) -> None:
        """A PNG of the whole page (beyond the viewport when it scrolls), or of what the viewport
        shows, at ``path``."""
        metrics = await self.send("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        if not full_page:
            view = metrics.get("cssLayoutViewport") or metrics["layoutViewport"]
            size = {"width": view["clientWidth"], "height": view["clientHeight"]}
        shot = await self.send(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
            },
        )
        data = base64.b64decode(shot["data"])

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

        await asyncio.to_thread(write)


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    """Start headless chromium with a throwaway profile and one attached page; kill it on exit."""
    binary = shutil.which("chromium")
    assert binary is not None, "apt-get install -y chromium"
    profile = tempfile.mkdtemp(prefix="sidequest-cdp-")
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()

    def onto_3_and_4() -> None:
        # In the child, before exec: chromium reads commands on fd 3 and writes on fd 4. Move both
        # ends out of the way first so neither dup2 overwrites the other; dup2 makes them inheritable
        # (close_fds=False below keeps them: Python's own descriptors are non-inheritable anyway).
        reading = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
        writing = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
        os.dup2(reading, 3)
        os.dup2(writing, 4)

    proc = await asyncio.create_subprocess_exec(
        binary,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        "about:blank",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=False,
        preexec_fn=onto_3_and_4,
    )
    os.close(to_browser_r)
    os.close(from_browser_w)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(from_browser_r, "rb", buffering=0)
    )
    browser = Browser(proc, reader, to_browser_w)
    try:
        await browser.attach()
        yield browser
    finally:
        browser._pump.cancel()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.wait_for(proc.wait(), 10)
        transport.close()
        os.close(to_browser_w)
        shutil.rmtree(profile, ignore_errors=True)
