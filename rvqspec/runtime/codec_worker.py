"""Audio off the callers' threads: every streaming request's frames become audio chunks in the Engine's codec
workers, within the thread budget (`runtime/threads.py`); callers and a server's workers only receive chunks.

A request that is iterated is attached (`attach`): its model stream (`AudioStream`) is made in a worker, and each
time the scheduler puts frames, the frames due as a chunk (the request's `ChunkClock`) are decoded there. A worker
that fell behind decodes all the frames that are due in one chunk: fewer, longer chunks under load (the same audio
within the streaming tolerance; the stand-in's vocoder then spends less of its time on context frames). A worker
takes one request with work at a time, in parallel with the other workers (one intra-op thread each: the stand-in's
HiFi-GAN does not run faster batched on a CPU, docs/RESULTS.md, "Concurrency"); where the model's codec decodes
several streams in one call faster (`codec_batches`: qwen-tts's 12 Hz decoder, 1.2-1.5x at the 0.6B sizes,
benchmarks/results/codec-batch-streaming.md), it takes every request that has work now, in one call (none waits for
another's chunk to come due). A request's audio never depends on another's (decoded together: to float rounding).

Each decode, batched or not, holds one of the budget's cores (`Cores`) and runs on one thread, also at a stream's
end where the frame loop has left its cores: the codec's float sums split by thread count, and a seeded request's
audio must not depend on when its chunks came due. The frame loop holds its own per frame step (and gives one
back before the step's talker forward where a chunk came due: `Grant.resize`): at no time do more threads do torch
work than the cores the process may use.

Opt-in (`Engine(decode_ahead=True)`): where a core is left for the codec beside the frame loop and the model's codec
decodes incrementally (`decodes_ahead`: qwen-tts's 12 Hz decoder; not a vocoder that decodes its context again), the
frames of a lone stream (`decode_ahead`) are decoded ahead of its chunk boundaries, one at a time while its first
chunk is due and `AHEAD_FRAMES` at a time after, and their audio is held till the boundary: the chunks are delivered
as before, but at a boundary (and at the end of the request) only the last piece is left to decode, not the whole
chunk. The decoder pays a cost per call, so pieces cost it ~1.5x its CPU per frame, on the core the loop leaves; the
audio is the same to float rounding (the decoder's state carries over). Not the default: on the shared 2-core
machine (load 3-12) it cut the time after the last frame 2-4x but made the first audio and the whole stream slower,
once (125 frames) 5x slower with the decoder waiting most of its time (benchmarks/results/two-cores*.md: its steps
keep to one thread beside the decoder, where a contended machine gives two threads more of its time); on a quiet
machine the same real-time factor at 42 frames with a third of the tail, and slower at 125 frames.
"""

import collections
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from rvqspec.core.errors import RvqspecError
from rvqspec.core.frame_loop import ChunkClock
from rvqspec.runtime.threads import ThreadBudget

# Frames decoded ahead of a chunk boundary per call, past the first chunk (module docstring): the 12 Hz decoder at the
# 0.6B sizes, bfloat16, 1 thread, costs 70 ms a frame in 1-frame calls, 44 in 3, 31 in 12
# (benchmarks/results/decoder-stream.md) against a frame step of ~63 ms: 2-frame calls keep up with the loop on
# their core, with at most a frame left at the end.
AHEAD_FRAMES = 2


class Cores:
    """`count` cores handed out first come, first served: `held(n)` waits for n of them (a frame step, a decode);
    `held(n, most)` takes as many as are free then, from n up to `most`. Either yields a `Grant`, which a holder may
    `resize` on its way (the frame loop between a step's frames and its talker forward)."""

    def __init__(self, count: int):
        self.free, self.queue = count, collections.deque()
        self.condition = threading.Condition()

    @contextmanager
    def held(self, least: int, most: int | None = None) -> Iterator["Grant"]:
        ticket = object()
        with self.condition:
            self.queue.append(ticket)
            while self.queue[0] is not ticket or self.free < least:
                self.condition.wait()
            self.queue.popleft()
            grant = Grant(self, max(least, min(self.free, most or least)))
            self.free -= grant.count
            self.condition.notify_all()
        try:
            yield grant
        finally:
            with self.condition:
                self.free += grant.count
                self.condition.notify_all()


class Grant:
    """`count` cores held (`Cores.held`)."""

    def __init__(self, cores: Cores, count: int):
        self.cores, self.count = cores, count

    def resize(self, most: int) -> int:
        """Hold at most `most` cores, and up to `most` where more are free and no one waits for them; never waits.
        How many are held now."""
        with self.cores.condition:
            if self.count > most:
                self.cores.free += self.count - most
                self.count = most
                self.cores.condition.notify_all()
            elif self.count < most and not self.cores.queue:
                more = min(self.cores.free, most - self.count)
                self.cores.free -= more
                self.count += more
        return self.count


