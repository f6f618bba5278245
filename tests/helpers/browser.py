"""A headless chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON messages ending in
NUL on file descriptors 3 and 4), enough to open a page and read an expression until it holds a value.

    python tests/helpers/browser.py URL EXPRESSION PREFIX   # prints the expression's value once it starts with PREFIX
"""

import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHROMIUM = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def chromium() -> str | None:
    return next((path for name in CHROMIUM if (path := shutil.which(name))), None)


class Browser:
    def __init__(self, executable: str):
        commands_end, self.commands = os.pipe()
        self.replies, replies_end = os.pipe()
        # chromium reads commands on fd 3 and writes replies on fd 4; the child's ends are first copied above 4, so
        # that neither dup2 in the child overwrites the other's source
        child = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (commands_end, replies_end)]
        for fd in (commands_end, replies_end):
            os.close(fd)
        self.profile = tempfile.mkdtemp(prefix="rvqspec-chromium-")
        self.process = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--remote-debugging-pipe", "--autoplay-policy="
             "no-user-gesture-required", f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4), preexec_fn=lambda: (os.dup2(child[0], 3), os.dup2(child[1], 4)))
        for fd in child:
            os.close(fd)
        self.buffer, self.next_id, self.session = b"", 0, None

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self.buffer:
                data = os.read(self.replies, 1 << 16)
                if not data:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self.buffer += data
            raw, self.buffer = self.buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def wait_for(self, expression: str, prefix: str, timeout: float = 30.0) -> str:
        """The expression's string value once it starts with `prefix` (or, after `timeout`, whatever it is)."""
        deadline, value = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            value = str(self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value"))
            if value.startswith(prefix):
                break
            time.sleep(0.2)
        return value

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        os.close(self.commands)
        os.close(self.replies)
        shutil.rmtree(self.profile, ignore_errors=True)

    def screenshot(self, path: Path) -> None:
        """The page as it looks now, as a PNG file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


def page_value(url: str, expression: str, prefix: str, timeout: float = 30.0, screenshot: Path | None = None) -> str:
    """The expression's value once it starts with `prefix` (`Browser.wait_for`), and the page then as a PNG file at
    `screenshot` if given."""
    browser = Browser(chromium() or sys.exit("no chromium: apt install chromium-headless-shell"))
    try:
        browser.open(url)
        value = browser.wait_for(expression, prefix, timeout)
        if screenshot is not None:
            browser.screenshot(screenshot)
        return value
    finally:
        browser.close()


if __name__ == "__main__":
    print(page_value(*sys.argv[1:4]))
