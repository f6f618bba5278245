"""A long text spoken sentence by sentence as one request (`Passage`): the Engine's long-text mode
(`Engine.speech(..., sentences=True)`; docs/limits.md says where one utterance stops holding up).

Each sentence (`runtime/sentences.py`) is its own prompt with the same voice and settings, decoded in turn from one
generator: sentence k+1 is submitted once sentence k's decoding has ended (its last draw made), ahead of the waiting
requests, so its codes are what the sentences spoken one after another from that generator give (the seed carried
on), alone or in any batch. Its audio follows sentence k's without a gap: nothing is inserted, and its frames decode
while sentence k's last chunks are still being played. A Passage is iterated, waited for and cancelled as a
`Request` is.
"""

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from rvqspec.runtime.request import Prompt, Request

WORST_FIRST = ("error", "cancelled", "length", "eos")  # a passage's end reason: the worst of its sentences'


class Passage:
    """Sentences' prompts spoken in turn as one stream; `submit(prompt)` makes and queues a sentence's request (with
    the passage's generator, ahead of the queue)."""

    def __init__(self, prompts: list[Prompt], submit: Callable[[Prompt], Request], sample_rate: int):
        self.prompts, self.submit, self.sample_rate = prompts, submit, sample_rate
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.first_audio_seconds: float | None = None

    def next_sentence(self) -> None:
        """Submit the next sentence once the last one's decoding ended well (its generator is then free)."""
        with self.lock:
            last = self.requests[-1] if self.requests else None
            if self.cancelled.is_set() or len(self.requests) == len(self.prompts):
                return
            if last is None or (last.done and last.end_reason in ("eos", "length")):
                self.requests.append(self.submit(self.prompts[len(self.requests)]))

    def __iter__(self) -> Iterator[np.ndarray]:
        index = 0
        try:
            self.next_sentence()
            while index < len(self.requests):
                for audio in self.requests[index]:
                    self.next_sentence()
                    if self.first_audio_seconds is None:
                        self.first_audio_seconds = time.perf_counter() - self.submitted
                    yield audio
                self.next_sentence()
                index += 1
        except GeneratorExit:  # the caller stopped iterating: the sentence decoding now is cancelled
            self.cancel()
            raise

    def wait(self, timeout: float | None = None) -> Tensor:
        """Decode every sentence (without their audio): the codes [T, G] of all of them in turn."""
        self.next_sentence()
        index = 0
        while index < len(self.requests):
            self.requests[index].wait(timeout)
            self.next_sentence()
            index += 1
        return self.codes

    def audio(self) -> np.ndarray:
        return np.concatenate([np.zeros(0, dtype=np.float32), *self])

    def cancel(self) -> None:
        with self.lock:
            self.cancelled.set()
            started = list(self.requests)
        for request in started:
            request.cancel()

    @property
    def done(self) -> bool:
        with self.lock:
            requests = list(self.requests)
        finished = bool(requests) and requests[-1].done
        return finished and (len(requests) == len(self.prompts) or requests[-1].end_reason not in ("eos", "length")
                             or self.cancelled.is_set())

    @property
    def end_reason(self) -> str | None:
        """The worst of its sentences' end reasons ("cancelled" where it was cancelled before its last sentence)."""
        if not self.done:
            return None
        reasons = {request.end_reason for request in self.requests}
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
