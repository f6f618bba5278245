"""The thread budget: how many threads do torch work at once in an Engine, decided in one place.

Two threads of the Engine run torch ops: the frame loop (the scheduler's thread) and the codec worker (every
streaming request's audio, `runtime/codec_worker.py`). Callers' threads and a server's workers only wait for
audio. Each of the two sets its own intra-op thread count (torch keeps it per thread), so the busy threads never
outnumber the cores this process may use (`os.sched_getaffinity`) whatever the callers do: many OpenMP teams on
few cores spin against each other, which is how three concurrent requests used to take longer than three in a row
(issue 40). The split per core count was measured (docs/RESULTS.md, "Concurrency").
"""

import os
from dataclasses import dataclass

from rvqspec.core.errors import RvqspecError


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadBudget:
    """`cores` threads may do torch work at once: the frame loop's `loop` intra-op threads, and `codec` workers of
    one thread each (they take the cores the frame loop leaves free: `codec_worker.Cores`)."""

    cores: int
    loop: int
    codec: int

    @classmethod
    def split(cls, cores: int | None = None, threads: int | None = None,
              codec_threads: int | None = None) -> "ThreadBudget":
        """The budget of `cores` (None: `usable_cores()`), `threads` for the frame loop (None: all cores but one, at
        least one) and `codec_threads` codec workers (None: one per core)."""
        for name, value in (("cores", cores), ("threads", threads), ("codec_threads", codec_threads)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise RvqspecError(f"{name} must be a whole number >= 1 (or None: this CPU's default), got {value!r}")
        cores = cores or usable_cores()
        loop = threads or max(1, cores - 1)
        return cls(cores=max(cores, loop), loop=loop, codec=codec_threads or cores)
