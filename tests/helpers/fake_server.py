"""A test double of `rvqspec.runtime.Engine` (same interface, no model), and a script serving it:

    python tests/helpers/fake_server.py --port 0 --voices-dir DIR [--max-batch 2] [--max-queue 2] [--grace 1]
                                        [--api-key KEY] [--can-clone] [--max-voices N] [--voices-quota MIB]
                                        [--allowed-hosts A,B] [--header-timeout S] [--body-timeout S]
                                        [--stall-timeout S] [--frame-seconds S]

for the HTTP behaviour tests (429, disconnects, SIGTERM, auth, the JSON fuzz), which need requests that decode as long
as a test wants: a request of n characters decodes n frames, FRAME_SECONDS each (--frame-seconds), in one scheduler thread that steps
every active row once a frame (at most max_batch rows; the rest wait in the queue). Its audio is random, seeded by the
request's seed and voice. The text "explode" fails its row before any audio; a text starting with "runaway" ends with
reason "length" (as a row whose budget ran out), any other with "eos".
"""

import argparse
import queue
import sys
import threading
import time
import zlib

import numpy as np

from rvqspec.core.errors import RvqspecError
from rvqspec.runtime import QueueFull

FRAME_SECONDS = 0.01
SAMPLES_PER_FRAME = 1280  # 80 ms at 16 kHz
CHUNK_FRAMES = 4
END = None


class FakeRequest:
    def __init__(self, text: str, seed: int, voice: str):
        self.frames_left = len(text)
        self.explode = text == "explode"
        self.rng = np.random.default_rng([seed, zlib.crc32(voice.encode())])
        self.chunks: queue.Queue = queue.Queue()
        self.pending: list[np.ndarray] = []
        self.submitted, self.first_audio_seconds = time.perf_counter(), None
        self.cancelled, self.finished = threading.Event(), threading.Event()
        self.error: Exception | None = None
        self.end_reason: str | None = None
        self.decoded: list[int] = []  # a frame number per frame, as the engine's request holds its frames
        self.runaway = text.startswith("runaway")

    def step(self) -> None:
        """One frame (the scheduler's thread)."""
        if self.explode:
            self.finish(RuntimeError("the fake engine exploded, as asked"))
            return
        self.pending.append(self.rng.uniform(-0.5, 0.5, SAMPLES_PER_FRAME).astype(np.float32))
        self.frames_left -= 1
        self.decoded.append(len(self.decoded))
        if len(self.pending) == CHUNK_FRAMES or self.frames_left == 0:
            self.chunks.put(np.concatenate(self.pending))
            self.pending = []
        if self.frames_left == 0:
            self.finish()

    def finish(self, error: Exception | None = None) -> None:
        self.error = error
        self.end_reason = "error" if error else "length" if self.runaway else "eos"
        self.finished.set()
        self.chunks.put(END)

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    def cancel(self) -> None:
        self.cancelled.set()
        self.chunks.put(END)

    def __iter__(self):
        while (chunk := self.chunks.get()) is not END:
            if self.first_audio_seconds is None:
                self.first_audio_seconds = time.perf_counter() - self.submitted
            yield chunk
        if self.error is not None:
            raise self.error

    def audio(self) -> np.ndarray:
        return np.concatenate([np.zeros(0, np.float32), *self])


