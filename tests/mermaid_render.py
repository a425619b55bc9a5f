"""Render Mermaid text with Mermaid's own JavaScript in headless Chromium (a test helper).

One Chromium process serves every diagram of a test session: it is driven
over the DevTools protocol on a pipe (--remote-debugging-pipe: commands on
fd 3, replies on fd 4, JSON messages ended by a NUL byte), Mermaid's script
is evaluated once, and each diagram is parsed (mermaid.parse, which raises on
any syntax error), drawn (mermaid.render) and photographed to a PNG.

Mermaid's script comes from the `mermaidx` package on PyPI, which ships it
for offline use (mermaidx/assets/mermaid.js); Chromium from Debian's
`chromium` package.
"""

import base64
import fcntl
import importlib.util
import json
import os
import pathlib
import select
import shutil
import subprocess
import tempfile

_RENDER = """
(async (text) => {
  const out = document.getElementById("out");
  out.innerHTML = "";
  try {
    await mermaid.parse(text);
    window.__n = (window.__n || 0) + 1;
    const result = await mermaid.render("diagram" + window.__n, text);
    out.innerHTML = result.svg;
    const svg = out.querySelector("svg");
    const box = svg.viewBox.baseVal;
    svg.style.maxWidth = "none";
    svg.setAttribute("width", box.width);
    svg.setAttribute("height", box.height);
    return JSON.stringify({ok: true, width: Math.ceil(box.width), height: Math.ceil(box.height),
                           text: svg.textContent});
  } catch (e) {
    return JSON.stringify({ok: false, error: String((e && e.message) || e)});
  }
})
"""


def find_chromium():
    """Path of a Chromium executable, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def mermaid_js():
    """Path of the mermaid.js that the mermaidx package ships (AssertionError if it is missing)."""
    spec = importlib.util.find_spec("mermaidx")
    assert spec is not None, "the test extra's mermaidx package (Mermaid's JavaScript) is not installed"
    js = pathlib.Path(list(spec.submodule_search_locations)[0]) / "assets" / "mermaid.js"
    assert js.is_file(), f"{js} is missing: mermaidx no longer ships Mermaid's script there"
    return js


def _high(fd):
    """fd moved to a number >= 10 (close-on-exec), so bash's 3</4> redirections never clash
    (bash, not sh: dash takes single-digit descriptors only)."""
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return new


class Renderer:
    """A headless Chromium with Mermaid loaded. render(text, png) -> dict; close() when done."""

    def __init__(self, chromium, js, timeout=120.0):
        self.timeout = timeout
        self._buf = b""
        self._id = 0
        self._log = tempfile.TemporaryFile()  # chromium is chatty: a pipe could fill and stall it
        to_chrome_r, to_chrome_w = (_high(fd) for fd in os.pipe())
        from_chrome_r, from_chrome_w = (_high(fd) for fd in os.pipe())
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--remote-debugging-pipe",
            "--hide-scrollbars",
            "--no-first-run",
            "--user-data-dir="
            + os.path.join(os.environ.get("TMPDIR", "/tmp"), f"memtorch-chromium-{os.getpid()}"),
        ]
        # Never hand the sanitizer pass's preloads to the browser.
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONMALLOC")}
        script = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self._proc = subprocess.Popen(
            [shutil.which("bash") or "/bin/bash", "-c", script, chromium, *flags, "about:blank"],
            pass_fds=(to_chrome_r, from_chrome_w),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._w, self._r = to_chrome_w, from_chrome_r
        try:
            target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self._session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})[
                "sessionId"
            ]
            self._eval(
                "document.body.style.margin = '0'; document.body.style.background = 'white';"
                "document.body.innerHTML = '<div id=\"out\"></div>'"
            )
            self._eval(js.read_text(encoding="utf-8"))
            self._eval("mermaid.initialize({startOnLoad: false, securityLevel: 'strict'})")
        except BaseException:
            self.close()
            raise

    def _send(self, method, params, session):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self._session
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self._w, data) :]
        return self._id

    def _call(self, method, params=None, session=False):
        want = self._send(method, params or {}, session)
        while True:
            while b"\0" not in self._buf:
                ready, _, _ = select.select([self._r], [], [], self.timeout)
                if not ready:
                    raise TimeoutError(f"chromium did not answer {method} within {self.timeout} s")
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    self._log.seek(0)
                    err = self._log.read().decode(errors="replace")
                    raise RuntimeError(f"chromium closed its pipe during {method}: {err[-2000:]}")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            msg = json.loads(raw)
            if msg.get("id") == want:
                if "error" in msg:
                    raise RuntimeError(f"chromium: {method}: {msg['error']}")
                return msg["result"]

    def _eval(self, expression, await_promise=False):
        result = self._call(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": await_promise, "returnByValue": True},
            session=True,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"chromium: script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def render(self, text, png=None):
        """{'ok': True, 'width', 'height', 'text' (the drawn text)} or {'ok': False, 'error'};
        on success the drawing is saved to png (a path) when given."""
        out = json.loads(self._eval(f"({_RENDER})({json.dumps(text)})", await_promise=True))
        if out["ok"] and png is not None:
            w, h = out["width"], out["height"]
            self._call(
                "Emulation.setDeviceMetricsOverride",
                {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": False},
                session=True,
            )
            shot = self._call(
                "Page.captureScreenshot",
                {
                    "format": "png",
                    "clip": {"x": 0, "y": 0, "width": w, "height": h, "scale": 1},
                    "captureBeyondViewport": True,
                },
                session=True,
            )
            pathlib.Path(png).write_bytes(base64.b64decode(shot["data"]))
        return out

    def close(self):
        if self._proc.poll() is None:
            try:
                self._send("Browser.close", {}, False)
            except OSError:
                pass
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()
        shutil.rmtree(
            os.path.join(os.environ.get("TMPDIR", "/tmp"), f"memtorch-chromium-{os.getpid()}"),
            ignore_errors=True,
        )
