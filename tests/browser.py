"""Headless Chromium for tests: open a page, evaluate JavaScript on it, collect console errors, screenshot.

Debian's ``chromium`` is started with a fresh profile and ``--remote-debugging-port=0``; the port it
picked is read from ``<profile>/DevToolsActivePort`` and the page is driven over the DevTools
protocol (``websocket-client``): ``Page.navigate`` → wait for ``Page.loadEventFired`` →
``Runtime.evaluate`` → ``Page.captureScreenshot``. Console errors are every ``Runtime.consoleAPICalled``
of type error/assert, every ``Runtime.exceptionThrown`` and every ``Log.entryAdded`` of level error
(a failed image load lands there). The browser and its profile are gone when the context exits.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator
from contextlib import contextmanager

#: The line a developer runs when the browser is missing (tests print it when they skip).
INSTALL_LINE = "apt-get update && apt-get install -y chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
)


def find() -> str | None:
    """The Chromium executable on PATH, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One DevTools session on one page target."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._id = 0
        self.errors: list[str] = []
        self.loaded = False

    def _event(self, msg: dict) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(
                "console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            )
        elif method == "Runtime.exceptionThrown":
            d = params.get("exceptionDetails", {})
            self.errors.append(f"exception: {d.get('text')} {d.get('exception', {}).get('description', '')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            e = params["entry"]
            self.errors.append(f"log: {e.get('text')} {e.get('url', '')}")
        elif method == "Page.loadEventFired":
            self.loaded = True

    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict:
        """Send one command and return its result (events seen meanwhile are recorded).

        Raises:
            RuntimeError: the browser answered with an error.
            TimeoutError: no answer within ``timeout`` seconds.
        """
        self._id += 1
        my = self._id
        self.ws.send(json.dumps({"id": my, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            msg = json.loads(self.ws.recv())
            if msg.get("id") == my:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)
        raise TimeoutError(f"{method}: no answer in {timeout:.0f} s")

    def wait_load(self, timeout: float = 30.0) -> None:
        """Wait for the page's load event (images decoded or failed)."""
        import websocket

        deadline = time.monotonic() + timeout
        while not self.loaded:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"page did not load in {timeout:.0f} s")
            self.ws.settimeout(left)
            try:
                self._event(json.loads(self.ws.recv()))
            except websocket.WebSocketTimeoutException:
                continue

    def open(self, url: str, timeout: float = 30.0) -> None:
        """Navigate to ``url`` and wait until it has loaded."""
        self.loaded = False
        self.call("Page.navigate", url=url)
        self.wait_load(timeout)

    def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` on the page.

        Raises:
            RuntimeError: the expression threw.
        """
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"evaluate failed: {res['exceptionDetails']}")
        return res.get("result", {}).get("value")

    def screenshot(self, path: Path, width: int = 1300) -> Path:
        """A PNG of the whole page (not only the viewport) at ``width`` CSS pixels."""
        height = int(self.evaluate("document.documentElement.scrollHeight") or 800)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=min(height, 16000),
            deviceScaleFactor=1,
            mobile=False,
        )
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path


@contextmanager
def chromium(timeout: float = 60.0) -> Iterator[Page]:
    """Start headless Chromium with a fresh profile and yield a :class:`Page` on its first tab.

    Raises:
        FileNotFoundError: no chromium on PATH.
        TimeoutError: it did not open its DevTools port within ``timeout`` seconds.
    """
    import requests
    import websocket

    exe = find()
    if exe is None:
        raise FileNotFoundError(f"chromium not found; install it: {INSTALL_LINE}")
    profile = Path(tempfile.mkdtemp(prefix="chromium-"))
    log = open(profile.parent / f"{profile.name}.log", "wb")
    # Own session: the browser's zygote and renderers are killed with it, nothing else.
    proc = subprocess.Popen(
        [exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    ws = None
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited {proc.returncode} at start; see {log.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"chromium opened no DevTools port in {timeout:.0f} s")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = requests.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page_target = next(t for t in targets if t.get("type") == "page")
        ws = websocket.create_connection(page_target["webSocketDebuggerUrl"], timeout=timeout, suppress_origin=True)
        page = Page(ws)
        for domain in ("Page", "Runtime", "Log"):
            page.call(f"{domain}.enable")
        yield page
    finally:
        if ws is not None:
            ws.close()
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
        shutil.rmtree(profile, ignore_errors=True)
        Path(log.name).unlink(missing_ok=True)
