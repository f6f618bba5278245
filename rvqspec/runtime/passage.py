"""A long text spoken sentence by sentence as one request (`Passage`): the Engine's long-text mode
(`Engine.speech(..., sentences=True)`; docs/limits.md says where one utterance stops holding up).

Each sentence (`runtime/sentences.py`) is its own prompt with the same voice and settings, decoded in turn from one
generator: sentence k+1 is submitted once sentence k's decoding has ended (its last draw made), ahead of the waiting
requests, so its codes are what the sentences spoken one after another from that generator give (the seed carried
on), alone or in any batch. Its audio follows sentence k's without a gap: nothing is inserted, and its frames decode
while sentence k's last chunks are still being played. A Passage is iterated, waited for and cancelled as a
`Request` is. Its sentences may also come over time (`add`, then `complete`: text that arrives over time on a model
without dual-track text, the Engine's sentence mode: docs/live-speech.md); its stream then waits for the next.
"""

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.core.frame_loop import POLL_SECONDS
from rvqspec.runtime.request import Prompt, Request

WORST_FIRST = ("error", "cancelled", "length", "eos")  # a passage's end reason: the worst of its sentences'


class Passage:
    """Sentences' prompts spoken in turn as one stream; `submit(prompt, ended)` makes and queues a sentence's request
    (with the passage's generator, ahead of the queue), `ended` called once its decoding ended well."""

    def __init__(self, prompts: list[Prompt], submit: Callable[[Prompt, Callable[[], None]], Request],
                 sample_rate: int, complete: bool = True):
        self.prompts, self.submit, self.sample_rate = prompts, submit, sample_rate
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.more = threading.Condition(self.lock)  # a sentence added, or the last one
        self.complete, self.error = complete, None
        self.cancelled = threading.Event()
        self.streaming = False  # its audio started: each sentence's is decoded from its submission on
        self.submitted = time.perf_counter()
        self.first_audio_seconds: float | None = None

    def next_sentence(self) -> None:
        """Submit the next sentence once the last one's decoding ended well (its generator is then free): called when
        it ends, and when a sentence is added. Once the passage's audio started, the codec decodes its chunks at once
        (not all its frames in one chunk when the stream reaches it: the wait at the join)."""
        with self.lock:
            last = self.requests[-1] if self.requests else None
            if self.cancelled.is_set() or len(self.requests) == len(self.prompts):
                return
            if last is None or (last.done and last.end_reason in ("eos", "length")):
                try:
                    request = self.submit(self.prompts[len(self.requests)], self.next_sentence)
                except RvqspecError as e:  # the engine closed: the stream ends with it (never the engine's thread)
                    self.complete, self.error = True, self.error or e
                    self.prompts = self.prompts[:len(self.requests)]
                    self.more.notify_all()
                    return
                if self.streaming:
                    request.attach()
                self.requests.append(request)

    def add(self, prompt: Prompt) -> None:
        """One more sentence (of a passage made with `complete` False)."""
        with self.more:
            self.prompts.append(prompt)
            self.more.notify_all()
        self.next_sentence()

    def end(self, error: BaseException | None = None) -> None:
        """No more sentences; `error`: the text's source failed (raised to the caller after the sentences so far)."""
        with self.more:
            self.complete, self.error = True, self.error or error
            self.more.notify_all()

    def await_sentence(self, index: int) -> None:
        """Wait until sentence `index` is known or none will come (polls: Ctrl-C reaches the caller)."""
        with self.more:
            while len(self.prompts) <= index and not (self.complete or self.cancelled.is_set()):
                self.more.wait(POLL_SECONDS)
        self.next_sentence()

    def __iter__(self) -> Iterator[np.ndarray]:
        index = 0
        try:
            self.await_sentence(0)
            while index < len(self.requests):
                for audio in self.requests[index]:
                    if self.first_audio_seconds is None:
                        self.first_audio_seconds = time.perf_counter() - self.submitted
                        self.stream_ahead()
                    yield audio
                index += 1
                self.await_sentence(index)
        except GeneratorExit:  # the caller stopped iterating: the sentence decoding now is cancelled
            self.cancel()
            raise
        if self.error is not None:
            raise self.error

    def stream_ahead(self) -> None:
        """From the first audio on, each sentence's chunks are decoded from its submission (before it, a next
        sentence's would compete with the first chunk for the codec)."""
        with self.lock:
            self.streaming = True
            submitted = list(self.requests)
        for request in submitted:
            request.attach()

    def wait(self, timeout: float | None = None) -> Tensor:
        """Decode every sentence (without their audio): the codes [T, G] of all of them in turn."""
        index = 0
        self.await_sentence(0)
        while index < len(self.requests):
            self.requests[index].wait(timeout)
            index += 1
            self.await_sentence(index)
        if self.error is not None:
            raise self.error
        return self.codes

    def audio(self) -> np.ndarray:
        return np.concatenate([np.zeros(0, dtype=np.float32), *self])

    def cancel(self) -> None:
        with self.lock:
            self.cancelled.set()
            self.more.notify_all()
            started = list(self.requests)
        for request in started:
            request.cancel()

    @property
    def done(self) -> bool:
        with self.lock:
            requests = list(self.requests)
        if self.complete and not self.prompts:
            return True
        finished = bool(requests) and requests[-1].done
        return finished and ((self.complete and len(requests) == len(self.prompts))
                             or requests[-1].end_reason not in ("eos", "length") or self.cancelled.is_set())

    @property
    def end_reason(self) -> str | None:
        """The worst of its sentences' end reasons ("cancelled" where it was cancelled before its last sentence,
        "error" where its text's source failed or the engine closed before its next sentence)."""
        if not self.done:
            return None
        reasons = {request.end_reason for request in self.requests} | ({"error"} if self.error else set())
        if len(self.requests) < len(self.prompts):
            reasons.add("cancelled")
        return next(reason for reason in WORST_FIRST if reason in reasons)

    @property
    def decoded(self) -> list[Tensor]:
        return [frame for request in list(self.requests) for frame in request.decoded]

    @property
    def codes(self) -> Tensor:
        frames = self.decoded
        return torch.stack(frames) if frames else torch.zeros(0, 0, dtype=torch.long)
