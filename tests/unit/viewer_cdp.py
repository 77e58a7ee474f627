"""A minimal headless-Chromium driver over the DevTools protocol (one page, one websocket).

Chromium is Debian's package (``scripts/setup_viewer.sh``); the protocol is spoken with the
``websockets`` package's synchronous client. Only what the viewer's browser tests need: navigate,
evaluate JavaScript, wait for a condition, take a screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx


def find_chromium() -> str | None:
    """Path of a Chromium binary (``RELAX_CHROMIUM`` or ``chromium`` / ``chromium-browser`` on PATH), or None."""
    env = os.environ.get("RELAX_CHROMIUM")
    if env:
        return shutil.which(env)
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """Headless Chromium with one page at ``width`` x ``height`` CSS pixels.

    Raises RuntimeError when Chromium does not announce its DevTools endpoint within ``start_timeout_s``.
    """

    def __init__(self, binary: str, width: int = 1280, height: int = 900, start_timeout_s: float = 60.0):
        from websockets.sync.client import connect

        self.profile = tempfile.mkdtemp(prefix="relax-viewer-chromium-")
        self.log = Path(self.profile) / "stderr.log"
        with self.log.open("w") as stderr:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
                 f"--window-size={width},{height}", "about:blank"],
                stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + start_timeout_s
        port = None
        while port is None:
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", self.log.read_text(errors="replace"))
            if m:
                port = int(m.group(1))
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not start: {self.log.read_text(errors='replace')[-2000:]}")
            else:
                time.sleep(0.1)
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        # entered as a context manager (websockets >= 17.1 warns on a connection used without one);
        # close() exits it
        self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30).__enter__()
        self._id = 0
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        """Send one protocol command and return its result (events in between are dropped)."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression: str) -> Any:
        """Value of a JavaScript expression in the page (promises awaited). Raises RuntimeError on a JS exception."""
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait(self, expression: str, timeout_s: float = 20.0) -> Any:
        """Poll ``expression`` until it is truthy; returns its value. Raises AssertionError on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {expression}")
            time.sleep(0.05)

    def open(self, url: str) -> None:
        """Load ``url`` afresh (also when only its fragment differs from the current page's) and wait
        until the viewer has rendered it (``#app`` ready or error)."""
        self.call("Page.navigate", url="about:blank")
        self.wait("document.readyState === 'complete' && location.href === 'about:blank'")
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete' && ['ready', 'error'].includes(document.getElementById('app')?.dataset.state)")

    def act(self, expression: str) -> None:
        """Run ``expression`` (a click, a hash change) and wait until the viewer rendered what it caused."""
        self.js("document.getElementById('app').dataset.state = 'navigating'")
        self.js(expression)
        self.wait("['ready', 'error'].includes(document.getElementById('app').dataset.state)")

    def screenshot(self, path: Path) -> None:
        """A PNG of the whole page (beyond the viewport) at ``path``."""
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            if getattr(self, "ws", None) is not None:
                self.ws.close()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)
