"""One `POST /v1/audio/speech` on the shipped stand-in, profiled on every thread: it enters the layers of
docs/design.md section 6 once each, serve, runtime, then those below, and no call goes back up (issue 43).

What counts as a call from one layer to another: a Python function of rvqspec (the callee) entered while the nearest
rvqspec frame below it on the same thread's stack (the caller) is in another package. Frames of other code between
the two (torch, starlette, functools) are skipped, so that a callback a lower layer runs through a library still
counts as the lower layer's call. A thread's first rvqspec frame has no caller: a thread's target (the frame loop, a
codec worker, anyio's worker reading the request's chunks) is where a thread starts, not a call back up, and a
condition's or a queue's wake-up is no call at all. A call up is one into a package that the caller's may not
import (tests/test_layers.py's ALLOWED).

Python 3.11 cannot profile a thread that is already running, so the profiler (`sys.setprofile` here,
`threading.setprofile` for the threads started after it) is installed before the Engine and the test client are
made: the frame loop, the codec workers, the client's event loop and its worker threads all start profiled. The test
checks that the trace saw the frame loop, a codec worker and an anyio worker (the event loop's calls are the route's:
serve first). It records only while the request runs.
"""

import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from starlette.testclient import TestClient
from test_layers import ALLOWED, package_of

from rvqspec.runtime import Engine
from rvqspec.serve.app import create_app
from rvqspec.serve.voices import VoiceStore

# The layers in order of first entry: serve at the route, runtime at `parse_speech`'s engine.voices(), the stand-in
# there through its adapter (its languages), core at the request's samplers (`Engine.speech`).
PATH = ["serve", "runtime", "standin", "core"]
# Thread names, less a worker's number: those of the request's path (`Scheduler`, `CodecWorker`, anyio's workers)
THREADS = {"rvqspec-engine", "rvqspec-codec", "AnyIO worker thread"}


def module(frame: FrameType) -> str:
    return frame.f_globals.get("__name__", "")


def in_rvqspec(frame: FrameType) -> bool:
    return module(frame).startswith("rvqspec.")


class Trace:
    """What the profiled threads call in rvqspec while `recording`: the packages in order of first entry, each
    (caller package, callee package) pair with its first call, the cross-package calls' caller modules, and the
    names of the threads seen."""

    def __init__(self):
        self.recording = False
        self.entered: list[str] = []
        self.calls: dict[tuple[str, str], str] = {}
        self.callers: dict[str, set[str]] = {}  # callee package -> modules of other packages that called it
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def profile(self, frame: FrameType, event: str, arg) -> None:
        if event != "call" or not self.recording or not in_rvqspec(frame):
            return
        caller = frame.f_back
        while caller is not None and not in_rvqspec(caller):
            caller = caller.f_back
        with self.lock:
            self.note(frame, caller)

    def note(self, callee: FrameType, caller: FrameType | None) -> None:
        package = package_of(module(callee))
        self.threads.add(re.sub(r"-\d+$", "", threading.current_thread().name))
        if package not in self.entered:
            self.entered.append(package)
        if caller is None:
            return
        pair = (package_of(module(caller)), package)
        self.calls.setdefault(pair, f"{module(caller)}.{caller.f_code.co_qualname} -> "
                                    f"{module(callee)}.{callee.f_code.co_qualname}")
        if pair[0] != package:
            self.callers.setdefault(package, set()).add(module(caller))

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The profiler on this thread and on every thread started meanwhile."""
        before = sys.getprofile(), threading.getprofile()
        sys.setprofile(self.profile)
        threading.setprofile(self.profile)
        try:
            yield
        finally:
            sys.setprofile(before[0])
            threading.setprofile(before[1])


def calls_up(calls: dict[tuple[str, str], str]) -> list[str]:
    """'caller -> callee: the first such call' for every (caller, callee) package pair of `calls` whose callee the
    caller's package may not import."""
    return [f"{caller} -> {callee}: {example}" for (caller, callee), example in sorted(calls.items())
            if callee not in ALLOWED[caller]]


def test_one_speech_request_enters_each_layer_once_going_down(tmp_path):
    trace = Trace()
    with trace.installed(), Engine("standin", max_batch=1) as engine, \
            TestClient(create_app(engine, VoiceStore(tmp_path)), base_url="http://localhost") as client:
        trace.recording = True
        response = client.post("/v1/audio/speech", json={"model": "standin", "input": "Hi.", "seed": 1,
                                                         "response_format": "pcm"})
        trace.recording = False
    assert response.status_code == 200 and len(response.content) > 0, response.text
    assert THREADS <= trace.threads, trace.threads
    assert calls_up(trace.calls) == []
    assert trace.entered == PATH, trace.calls
    assert trace.callers["standin"] == {"rvqspec.runtime.standin"}  # the stand-in's adapter


def test_a_planted_call_up_is_named():
    calls = {("core", "core"): "a", ("runtime", "core"): "b", ("runtime", "serve"): "c", ("core", "runtime"): "d"}
    assert calls_up(calls) == ["core -> runtime: d", "runtime -> serve: c"]
