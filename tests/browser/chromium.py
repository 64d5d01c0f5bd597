"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON messages
ending in NUL on file descriptors 3 and 4; no websocket library, no port): load a local page, collect its
console errors, uncaught exceptions and failed loads, list the images that did not decode, take a
screenshot. A helper of the browser tests, not a test module."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
)
TIMEOUT_S = 60.0
BROKEN_IMAGES_JS = "Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0).map(i => i.getAttribute('src'))"


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


@dataclass
class PageLoad:
    errors: list[str] = field(default_factory=list)  # console errors, exceptions, failed requests
    broken_images: list[str] = field(default_factory=list)
    num_images: int = 0
    screenshot_png: bytes = b""


class _Pipe:
    def __init__(self, proc: subprocess.Popen[bytes], to_browser: int, from_browser: int) -> None:
        self.proc = proc
        self.to_browser = to_browser
        self.from_browser = from_browser
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self.read()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def read(self, deadline: float | None = None) -> dict[str, Any]:
        deadline = deadline or time.monotonic() + TIMEOUT_S
        while b"\0" not in self.buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer on the DevTools pipe")
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium closed the DevTools pipe (exit {self.proc.poll()})")
            self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\0", 1)
        message = json.loads(raw)
        if "method" in message:
            self.events.append(message)
        return dict(message)

    def wait_event(self, method: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(e["method"] == method for e in self.events):
            self.read(deadline)


def load_page(
    chromium: str, page: Path, width: int = 1200, height: int = 1600, fragment: str = ""
) -> PageLoad:
    """Open `page` (a file; scrolled to `#fragment` when given) in a fresh headless Chromium profile and report
    what went wrong."""
    to_r, to_w = os.pipe()  # we write commands, chromium reads fd 3
    from_r, from_w = os.pipe()  # chromium writes fd 4, we read
    with tempfile.TemporaryDirectory(prefix="stagectl-chromium-") as profile:
        # bash puts the pipe ends on fds 3 and 4 and execs chromium (pass_fds keeps them open for it)
        args = [
            chromium,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_r} 4>&{from_w}', "chromium", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(to_r, from_w),
        )
        os.close(to_r)
        os.close(from_w)
        pipe = _Pipe(proc, to_w, from_r)
        try:
            return _inspect(
                pipe, page.resolve().as_uri() + (f"#{fragment}" if fragment else ""), width, height
            )
        finally:
            try:
                pipe.send("Browser.close")
            except (RuntimeError, OSError, TimeoutError):
                proc.kill()
            proc.wait(timeout=30)
            os.close(to_w)
            os.close(from_r)


def _inspect(pipe: _Pipe, url: str, width: int, height: int) -> PageLoad:
    target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log", "Network"):
        pipe.send(f"{domain}.enable", session=session)
    pipe.send(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        session,
    )
    pipe.events.clear()
    pipe.send("Page.navigate", {"url": url}, session)
    pipe.wait_event("Page.loadEventFired")
    images = pipe.send("Runtime.evaluate", {"expression": BROKEN_IMAGES_JS, "returnByValue": True}, session)
    count = pipe.send(
        "Runtime.evaluate", {"expression": "document.images.length", "returnByValue": True}, session
    )
    shot = pipe.send("Page.captureScreenshot", {"format": "png"}, session)
    result = PageLoad(
        broken_images=list(images["result"]["value"]),
        num_images=int(count["result"]["value"]),
        screenshot_png=base64.b64decode(shot["data"]),
    )
    for event in pipe.events:
        method, params = event["method"], event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            result.errors.append(f"console: {params.get('args')}")
        elif method == "Runtime.exceptionThrown":
            result.errors.append(f"exception: {params.get('exceptionDetails', {}).get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            result.errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
        elif method == "Network.loadingFailed":
            result.errors.append(f"load failed: {params.get('errorText')}")
    return result
