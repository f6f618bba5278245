"""Streaming: generation in a worker thread, chunks handed to the consumer through a bounded queue.

    for item in stream(produce):  # produce(channel) runs in a worker; each channel.send(item) reaches this loop
        ...

The consumer controls the worker: leaving the loop (break, an exception, `close()` on the generator, Ctrl-C)
makes the worker's next `channel.check()` (once a frame) or `send` raise `Stopped`, which unwinds generation
within one frame, and the worker is joined before the loop returns. An exception in the worker is raised in
the consumer. A consumer that does not read leaves the worker waiting in `send` once `max_pending` items are
queued, so memory stays bounded.
"""

import queue
import threading
from collections.abc import Callable, Iterator

from rvqspec.engine.errors import RvqspecError

POLL_SECONDS = 0.05  # how often a waiting worker checks whether the consumer left
CHUNK_FRAMES = 12  # about a second of audio at Qwen3-TTS's 12.5 frames a second
FIRST_CHUNK_FRAMES = 3  # the first chunk smaller: audio starts sooner
MAX_CHUNK_FRAMES = 300  # a bigger chunk is not a stream (upstream's own decode works in 300-frame chunks)


class Stopped(Exception):
    """Raised inside the worker when the consumer has left: generation unwinds."""


class Finished:
    """The worker's last item: how it ended (None: produced everything)."""

    def __init__(self, error: BaseException | None):
        self.error = error


def check_chunks(chunk_frames, first_chunk_frames) -> tuple[int, int]:
    """(first, every later) chunk size in frames, validated; the first defaults to FIRST_CHUNK_FRAMES."""
    def checked(name: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHUNK_FRAMES:
            raise RvqspecError(f"{name} must be a whole number of frames from 1 to {MAX_CHUNK_FRAMES}, got "
                               f"{value!r}: for the whole utterance at once, call generate_* instead of stream_*")
        return value

    every = checked("chunk_frames", chunk_frames)
    first = min(FIRST_CHUNK_FRAMES, every) if first_chunk_frames is None else first_chunk_frames
    return checked("first_chunk_frames", first), every


class ChunkClock:
    """Counts a stream's frames: `tick()` (once a frame) is True when a chunk is due, at `first`, `first + every`, ..."""

    def __init__(self, first: int, every: int):
        self.frames, self.due, self.every = 0, first, every

    def tick(self) -> bool:
        self.frames += 1
        if self.frames < self.due:
            return False
        self.due += self.every
        return True


class Channel:
    """The worker's end: `send(item)` queues an item (waiting while the queue is full), `check()` is called
    once a frame; both raise `Stopped` once the consumer has left."""

    def __init__(self, max_pending: int):
        self.items: queue.Queue = queue.Queue(max_pending)
        self.leaving = threading.Event()

    def check(self) -> None:
        if self.leaving.is_set():
            raise Stopped

    def send(self, item) -> None:
        while True:
            self.check()
            try:
                self.items.put(item, timeout=POLL_SECONDS)
                return
            except queue.Full:
                continue


def stream(produce: Callable[[Channel], None], max_pending: int = 4, name: str = "rvqspec-stream") -> Iterator:
    """Yield what `produce(channel)` sends, `produce` running in its own thread (see the module docstring)."""
    channel = Channel(max_pending)

    def work() -> None:
        try:
            produce(channel)
            end = Finished(None)
        except Stopped:
            return
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            end = Finished(error)
        try:
            channel.send(end)
        except Stopped:
            pass

    worker = threading.Thread(target=work, name=name, daemon=True)
    worker.start()
    try:
        while True:
            item = channel.items.get()
            if isinstance(item, Finished):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        channel.leaving.set()
        worker.join()
