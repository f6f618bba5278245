"""One request of the engine: what it decodes from (`Prompt`), and its frames on their way to the caller as audio.

The scheduler's thread puts each finished frame into the request (`put`) and ends it (`finish`); once the caller
iterates the request, the Engine's codec workers turn its frames into audio chunks (`runtime/codec_worker.py`, the
model's `AudioStream`) and deliver them to it: the caller's thread only receives audio, and vocoding one request
never holds up the frame loop of the others.
"""

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.core.frame_loop import POLL_SECONDS
from rvqspec.core.sampling import Sampler, TalkerRules
from rvqspec.runtime.live_text import LiveText

END = object()  # the last item of a request's audio queue
END_REASONS = ("eos", "length", "cancelled", "error")  # how a request ended (`Request.end_reason`)


class QueueFull(RvqspecError):
    """The engine's queue of waiting requests is full: try again later (a server answers 429)."""


@dataclass
class Prompt:
    """What one request decodes from, as the model's adapter builds it (the adapters' contract: runtime/adapter.py)."""

    embeds: Tensor  # [L, H] the talker's prefill (upstream's prompt embeddings)
    positions: Tensor  # [L] their RoPE ids
    frame_positions: list[int]  # [max_new_tokens] the RoPE id frame t is fed at (the model's own rule)
    rules: TalkerRules  # how its c0 are drawn
    sampler: Sampler  # how its predictor codes are drawn
    max_new_tokens: int  # c0 draws at most, as upstream counts them (the last one's frame is never decoded)
    text: Tensor | None = None  # [Tt, H] added to frame t's talker input while t < Tt (Qwen3-TTS's trailing text)
    pad: Tensor | None = None  # [H] added once the text is used up
    prefix: Tensor | None = None  # [n, G] codes the codec decodes before the request's own (a clone's reference)
    last_frame: Callable[[Tensor], bool] | None = None  # a decoded frame [G] that ends it (CSM's EOS frame)
    live: LiveText | None = None  # text arriving over time (runtime/live_text.py): in place of `text` and `pad`,
    # and the last `live.start` rows of `embeds` are its head, filled once it arrived (`fill_head`)

    def ready(self) -> bool:
        """Whether it can be prefilled: its text head has arrived (always, for a whole text)."""
        return self.live is None or self.live.ready(self.live.start)

    def fill_head(self) -> None:
        if self.live is not None:
            self.embeds = torch.cat([self.embeds[:-self.live.start], self.live.head().to(self.embeds.dtype)])

    def text_input(self, frame: int) -> Tensor | float | None:
        """What is added to frame `frame`'s talker input: its text row, the pad, or 0.0; None: not arrived yet."""
        if self.live is not None:
            return self.live.row(self.live.start + frame)
        if self.text is None:
            return 0.0
        return self.text[frame] if frame < len(self.text) else self.pad

    def ends_after(self, decoded: list[Tensor]) -> bool:
        """Whether the last decoded frame ends the request (`last_frame`): its row then leaves at the next frame
        boundary, before another frame is decoded (the talker step after it is spent)."""
        return self.last_frame is not None and bool(decoded) and self.last_frame(decoded[-1])


class AudioStream:
    """A request's codec, frames in, audio out: `add(frames)` -> the audio that is ready, `finish()` -> the rest.
    `lag`: frames it holds back (context a non-causal vocoder needs)."""

    lag = 0

    def add(self, frames: list[Tensor]) -> np.ndarray:
        raise NotImplementedError

    def finish(self) -> np.ndarray:
        return np.zeros(0, dtype=np.float32)


