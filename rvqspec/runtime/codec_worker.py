"""Audio off the callers' threads: every streaming request's frames become audio chunks in the Engine's codec
workers, within the thread budget (`runtime/threads.py`); callers and a server's workers only receive chunks.

A request that is iterated is attached (`attach`): its model stream (`AudioStream`) is made in a worker, and each
time the scheduler puts frames, the frames due as a chunk (the request's `ChunkClock`) are decoded there. A worker
that fell behind decodes all the frames that are due in one chunk: fewer, longer chunks under load (the same audio
within the streaming tolerance; the stand-in's vocoder then spends less of its time on context frames). Requests are
decoded one per worker at a time, in parallel across workers (one intra-op thread each): the stand-in's HiFi-GAN does
not run faster batched on a CPU (docs/RESULTS.md, "Concurrency"), and a request's audio never depends on another's.

Each decode holds one of the budget's cores (`Cores`), the frame loop holds its own per frame step: at no time do
more threads do torch work than the cores the process may use.
"""

import collections
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from rvqspec.core.errors import RvqspecError
from rvqspec.core.frame_loop import ChunkClock


class Cores:
    """`count` cores handed out first come, first served: `held(n)` waits for n of them (a frame step, a decode)."""

    def __init__(self, count: int):
        self.free, self.queue = count, collections.deque()
        self.condition = threading.Condition()

    @contextmanager
    def held(self, count: int) -> Iterator[None]:
        ticket = object()
        with self.condition:
            self.queue.append(ticket)
            while self.queue[0] is not ticket or self.free < count:
                self.condition.wait()
            self.queue.popleft()
            self.free -= count
            self.condition.notify_all()
        try:
            yield
        finally:
            with self.condition:
                self.free += count
                self.condition.notify_all()


class Feed:
    """One attached request on its way to audio: its stream, chunk clock and the frames not yet decoded."""

    def __init__(self, request):
        self.request, self.stream, self.clock = request, None, None
        self.sent = 0  # frames of request.decoded handed to the stream
        self.busy = self.ended = False
        self.last_chunk: float | None = None  # when its last chunk was delivered
        self.largest_gap = 0.0  # seconds: the longest wait between two of its chunks

    def due(self) -> int:
        """Frames to decode now: up to the last chunk boundary reached (all of them once the request finished)."""
        decoded = len(self.request.decoded)
        if self.request.done:
            return decoded
        end = self.sent
        while self.clock.frames < decoded:
            if self.clock.tick():
                end = self.clock.frames
        return end

    def has_work(self) -> bool:
        if self.ended or self.busy:
            return False
        return self.stream is None or self.request.done or self.clock.due <= len(self.request.decoded)


class CodecWorker:
    """`threads` worker threads decoding attached requests' chunks, each holding one of `cores` while it decodes."""

    def __init__(self, model, cores: Cores, threads: int):
        self.model, self.cores = model, cores
        self.feeds: list[Feed] = []
        self.condition = threading.Condition()
        self.closing = False
        self.largest_gap = 0.0  # seconds, over every request since the engine started
        self.threads = [threading.Thread(target=self.run, name=f"rvqspec-codec-{i}", daemon=True)
                        for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def attach(self, request) -> None:
        """Decode `request`'s frames from now on (in this thread at once if the engine is closed: it has ended)."""
        feed = Feed(request)
        with self.condition:
            if not self.closing:
                self.feeds.append(feed)
                self.condition.notify()
                return
        self.serve(feed)

    def wake(self) -> None:
        """Frames were put, or a request ended: some feed may have work."""
        with self.condition:
            self.condition.notify_all()

    def gaps(self) -> tuple[float, float]:
        """(the largest inter-chunk gap of the requests streaming now, the largest since the engine started)."""
        with self.condition:
            return max((feed.largest_gap for feed in self.feeds if not feed.ended), default=0.0), self.largest_gap

    def close(self) -> None:
        with self.condition:
            self.closing = True
            self.condition.notify_all()
        for thread in self.threads:
            thread.join()

    def run(self) -> None:
        torch.set_num_threads(1)  # one intra-op thread per worker: requests run in parallel across workers
        with torch.inference_mode():
            while (feed := self.next_feed()) is not None:
                try:
                    self.serve(feed)
                finally:
                    with self.condition:
                        feed.busy = False
                        self.condition.notify_all()

    def next_feed(self) -> Feed | None:
        """A feed with work, marked busy (None once closing and none has work); ended feeds are dropped here."""
        with self.condition:
            while True:
                for feed in self.feeds:
                    if feed.request.cancelled.is_set() and not feed.busy:
                        feed.ended = True
                self.feeds = [feed for feed in self.feeds if not (feed.ended and not feed.busy)]
                for feed in self.feeds:
                    if feed.has_work():
                        feed.busy = True
                        return feed
                if self.closing:
                    return None
                self.condition.wait()

    def serve(self, feed: Feed) -> None:
        """Decode what `feed` has due and hand it to its request (an error ends only that request's audio)."""
        request = feed.request
        try:
            with self.cores.held(1):
                if feed.stream is None:
                    feed.stream = self.model.new_stream(request.prompt)
                    first, every = request.chunks
                    feed.clock = ChunkClock(first + feed.stream.lag, every)
                finished = request.done
                end = feed.due()
                audio = [feed.stream.add(request.decoded[feed.sent:end])] if end > feed.sent else []
                feed.sent = end
                if finished and not request.cancelled.is_set():
                    audio.append(feed.stream.finish())
        except Exception as e:
            feed.ended = True
            request.deliver_error(e if isinstance(e, RvqspecError) else RvqspecError(
                f"turning the request's frames into audio failed ({type(e).__name__}: {e})"))
            return
        chunk = np.concatenate([np.zeros(0, dtype=np.float32), *audio])
        if len(chunk):
            self.note_chunk(feed)
            request.deliver(chunk)
        if finished:
            feed.ended = True
            request.deliver_end()

    def note_chunk(self, feed: Feed) -> None:
        now = time.perf_counter()
        if feed.last_chunk is not None:
            feed.largest_gap = max(feed.largest_gap, now - feed.last_chunk)
            self.largest_gap = max(self.largest_gap, feed.largest_gap)
        feed.last_chunk = now