class Feed:
    """One attached request on its way to audio: its stream, chunk clock and the frames not yet decoded; with
    `pieces`, the frames decoded ahead of its chunk boundaries (module docstring) and their audio held till then."""

    def __init__(self, request, pieces: int | None = None):
        self.request, self.stream, self.clock = request, None, None
        self.pieces = pieces
        self.sent = 0  # frames of request.decoded handed to the stream
        self.boundary = self.delivered = 0  # frames: the last chunk boundary reached; those whose audio was delivered
        self.held: list[np.ndarray] = []  # audio decoded ahead of the boundary
        self.busy = self.ended = False
        self.last_chunk: float | None = None  # when its last chunk was delivered
        self.largest_gap = 0.0  # seconds: the longest wait between two of its chunks

    def due(self) -> int:
        """Frames to decode now: up to the last chunk boundary reached, or with `pieces` the most whole pieces
        decoded (all of them once the request finished)."""
        decoded = len(self.request.decoded)
        if self.request.done:
            return decoded
        while self.clock.frames < decoded:
            if self.clock.tick():
                self.boundary = self.clock.frames
        end = max(self.sent, self.boundary)
        if self.pieces is None:
            return end
        piece = self.piece()
        return max(end, self.sent + (decoded - self.sent) // piece * piece)

    def piece(self) -> int:
        """Frames decoded ahead at a time: one while the first chunk is due (its audio waits for the last of its
        frames only), `pieces` after (fewer, longer calls: the decoder pays a cost per call)."""
        return 1 if self.delivered == 0 else self.pieces

    def has_work(self) -> bool:
        """Whether it has frames to decode now."""
        if self.ended or self.busy:
            return False
        if self.stream is None:  # started beside the prefill where it has a prefix to decode, else at its first frame
            return self.request.prompt.prefix is not None or bool(self.request.decoded) or self.request.done
        if self.request.done:
            return True
        frames = len(self.request.decoded)
        return self.clock.due <= frames or (self.pieces is not None and frames - self.sent >= self.piece())

    def take_audio(self, audio: list[np.ndarray], finished: bool) -> np.ndarray | None:
        """The chunk to deliver now, with `audio` (this decode's) held till a boundary is reached (or the end)."""
        self.held += audio
        if not finished and not self.sent >= self.boundary > self.delivered:
            return None
        chunk = np.concatenate([np.zeros(0, dtype=np.float32), *self.held])
        self.held, self.delivered = [], self.sent
        return chunk


class CodecWorker:
    """`budget.codec` worker threads decoding attached requests' chunks, each holding one of `cores` while it
    decodes; with `ahead`, `pieces` (AHEAD_FRAMES) ahead of the boundaries where `budget` leaves a core beside the
    frame loop's steps and the model's streams decode ahead at no cost but the call's (`decodes_ahead`), else None
    (module docstring)."""

    def __init__(self, model, cores: Cores, budget: ThreadBudget, ahead: bool = False):
        self.model, self.cores = model, cores
        self.pieces = AHEAD_FRAMES if ahead and budget.cores > budget.loop and model.decodes_ahead else None
        self.feeds: list[Feed] = []
        self.condition = threading.Condition()
        self.closing = False
        self.idle = 0  # workers waiting for work
        self.largest_gap = 0.0  # seconds, over every request since the engine started
        self.threads = [threading.Thread(target=self.run, name=f"rvqspec-codec-{i}", daemon=True)
                        for i in range(budget.codec)]
        for thread in self.threads:
            thread.start()

    def attach(self, request) -> None:
        """Decode `request`'s frames from now on (in this thread at once if the engine is closed: it has ended)."""
        feed = Feed(request)
        with self.condition:
            if not self.closing:
                self.feeds.append(feed)
                self.decode_ahead()
                self.condition.notify()
                return
        self.serve([feed])

    def decode_ahead(self) -> None:
        """Frames are decoded ahead (`pieces`) while one stream is attached: pieces cost the decoder ~1.5x its CPU
        per frame (benchmarks/results/two-cores.md), which a lone stream's spare core pays, not a batch's codec."""
        for feed in self.feeds:
            feed.pieces = self.pieces if len(self.feeds) == 1 else None

    def decoding(self) -> bool:
        """Whether some started request has a chunk due or being decoded (a worker holding a core for it, or about
        to): a stream not started yet (its prompt still prefilling) does not count."""
        with self.condition:
            return any(feed.stream is not None and (feed.busy or feed.has_work()) for feed in self.feeds)

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
        torch.set_num_threads(1)  # one thread per decode, always: the codec's float sums split by thread count
        with torch.inference_mode():
            while feeds := self.next_feeds():
                try:
                    self.serve(feeds)
                finally:
                    with self.condition:
                        for feed in feeds:
                            feed.busy = False
                        self.condition.notify_all()

    def next_feeds(self) -> list[Feed]:
        """Feeds with work, marked busy: this worker's `share` of them; [] once closing and none has work. Ended feeds
        are dropped here."""
        with self.condition:
            while True:
                for feed in self.feeds:
                    if feed.request.cancelled.is_set() and not feed.busy:
                        feed.ended = True
                self.feeds = [feed for feed in self.feeds if not (feed.ended and not feed.busy)]
                self.decode_ahead()
                ready = [feed for feed in self.feeds if feed.has_work()]
                if ready:
                    ready = ready[:self.share(len(ready))]
                    for feed in ready:
                        feed.busy = True
                    self.condition.notify_all()  # what is left is for the idle workers
                    return ready
                if self.closing:
                    return []
                self.idle += 1
                self.condition.wait()
                self.idle -= 1

    def share(self, ready: int) -> int:
        """How many of `ready` feeds this worker takes: one where the codec decodes each in turn; where it decodes
        several in one call faster (`codec_batches`), an equal share per decode that can run now (the idle workers
        and this one, no more than the cores free now), so that one call does not take on one core what free cores
        could decode side by side."""
        if not self.model.codec_batches:
            return 1
        return math.ceil(ready / max(1, min(self.idle + 1, self.cores.free)))

    def serve(self, feeds: list[Feed]) -> None:
        """Decode what `feeds` have due, in one call of the model's codec, and hand each request its audio (an error
        ends the audio of the requests it was decoding, and only theirs; what the finer guards do not catch ends the
        audio of this call's requests, and never the worker's thread)."""
        with failing(feeds):
            with self.cores.held(1):
                decoded = self.decode_due(feeds)
            for feed, (audio, finished) in decoded.items():
                if not feed.ended:
                    self.hand_over(feed, audio, finished)

    def decode_due(self, feeds: list[Feed]) -> dict[Feed, tuple[list[np.ndarray], bool]]:
        """Each feed's audio pieces for what it has due, and whether its request had finished (its stream's last
        audio then among them); a feed whose decode failed has ended, with its request's error."""
        for feed in feeds:
            if feed.stream is None:
                with failing([feed]):
                    self.start(feed)
        feeds = [feed for feed in feeds if not feed.ended]
        finished = {feed: feed.request.done for feed in feeds}  # before due(): frames put later are the next call's
        ends = {feed: feed.due() for feed in feeds}
        audio = {feed: [] for feed in feeds}
        adding = [feed for feed in feeds if ends[feed] > feed.sent]
        if adding:
            with failing(adding):
                chunks = self.model.add_together([feed.stream for feed in adding],
                                                 [feed.request.decoded[feed.sent:ends[feed]] for feed in adding])
                for feed, chunk in zip(adding, chunks, strict=True):
                    audio[feed].append(chunk)
        for feed in feeds:
            feed.sent = ends[feed]
            if finished[feed] and not feed.ended and not feed.request.cancelled.is_set():
                with failing([feed]):
                    audio[feed].append(feed.stream.finish())
        return {feed: (audio[feed], finished[feed]) for feed in feeds}

    def start(self, feed: Feed) -> None:
        """The request's model stream and chunk clock, at its first work: at once where the stream decodes a prefix
        first (a clone's reference: beside the prompt's prefill), else with its first frame (so that a start does not
        hold a core the prefill could use: `Scheduler.step_threads`)."""
        feed.stream = self.model.new_stream(feed.request.prompt)
        first, every = feed.request.chunks
        feed.clock = ChunkClock(first + feed.stream.lag, every)

    def hand_over(self, feed: Feed, audio: list[np.ndarray], finished: bool) -> None:
        chunk = feed.take_audio(audio, finished)
        if chunk is not None and len(chunk):
            self.note_chunk(feed)
            feed.request.deliver(chunk)
        if finished:
            feed.ended = True
            feed.request.deliver_end()

    def note_chunk(self, feed: Feed) -> None:
        now = time.perf_counter()
        if feed.last_chunk is not None:
            feed.largest_gap = max(feed.largest_gap, now - feed.last_chunk)
            self.largest_gap = max(self.largest_gap, feed.largest_gap)
        feed.last_chunk = now


@contextmanager
def failing(feeds: list[Feed]) -> Iterator[None]:
    """An error while held ends the audio of these feeds' requests that have not ended with it (as an RvqspecError),
    and goes no further."""
    try:
        yield
    except Exception as e:
        for feed in (feed for feed in feeds if not feed.ended):
            feed.ended = True
            feed.request.deliver_error(e if isinstance(e, RvqspecError) else RvqspecError(
                f"turning the request's frames into audio failed ({type(e).__name__}: {e})"))