class Request:
    """Iterate for float32 audio chunks (mono, at `sample_rate`) as frames are decoded; `cancel()` (or leaving the
    iteration early) frees its row at the next frame boundary; `audio()` the whole audio; `codes` [T, G] once done.
    An error of its decoding is raised to the caller (iteration, `audio()`, `wait()`), never to the other requests;
    so is the engine's closing before the request finished (`Engine.close`). `end_reason` once it ended: "eos" (the
    model's end), "length" (its frame budget, `Prompt.max_new_tokens`, was spent: the audio may be cut), "cancelled"
    or "error". `codec`: the Engine's codec worker."""

    def __init__(self, prompt: Prompt, codec, sample_rate: int, chunks: tuple[int, int],
                 generator: torch.Generator):
        self.prompt, self.codec, self.sample_rate, self.chunks = prompt, codec, sample_rate, chunks
        self.generator = generator
        self.chunks_ready: queue.Queue = queue.Queue()  # audio from the codec worker, then END
        self.decoded: list[Tensor] = []
        self.cancelled, self.finished = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.end_reason: str | None = None  # END_REASONS
        self.submitted = time.perf_counter()
        self.started: float | None = None  # when its first frame was decoded
        self.first_audio_seconds: float | None = None
        self.taken = self.attached = False
        self.on_end: Callable[[], None] | None = None  # called once its decoding ended well (eos or length)

    # ---------------------------------------------------------------- the scheduler's side

    def put(self, frame: Tensor) -> None:
        if self.started is None:
            self.started = time.perf_counter()
        self.decoded.append(frame)

    def finish(self, error: BaseException | None = None, reason: str = "cancelled") -> None:
        """Decoding ended, for `reason` (an error: "error")."""
        if self.finished.is_set():
            return
        if self.error is None:  # an error its audio met first (`deliver_error`) is the one it ends with
            self.error = error
        self.end_reason = "error" if self.error is not None else reason
        self.finished.set()
        self.codec.wake()
        if self.on_end is not None and self.end_reason in ("eos", "length"):
            self.on_end()  # the scheduler's thread, holding none of its locks (an end for eos or length: `leave`)

    # ---------------------------------------------------------------- the codec worker's side

    def deliver(self, audio: np.ndarray) -> None:
        self.chunks_ready.put(audio)

    def deliver_end(self) -> None:
        self.chunks_ready.put(END)

    def deliver_error(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.end_reason = "error"
        self.chunks_ready.put(END)

    # ---------------------------------------------------------------- the caller's side

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    def cancel(self) -> None:
        """Stop decoding this request: its row leaves the batch at the next frame boundary; iteration ends."""
        self.cancelled.set()
        self.chunks_ready.put(END)
        self.codec.wake()

    def wait(self, timeout: float | None = None) -> Tensor:
        """Block until decoding ends: the codes [T, G] (RvqspecError if it failed or `timeout` passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.finished.wait(POLL_SECONDS):  # polls: Ctrl-C reaches the caller
            if self.cancelled.is_set():
                break
            if deadline is not None and time.monotonic() > deadline:
                raise RvqspecError(f"the request did not finish within {timeout} s: wait longer, or cancel() it")
        self.raise_error()
        return self.codes

    @property
    def codes(self) -> Tensor:
        frames = list(self.decoded)
        return torch.stack(frames) if frames else torch.zeros(0, 0, dtype=torch.long)

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def __iter__(self) -> Iterator[np.ndarray]:
        if self.taken:
            raise RvqspecError("this request's audio was already read: iterate a request (or call audio()) once")
        self.taken = True
        self.attach()
        try:
            while (audio := self.next_chunk()) is not END:
                if self.first_audio_seconds is None:
                    self.first_audio_seconds = time.perf_counter() - self.submitted
                yield audio
        except GeneratorExit:  # the caller stopped iterating (break, or dropped the iterator): its row is freed
            self.cancel()
            raise
        if not self.cancelled.is_set():
            self.raise_error()

    def attach(self) -> None:
        """Have the codec worker decode its audio from now on (once): at its iteration, or before (a passage's next
        sentence, whose first chunks are then ready when the stream reaches it)."""
        if not self.attached:
            self.attached = True
            self.codec.attach(self)

    def next_chunk(self):
        while True:
            try:
                return self.chunks_ready.get(timeout=POLL_SECONDS)  # polls: Ctrl-C reaches the caller
            except queue.Empty:
                continue

    def audio(self) -> np.ndarray:
        """The whole audio (blocks until decoding ends)."""
        return np.concatenate([np.zeros(0, dtype=np.float32), *self])
