"""Admission that protects running streams: a waiting request joins the batch only if the frame period it would
make keeps the running streams at real time.

The frame loop records how long each frame step takes per batch size (`record`). The period of a batch size not
seen yet is predicted from those measured: a straight line through them (a frame step's cost grows with its rows
from a fixed part), or, with one size measured, scaled by `scaling`: how the decoding policy predicts the
predictor's frame time to grow with the rows, from the call latencies it measured on this CPU (the talker's step,
the rest of a frame step, reads its weights once per step as the predictor's calls do). Without a policy (AR), in
proportion to the rows, which is pessimistic (batching costs less): on a CPU where one stream takes more than half
a frame's audio per step, it would keep a second stream waiting that the two could have run at real time.
A request waits (in the engine's queue; a full queue answers 429 in `rvqspec serve`) while admitting it would make
the predicted period longer than a frame's audio. A CPU too slow for even one stream at real time has no stream to
protect, and fills for throughput; so does a batch with no rows. Once a batch is measured slower than real time
on a CPU that runs one stream at real time (a prior that was wrong), nothing more joins until rows leave.
"""

import collections
import math
import statistics
import threading
from collections.abc import Callable

from rvqspec.core.policy import Policy

RECENT = 9  # frame steps per batch size whose median is its period: a first step's one-off work does not count


class Capacity:
    """Measured frame periods per batch size, and the admission decision (module docstring)."""

    def __init__(self, frame_seconds: float, max_batch: int, realtime: bool = True,
                 scaling: Callable[[int], float] | None = None):
        self.frame_seconds, self.max_batch, self.realtime = frame_seconds, max_batch, realtime
        self.scaling = scaling  # batch size -> a frame step's relative cost (module docstring); None: proportional
        self.recent: dict[int, collections.deque] = {}  # batch size -> seconds of its last frame steps
        self.lock = threading.Lock()

    def record(self, batch: int, seconds: float) -> None:
        with self.lock:
            self.recent.setdefault(batch, collections.deque(maxlen=RECENT)).append(seconds)

    def medians(self) -> dict[int, float]:
        """Batch size -> the median of its recent frame steps, in seconds: one snapshot per decision."""
        with self.lock:
            return {size: statistics.median(steps) for size, steps in self.recent.items()}

    def period(self, batch: int) -> float | None:
        """Seconds per frame step of `batch` rows: measured, else predicted (module docstring); None before any."""
        return predicted(self.medians(), batch, self.scaling)

    def admits(self, batch: int) -> bool:
        """Whether a request may join a batch of `batch` rows now."""
        if not self.realtime or batch == 0:
            return True
        periods = self.medians()
        alone = predicted(periods, 1, self.scaling)
        if alone is None or alone > self.frame_seconds:
            return True
        return predicted(periods, batch + 1, self.scaling) <= self.frame_seconds

    def report(self, batch: int) -> dict:
        """What `Engine.status()` shows: frames/s the current batch sustains, and the most rows at real time."""
        periods = self.medians()
        period = predicted(periods, max(batch, 1), self.scaling)
        realtime_rows = 0
        while realtime_rows < self.max_batch and \
                (predicted(periods, realtime_rows + 1, self.scaling) or math.inf) <= self.frame_seconds:
            realtime_rows += 1
        return {"frames_per_second": 0.0 if not period else max(batch, 1) / period,
                "realtime_rows": realtime_rows if period is not None else None}


def predicted(periods: dict[int, float], batch: int, scaling: Callable[[int], float] | None = None) -> float | None:
    """`batch` rows' period from the measured `periods`: its own, a line through them, or the one size measured
    scaled by `scaling` (None: in proportion to the rows; module docstring); None before any."""
    if batch in periods or not periods:
        return periods.get(batch)
    if len(periods) == 1:
        (size, seconds), = periods.items()
        return seconds * (scaling(batch) / scaling(size) if scaling else batch / size)
    sizes = list(periods)
    mean_size, mean_period = sum(sizes) / len(sizes), sum(periods.values()) / len(sizes)
    slope = sum((s - mean_size) * (periods[s] - mean_period) for s in sizes) \
        / sum((s - mean_size) ** 2 for s in sizes)
    return max(mean_period + max(slope, 0.0) * (batch - mean_size), min(periods.values()))


def frame_scaling(policy: Policy | None) -> Callable[[int], float] | None:
    """Batch size -> the decoding policy's predicted predictor time of a frame (its tree for that size, from the call
    latencies measured on this CPU): how a frame step's cost grows with its rows; None without a policy."""
    if policy is None or policy.latency is None:
        return None
    return lambda batch: policy.frame_ms(batch, policy.choose(batch))
