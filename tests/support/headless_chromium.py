"""A minimal headless-Chromium driver for the report tests, speaking the DevTools protocol over a pipe.

`--remote-debugging-pipe` makes Chromium read protocol commands from fd 3 and write replies and
events to fd 4, one NUL-terminated JSON message each, so no websocket client is needed.

Also a script that screenshots a report (how docs/report.png was made):

    python tests/support/headless_chromium.py runs/<run>/report.html docs/report.png [--width 1100] [--height 1500]
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

# Console API calls that count as errors; everything else a page may log is ignored.
_ERROR_CONSOLE_TYPES = frozenset({"error", "assert"})


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(RuntimeError):
    pass


@dataclass
class Page:
    """What a loaded page reported: console errors, uncaught exceptions and failed loads, as text."""

    errors: list[str] = field(default_factory=list)


class Chromium:
    """One headless Chromium process and one tab; `load` navigates it and collects the page's errors."""

    def __init__(self, executable: str, timeout_s: float = 20.0) -> None:
        self.timeout_s = timeout_s
        self._profile = tempfile.TemporaryDirectory(prefix="grpo-flyte-chromium-")
        # Our ends: we write commands to to_browser, read replies from from_browser.
        browser_reads, self._to_browser = os.pipe()
        self._from_browser, browser_writes = os.pipe()

        def place_pipes() -> None:  # runs in the child, before exec
            os.dup2(browser_reads, 3)
            os.dup2(browser_writes, 4)

        self._process = subprocess.Popen(
            [
                executable,
                "--headless",
                "--remote-debugging-pipe",
                # Root in a container has no user namespace sandbox to use.
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--hide-scrollbars",
                "--mute-audio",
                f"--user-data-dir={self._profile.name}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=place_pipes,
            pass_fds=(3, 4),
        )
        os.close(browser_reads)
        os.close(browser_writes)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        target = self._send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")

    # ------------------------------------------------------------------ protocol

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise BrowserError(f"no reply from Chromium within {self.timeout_s:.0f} s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium closed its pipe (exit code {self._process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        self._next_id += 1
        command: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            command["sessionId"] = session
        os.write(self._to_browser, json.dumps(command).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            message = self._read_message(deadline)
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self._events.append(message)

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """A command to the tab."""
        return self._send(method, params, self._session)

    def _wait_for(self, method: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not any(event["method"] == method for event in self._events):
            self._events.append(self._read_message(deadline))

    # ------------------------------------------------------------------ page

    def load(self, path: Path, width: int = 1100, height: int = 900) -> Page:
        """Open a local file at the given viewport size and return the errors it caused while loading."""
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        self._events.clear()
        self.send("Page.navigate", {"url": Path(path).resolve().as_uri()})
        self._wait_for("Page.loadEventFired")
        # A round trip after the load event lets late console messages arrive.
        self.evaluate("document.readyState")
        return Page(errors=[text for event in self._events if (text := _error_text(event))])

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:60]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, full_page: bool = True) -> bytes:
        """A PNG of the viewport, or of the whole page at the viewport's width."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.send("Page.getLayoutMetrics")["cssContentSize"]
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        return base64.b64decode(self.send("Page.captureScreenshot", params)["data"])

    def close(self) -> None:
        try:
            self._send("Browser.close")
        except (BrowserError, OSError):
            pass
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        self._profile.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _error_text(event: dict[str, Any]) -> str | None:
    """The event as one line when it is an error the page's author would want to know about."""
    method, params = event["method"], event.get("params", {})
    if method == "Runtime.consoleAPICalled" and params.get("type") in _ERROR_CONSOLE_TYPES:
        args = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", []))
        return f"console.{params['type']}: {args}"
    if method == "Runtime.exceptionThrown":
        details = params.get("exceptionDetails", {})
        return f"uncaught: {details.get('exception', {}).get('description') or details.get('text')}"
    if method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
        entry = params["entry"]
        return f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip()
    return None


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Screenshot a report.html with headless Chromium.")
    parser.add_argument("report", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--width", type=int, default=1100)
    parser.add_argument("--height", type=int, default=0, help="crop to this many pixels from the top (0: the whole page)")
    args = parser.parse_args(argv)
    executable = find_chromium()
    if executable is None:
        parser.error("chromium not found: apt-get install chromium")
    with Chromium(executable) as browser:
        page = browser.load(args.report, width=args.width, height=args.height or 900)
        for error in page.errors:
            print("page error:", error)
        args.png.write_bytes(browser.screenshot(full_page=not args.height))
    return 1 if page.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
