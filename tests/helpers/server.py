"""A speech server in a process of its own on loopback, for the tests: started, its address read from its first line
of output, and killed (with its children) whatever the test did."""

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "helpers" / "fake_server.py"


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    headers: dict | None = None  # what every request of the tests' own sends (an API key)

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers).text
        return {name: float(value) for name, value in re.findall(r"^(rvqspec_\w+) (\S+)$", text, re.M)}

    def wait_until(self, check, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until check(metrics) holds; the last metrics (the caller asserts check on them)."""
        deadline = time.monotonic() + timeout
        while not check(metrics := self.metrics()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return metrics


@contextmanager
def running(argv: list[str], log: Path, timeout: float = 120.0):
    """Start `python argv...` (its stderr into `log`), yield the Server once it prints its address."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with open(log, "wb") as err:
        process = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=err, env=env, cwd=ROOT,
                                   start_new_session=True)
    try:
        url = read_address(process, log, timeout)
        # its access log goes to stdout: read on, or a full pipe would stop the server
        threading.Thread(target=process.stdout.read, daemon=True).start()
        yield Server(url, process, log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def read_address(process: subprocess.Popen, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.2)
        if ready:
            line = process.stdout.readline().decode()
            if found := re.search(r"on (http://\S+)", line):
                return found.group(1)
        if process.poll() is not None:
            break
    raise RuntimeError(f"the server did not start (exit status {process.poll()}): {log.read_text()[-2000:]}")


def fake_server(tmp: Path, *flags: str):
    """The fake engine's server (tests/helpers/fake_server.py)."""
    return running([str(FAKE), "--voices-dir", str(tmp / "voices"), *flags], tmp / "server.log", timeout=60)
