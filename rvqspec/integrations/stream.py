"""Streaming: generation in a worker thread, chunks handed to the consumer through a bounded queue.

    for item in stream(produce):  # produce(channel) runs in a worker; each channel.send(item) reaches this loop
        ...

The consumer controls the worker: leaving the loop (break, an exception, `close()` on the generator, Ctrl-C)
makes the worker's next `channel.check()` (once a frame) or `send` raise `Stopped`, which unwinds generation
within one frame, and the worker is joined before the loop returns. An exception in the worker is raised in
the consumer. A consumer that does not read leaves the worker waiting in `send` once `max_pending` items are
queued, so memory stays bounded. Every wait polls (POLL_SECONDS, core/frame_loop.py): Ctrl-C always reaches the
consumer.

Streams of one model take turns (`Turns`, one per accelerated model or stand-in): upstream keeps per-call state
on the model, so one generate call runs at a time. A stream takes the turn in its consumer's thread when its loop
starts, and gives it back as soon as generation ends (its last chunks may still be queued). While another
stream holds the turn:
- in the same thread (two streams zipped, a stream opened inside another's loop, an asyncio server
  interleaving two responses), waiting could never end: RvqspecError at once;
- in another thread, the new stream waits as long as the holder's consumer keeps reading. Once that consumer
  has held a chunk for IDLE_SECONDS without asking for the next (a stream left unclosed after `break` while
  still bound to a name, or kept alive by an exception's traceback), the waiting stream gets RvqspecError
  naming where the idle stream was opened and the fix (close() it). The idle stream itself is left as it is:
  reading it again continues it.
`Turns.close()` (at `undo()`) refuses while a stream holds the turn, and streams opened after it are refused.
Streams of one model batched into shared frame steps: `rvqspec.Engine` (runtime/), which runs the loop itself.
"""

import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator

from rvqspec.core.errors import RvqspecError
# The chunk sizes, ChunkClock and POLL_SECONDS moved to core/frame_loop.py (the Engine's loop uses them too);
# still importable from here for a release.
from rvqspec.core.frame_loop import (CHUNK_FRAMES, FIRST_CHUNK_FRAMES, MAX_CHUNK_FRAMES, POLL_SECONDS, ChunkClock,
                                       check_chunks)

__all__ = ["CHUNK_FRAMES", "FIRST_CHUNK_FRAMES", "MAX_CHUNK_FRAMES", "POLL_SECONDS", "Channel", "ChunkClock",
           "Finished", "IDLE_SECONDS", "Stopped", "Turns", "check_chunks", "stream"]

IDLE_SECONDS = 30.0  # a stream whose consumer holds a chunk this long blocks no other stream (module docstring):
# longer than a player takes to play the largest chunk (MAX_CHUNK_FRAMES, 24 s)


class Stopped(Exception):
    """Raised inside the worker when the consumer has left: generation unwinds."""


class Finished:
    """The worker's last item: how it ended (None: produced everything)."""

    def __init__(self, error: BaseException | None):
        self.error = error


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

    def receive(self):
        """The consumer's end: the next item, waiting for it."""
        while True:
            try:
                return self.items.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call_site() -> str:
    """file:line of the innermost caller outside rvqspec: where the user's loop started a stream."""
    for frame, line in traceback.walk_stack(None):
        if not os.path.abspath(frame.f_code.co_filename).startswith(PACKAGE + os.sep):
            return f"{frame.f_code.co_filename}:{line}"
    return "rvqspec"


class Turn:
    """One stream's hold on its model: where it was opened, the thread that last read it, and since when its
    consumer has held a chunk without asking for the next (None while it waits for one)."""

    def __init__(self):
        self.opened_at, self.thread, self.idle_since = call_site(), threading.get_ident(), None

    def reading(self) -> None:
        self.thread, self.idle_since = threading.get_ident(), None

    def handed(self) -> None:
        self.idle_since = time.monotonic()

    def idle_seconds(self) -> float:
        return 0.0 if self.idle_since is None else time.monotonic() - self.idle_since


class Turns:
    """The streams of one model, one generation at a time (module docstring)."""

    def __init__(self):
        self.changed = threading.Condition()
        self.holder: Turn | None = None
        self.closed = False

    def take(self, turn: Turn) -> None:
        """Wait for the turn; RvqspecError where waiting could not end, or the holder stopped reading."""
        with self.changed:
            while True:
                if self.closed:
                    raise RvqspecError("this acceleration was undone: accelerate the model again and open a new "
                                       "stream from the new handle")
                holder = self.holder
                if holder is None:
                    self.holder = turn
                    return
                if holder.thread == turn.thread:
                    raise RvqspecError(
                        f"another stream of this model, opened at {holder.opened_at}, is open in this thread: it "
                        "cannot go on while this one waits for it. Read it to the end or close() it first (streams "
                        "of one model take turns; rvqspec.Engine batches them)")
                if holder.idle_seconds() > IDLE_SECONDS:
                    raise RvqspecError(
                        f"another stream of this model, opened at {holder.opened_at}, holds the model and has not "
                        f"been read for {holder.idle_seconds():.0f} s (left unclosed after `break`?): close() it, "
                        "or iterate it inside `with contextlib.closing(stream):`, and open this one again")
                self.changed.wait(POLL_SECONDS)

    def give_back(self, turn: Turn) -> None:
        with self.changed:
            if self.holder is turn:
                self.holder = None
                self.changed.notify_all()

    def close(self) -> None:
        """No streams from now on; RvqspecError (and nothing changed) while one is generating."""
        with self.changed:
            if self.holder is not None:
                raise RvqspecError(f"a stream of this model, opened at {self.holder.opened_at}, is still generating: "
                                   "read it to the end or close() it before undo()")
            self.closed = True


def stream(produce: Callable[[Channel], None], turns: Turns | None = None, max_pending: int = 4,
           name: str = "rvqspec-stream") -> Iterator:
    """Yield what `produce(channel)` sends, `produce` running in its own thread while this stream holds a turn
    of `turns` (see the module docstring)."""
    channel, turn = Channel(max_pending), Turn()
    if turns is not None:
        turns.take(turn)

    def work() -> None:
        try:
            try:
                produce(channel)
            finally:
                if turns is not None:
                    turns.give_back(turn)
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
    try:
        worker.start()
        while True:
            turn.reading()
            item = channel.receive()
            if isinstance(item, Finished):
                if item.error is not None:
                    raise item.error
                return
            turn.handed()
            yield item
    finally:
        channel.leaving.set()
        if worker.is_alive():
            worker.join()
        if turns is not None:
            turns.give_back(turn)
