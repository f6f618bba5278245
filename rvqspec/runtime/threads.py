"""The thread budget: how many threads do torch work at once in an Engine, decided in one place.

Two threads of the Engine run torch ops: the frame loop (the scheduler's thread) and the codec worker (every
streaming request's audio, `runtime/codec_worker.py`). Callers' threads and a server's workers only wait for
audio. Each of the two sets its own intra-op thread count (torch keeps it per thread), so the busy threads never
outnumber the cores this process may use (`os.sched_getaffinity`) whatever the callers do: many OpenMP teams on
few cores spin against each other, which is how three concurrent requests used to take longer than three in a row
(issue 40). The split per core count was measured (docs/RESULTS.md, "Concurrency").

The frame loop's steps read the talker's and predictor's weights (memory-bound: a second core adds bandwidth), the
codec's convolutions compute; a stream's codec decodes a chunk now and then (~a third of a core at real time). So
by default the frame loop takes every core while no codec worker has a chunk to decode, and leaves one core per
waiting or running decode otherwise (`Scheduler.step_threads`), asked as a step starts and again before its talker
forward (`Grant.resize`): the chunk that a step's frame makes due decodes beside that step's forward and the next
step's draws, while the c0 and predictor before it had both cores, and the second core is not left idle between
chunks (docs/cpu-fast-path.md, "Two cores"). A decode runs on one thread (`CodecWorker.run`), a stream's last one
too: the codec's float sums split by thread count, and a request's audio must not depend on the schedule.
A step's thread count then depends on when a chunk came due, so it varies only where the bits do not: torch's
float32 matrix products split their sums by thread count (Zen 4: a [1, 1024] x [1024, 3072] product differs by
~5e-7 at 2 threads), its bfloat16 ones and rvqspec's int8 kernels do not; a frame loop with float32 layers keeps
one thread count (`fixed_where_bits_vary`), so that a seeded request repeats its codes. A prompt prefilled while no
row decodes computes (~70 tokens through the talker at once) and takes every core no decode holds, also where the
steps keep to an explicit `threads` (`prefill_most`): the first audio waits for it.

Both threads run Python between their torch ops and need the GIL for it: at Python's default switch interval (5
ms) a thread whose op has finished can wait that long for the other to hand it over, once per op, and side by side
the two ran slower than one after the other (Zen 4, 0.6B sizes, w8a8: the decoder 73 against 45 ms a frame, the
real-time factor 2.44 on 2 cores against 2.01 on 1). `quick_gil_handoff` shortens the interval for the process
while an engine has more than one core (`GIL_SWITCH_SECONDS`). Torch's ops and rvqspec's native kernels
(`core/fused.cpp`) let go of the GIL while they run, so the two threads share it only for their Python between ops
(`benchmarks/codec_beside.py` measures what each waits for; docs/cpu-fast-path.md, "Two cores").
"""

import os
import sys
import warnings
from dataclasses import dataclass, replace

import torch

from rvqspec.core.errors import RvqspecError

GIL_SWITCH_SECONDS = 0.0002  # the GIL's switch interval while a frame loop and codec workers share the cores


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadBudget:
    """`cores` threads may do torch work at once: the frame loop's intra-op threads, `loop` of them while a codec
    worker decodes and up to `loop_most` while none does (up to `prefill_most` for a prompt prefilled while no row
    decodes: compute-bound, it gains from every core, also where the steps keep to `threads`), and `codec` workers of
    one thread each (they take the cores the frame loop leaves free: `codec_worker.Cores`)."""

    cores: int
    loop: int
    codec: int
    loop_most: int
    prefill_most: int

    @classmethod
    def split(cls, cores: int | None = None, threads: int | None = None,
              codec_threads: int | None = None) -> "ThreadBudget":
        """The budget of `cores` (None: `usable_cores()`), `threads` for the frame loop (None: all cores but one, at
        least one, and all of them while no codec worker decodes) and `codec_threads` codec workers (None: one per
        core)."""
        for name, value in (("cores", cores), ("threads", threads), ("codec_threads", codec_threads)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise RvqspecError(f"{name} must be a whole number >= 1 (or None: this CPU's default), got {value!r}")
        cores = cores or usable_cores()
        loop = threads or max(1, cores - 1)
        return cls(cores=max(cores, loop), loop=loop, codec=codec_threads or cores, loop_most=threads or cores,
                   prefill_most=max(cores, loop))


def fixed_where_bits_vary(budget: ThreadBudget, *modules: torch.nn.Module) -> ThreadBudget:
    """`budget`, with the frame loop's thread count fixed where `modules` hold float32 linear layers (module
    docstring: their results change with the thread count)."""
    varies = any(isinstance(layer, torch.nn.Linear) and layer.weight.dtype == torch.float32
                 for module in modules for layer in module.modules())
    return replace(budget, loop_most=budget.loop, prefill_most=budget.loop) if varies else budget


def quick_gil_handoff(budget: ThreadBudget) -> None:
    """Shorten this process's GIL switch interval to `GIL_SWITCH_SECONDS` where `budget` runs threads side by side
    (module docstring); never lengthen it (it stays so for the process: another engine may still run)."""
    if budget.cores > 1 and sys.getswitchinterval() > GIL_SWITCH_SECONDS:
        sys.setswitchinterval(GIL_SWITCH_SECONDS)


def warn_if_openmp_spins(budget: ThreadBudget) -> None:
    """Warn where `budget` runs threads side by side while OpenMP's idle workers spin: torch loaded before rvqspec,
    with no wait policy set (`rvqspec/__init__.py` sets OMP_WAIT_POLICY=PASSIVE when it loads first), so that the
    frame loop's spinning workers take the codec worker's core. A policy the user set (ACTIVE too) is theirs."""
    if budget.cores > 1 and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        warnings.warn("rvqspec.Engine on more than one core with OpenMP's idle threads spinning (torch was imported "
                      "before rvqspec, with no OMP_WAIT_POLICY): they take the codec worker's core. Set "
                      "OMP_WAIT_POLICY=PASSIVE in the environment, or import rvqspec before torch",
                      RuntimeWarning, stacklevel=3)
