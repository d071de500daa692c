"""A headless Debian ``chromium`` driven over the DevTools protocol on a pipe (stdlib only).

``--remote-debugging-pipe`` makes chromium read JSON commands from file descriptor 3 and
write replies and events to descriptor 4, each message ended by a NUL byte: no driver, no
websocket library, no port. ``Browser.open(url)`` gives a ``Tab`` that records console
errors, uncaught exceptions and every network request the page makes.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Any

TIMEOUT_S = 20.0


def chromium_path() -> str | None:
    """The chromium executable on PATH, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless chromium process; ``close()`` ends it."""

    def __init__(self, executable: str) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="headwise-chromium-")
        cmd_read, self._cmd_write = os.pipe()  # we write commands, chromium reads them on fd 3
        self._evt_read, evt_write = os.pipe()  # chromium writes on fd 4, we read

        def on_fds_3_and_4() -> None:  # runs in the child, before exec
            os.dup2(cmd_read, 3)
            os.dup2(evt_write, 4)

        args = [executable, "--headless", "--disable-gpu", "--remote-debugging-pipe", "--hide-scrollbars", "--mute-audio",
                "--no-first-run", "--no-default-browser-check", f"--user-data-dir={self._profile.name}", "about:blank"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # chromium refuses to run its sandbox as root (CI)
        self.process = subprocess.Popen(args, preexec_fn=on_fds_3_and_4, pass_fds=(3, 4), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_read)
        os.close(evt_write)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self.version = self.send("Browser.getVersion")["product"]

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        """Send one command and wait for its reply; events seen meanwhile go to ``events``."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._cmd_write, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive(TIMEOUT_S)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method: str, session: str, timeout: float = TIMEOUT_S) -> dict[str, Any]:
        """Wait for the event ``method`` of ``session`` (or return one already seen)."""
        for event in self.events:
            if event.get("method") == method and event.get("sessionId") == session:
                return event
        deadline = time.monotonic() + timeout
        while True:
            event = self._receive(deadline - time.monotonic())
            self.events.append(event)
            if event.get("method") == method and event.get("sessionId") == session:
                return event

    def _receive(self, timeout: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._evt_read], [], [], max(timeout, 0.0))
            if not ready:
                raise TimeoutError(f"chromium sent nothing for {timeout:.0f} s")
            chunk = os.read(self._evt_read, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe (exit status {self.process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, url: str, *, width: int = 1600, height: int = 900) -> Tab:
        """A new tab showing ``url``, loaded, with console, errors and network recorded."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
        self.send("Page.navigate", {"url": url}, session)
        self.wait_for("Page.loadEventFired", session)
        return Tab(self, session, target)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self.send("Browser.close")
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._cmd_write)
        os.close(self._evt_read)
        self._profile.cleanup()


class Tab:
    """One page in the browser: evaluate JavaScript, click, hover, press keys, take screenshots."""

    def __init__(self, browser: Browser, session: str, target: str) -> None:
        self.browser, self.session, self.target = browser, session, target

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.send(method, params, self.session)

    def js(self, expression: str) -> Any:
        """The value of a JavaScript expression (JSON-serialisable); a thrown error raises RuntimeError."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def _events(self, *methods: str) -> list[dict[str, Any]]:
        return [e for e in self.browser.events if e.get("sessionId") == self.session and e.get("method") in methods]

    def console_errors(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions and error log entries, as text."""
        found = []
        for e in self._events("Runtime.consoleAPICalled", "Runtime.exceptionThrown", "Log.entryAdded"):
            p = e["params"]
            if e["method"] == "Runtime.consoleAPICalled" and p["type"] in ("error", "warning", "assert"):
                found.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
            elif e["method"] == "Runtime.exceptionThrown":
                found.append(json.dumps(p["exceptionDetails"])[:500])
            elif e["method"] == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
                found.append(p["entry"]["text"])
        return found

    def requests(self) -> list[str]:
        """The URL of every request the page made (its own file included)."""
        return [e["params"]["request"]["url"] for e in self._events("Network.requestWillBeSent")]

    def frames(self) -> list[Tab]:
        """The page's out-of-process frames (a sandboxed ``<iframe>`` is one), each as a ``Tab`` recording
        its own console and errors (those logged before recording started are replayed to it)."""
        self.send("Target.setAutoAttach", {"autoAttach": True, "waitForDebuggerOnStart": False, "flatten": True})
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            attached = [e["params"] for e in self._events("Target.attachedToTarget") if e["params"]["targetInfo"]["type"] == "iframe"]
            if attached or time.monotonic() > deadline:
                break
            self.js("0")  # a round trip lets the attach events arrive
            time.sleep(0.05)
        frames = [Tab(self.browser, p["sessionId"], p["targetInfo"]["targetId"]) for p in attached]
        for frame in frames:
            for domain in ("Runtime", "Log"):
                frame.send(f"{domain}.enable")
        return frames

    def centre(self, selector: str) -> tuple[float, float]:
        """Scroll ``selector``'s element into view; its centre in the viewport."""
        box = self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.scrollIntoView({{block: 'center'}}); "
                      f"const r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; }})()")
        return box[0], box[1]

    def click(self, selector: str) -> None:
        """A real left click (mouse down, mouse up) at the centre of ``selector``'s element."""
        x, y = self.centre(selector)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})

    def hover(self, x: float, y: float) -> None:
        self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})

    def key(self, key: str, code: int) -> None:
        """Press and release ``key`` (a DOM key name such as "ArrowRight"; ``code`` its virtual key code)."""
        for kind in ("rawKeyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", {"type": kind, "key": key, "code": key, "windowsVirtualKeyCode": code})

    def screenshot(self) -> bytes:
        """The viewport as PNG bytes."""
        return base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])

    def close(self) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})