class FakeEngine:
    name = "fake"
    sample_rate = 16000

    def __init__(self, max_batch: int = 2, max_queue: int = 2, can_clone: bool = False,
                 frame_seconds: float = FRAME_SECONDS):
        self.max_batch, self.max_queue, self.can_clone = max_batch, max_queue, can_clone
        self.frame_seconds = frame_seconds
        self.active: list[FakeRequest] = []
        self.waiting: list[FakeRequest] = []
        self.frames, self.closing, self.lock = 0, threading.Event(), threading.Lock()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def voices(self) -> list[str]:
        return ["en", "de"]

    def clone_prompt(self, audio: np.ndarray, sample_rate: int, transcript: str | None) -> object:
        if not self.can_clone:
            raise RvqspecError("this model cannot clone a voice")
        if transcript == "refuse":
            raise RvqspecError("transcript refused, as asked")
        return f"clone:{len(audio)}:{sample_rate}:{transcript}"

    def speech(self, text: str, voice: str | None = None, instructions: str | None = None,
               language: str | None = None, clone: object | None = None, seed: int | None = None,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               sentences: bool = False, non_streaming_mode: bool | None = None) -> FakeRequest:
        if self.closing.is_set():
            raise RvqspecError("the engine is closed")
        if not text:
            raise RvqspecError("text is empty")
        if non_streaming_mode is False:
            raise RvqspecError("fake has no dual-track prompt: leave non_streaming_mode out (or true)")
        if voice is not None and voice not in self.voices():
            raise RvqspecError(f"unknown voice {voice!r}")
        with self.lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting: try again later")
            request = FakeRequest(text, 0 if seed is None else seed, str(clone or voice))
            self.waiting.append(request)
        return request

    def loop(self) -> None:
        while not self.closing.is_set() or self.active or self.waiting:
            with self.lock:
                self.active = [r for r in self.active if not (r.done or r.cancelled.is_set())]
                while self.waiting and len(self.active) < self.max_batch:
                    self.active.append(self.waiting.pop(0))
                rows = list(self.active)
            for row in rows:
                row.step()
            self.frames += len(rows)
            time.sleep(self.frame_seconds)

    def status(self) -> dict:
        with self.lock:
            active = sum(not r.done and not r.cancelled.is_set() for r in self.active)
            return {"active": active, "queued": len(self.waiting), "frames": self.frames,
                    "audio_seconds": self.frames * SAMPLES_PER_FRAME / self.sample_rate, "tokens_per_step": 1.0,
                    "tree": "AR", "frames_per_second": 1 / self.frame_seconds, "realtime_rows": None,
                    "real_time_factors": [1.0] * active, "largest_chunk_gap": 0.0, "largest_chunk_gap_ever": 0.0}

    def close(self, grace: float | None = None) -> None:
        self.closing.set()
        deadline = time.monotonic() + (grace or 0)
        while (self.active or self.waiting) and time.monotonic() < deadline:
            time.sleep(self.frame_seconds)
        with self.lock:
            for row in self.active + self.waiting:
                row.cancel()
            self.active, self.waiting = [], []
        self.thread.join()


def main() -> None:
    from rvqspec.serve.server import bind, serve
    from rvqspec.serve.voices import VoiceStore

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--voices-dir", required=True)
    p.add_argument("--max-batch", type=int, default=2)
    p.add_argument("--max-queue", type=int, default=2)
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--api-key")
    p.add_argument("--can-clone", action="store_true")
    p.add_argument("--max-voices", type=int, default=100)
    p.add_argument("--voices-quota", type=int, default=1024)
    p.add_argument("--allowed-hosts", default="")
    p.add_argument("--header-timeout", type=float, default=10.0)
    p.add_argument("--body-timeout", type=float, default=30.0)
    p.add_argument("--stall-timeout", type=float, default=30.0)
    p.add_argument("--frame-seconds", type=float, default=FRAME_SECONDS)
    args = p.parse_args()
    sock = bind("127.0.0.1", args.port)
    engine = FakeEngine(args.max_batch, args.max_queue, args.can_clone, args.frame_seconds)
    voices = VoiceStore(args.voices_dir, args.max_voices, args.voices_quota * 2 ** 20)
    serve(engine, sock, voices, args.api_key, args.grace,
          allowed_hosts=tuple(filter(None, args.allowed_hosts.split(","))),
          header_seconds=args.header_timeout, body_seconds=args.body_timeout, stall_seconds=args.stall_timeout)


if __name__ == "__main__":
    sys.exit(main())
