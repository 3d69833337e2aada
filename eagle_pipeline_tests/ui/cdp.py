"""A minimal Chrome DevTools Protocol driver for the UI tests: headless chromium, one page, bounded waits.

The chromium command line (`--screenshot --dump-dom`) can only load a page; a dialog that opens on a click needs a
driver. This one starts `chromium --headless --remote-debugging-port=0` with its own profile, reads the port that
chromium chose from `DevToolsActivePort` in that profile, takes the page target's websocket from /json/list and talks
to it with aiohttp. Every wait has a timeout, and chromium (its whole process group) is killed on the way out.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

START_TIMEOUT_S = 30
COMMAND_TIMEOUT_S = 30
POLL_S = 0.25


class CDPError(AssertionError):
    pass


class Tab:
    """One page target. Commands are sent one at a time; events arriving in between are ignored."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._next_id = 0

    async def send(self, method: str, params: dict | None = None, *, timeout: float = COMMAND_TIMEOUT_S) -> dict:
        self._next_id += 1
        msg_id = self._next_id
        await self._ws.send_json({"id": msg_id, "method": method, "params": params or {}})

        async def reply() -> dict:
            while True:
                msg = await self._ws.receive()
                if msg.type != aiohttp.WSMsgType.TEXT:
                    raise CDPError(f"DevTools websocket closed during {method}: {msg.type}")
                data = json.loads(msg.data)
                if data.get("id") == msg_id:
                    if "error" in data:
                        raise CDPError(f"{method}: {data['error']}")
                    return data["result"]

        try:
            return await asyncio.wait_for(reply(), timeout)
        except TimeoutError:
            raise CDPError(f"no answer to {method} within {timeout}s") from None

    async def evaluate(self, expression: str):
        result = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise CDPError(f"JavaScript error in {expression[:200]!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, *, timeout: float, what: str):
        """Polls a JavaScript expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                text = await self.evaluate("document.body ? document.body.innerText.slice(0, 2000) : ''")
                raise CDPError(f"timed out after {timeout}s waiting for {what}; page text:\n{text}")
            await asyncio.sleep(POLL_S)

    async def navigate(self, url: str) -> None:
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise CDPError(f"navigating to {url}: {result['errorText']}")

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", {"format": "png"})
        path.write_bytes(base64.b64decode(shot["data"]))

    async def dom(self) -> str:
        return await self.evaluate("document.documentElement.outerHTML")


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # chromium's own session: only the processes started here
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


async def _devtools_port(profile: Path, proc: subprocess.Popen, log: Path) -> int:
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if port_file.exists():
            lines = port_file.read_text().split()
            if lines and lines[0].isdigit():
                return int(lines[0])
        if proc.poll() is not None:
            raise CDPError(f"chromium exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            raise CDPError(f"no DevToolsActivePort after {START_TIMEOUT_S}s:\n{tail}")
        await asyncio.sleep(0.1)


@asynccontextmanager
async def chromium_tab(chromium: str, profile: Path, width: int, height: int) -> AsyncIterator[Tab]:
    """Headless chromium with a `width` x `height` viewport at scale 1; yields its first page."""
    profile.mkdir(parents=True, exist_ok=True)
    log = profile.parent / f"{profile.name}.log"
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--no-proxy-server",
        "--hide-scrollbars",
        "--remote-debugging-port=0",
        "--remote-debugging-address=127.0.0.1",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        "about:blank",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        port = await _devtools_port(profile, proc, log)
        async with aiohttp.ClientSession(trust_env=False) as session:
            list_timeout = aiohttp.ClientTimeout(total=COMMAND_TIMEOUT_S)
            async with session.get(f"http://127.0.0.1:{port}/json/list", timeout=list_timeout) as response:
                targets = await response.json(content_type=None)
            pages = [t for t in targets if t.get("type") == "page" and t.get("webSocketDebuggerUrl")]
            if not pages:
                raise CDPError(f"no page target in /json/list: {targets}")
            async with session.ws_connect(
                pages[0]["webSocketDebuggerUrl"], max_msg_size=0, timeout=aiohttp.ClientWSTimeout(ws_close=5)
            ) as ws:
                tab = Tab(ws)
                await tab.send(
                    "Emulation.setDeviceMetricsOverride",
                    {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
                )
                yield tab
    finally:
        _kill(proc)
