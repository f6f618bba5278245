"""The toolkit of both frame loops: `accelerate()`'s (integrations/base.py, `Acceleration.decode`, inside upstream's
generate) and the Engine's (runtime/scheduler.py, `Scheduler.predict`, its own loop over many requests).

- set-up: `check_arguments` (the drafter and tree a caller passed), `decoding_policy` (the drafter checked against
  the predictor, and the policy that picks each frame step's tree by batch size: `policy.tree_for`);
- counters: `Stats`, over the frame steps a loop decoded;
- streaming: chunk sizes (`CHUNK_FRAMES`, `check_chunks`), when a chunk is due (`ChunkClock`), how often a wait
  polls (`POLL_SECONDS`: Ctrl-C reaches the caller).
"""

from dataclasses import dataclass, field, replace
from pathlib import Path

from rvqspec.core.decode import BatchResult
from rvqspec.core.errors import RvqspecError
from rvqspec.core.policy import LatencyTable, Policy, measure_first_use
from rvqspec.core.tree import Tree

POLL_SECONDS = 0.05  # how often a wait checks whether it should end (the consumer left, Ctrl-C, the turn is free)
CHUNK_FRAMES = 12  # about a second of audio at Qwen3-TTS's 12.5 frames a second
FIRST_CHUNK_FRAMES = 3  # the first chunk smaller: audio starts sooner
MAX_CHUNK_FRAMES = 300  # a bigger chunk is not a stream (upstream's own decode works in 300-frame chunks)


def check_arguments(drafter, tree) -> None:
    """Refuse a drafter and tree that do not go together (the drafter is checked against a model by
    `decoding_policy`)."""
    if not (tree is None or tree == "auto" or isinstance(tree, Tree)):
        raise RvqspecError(f"tree must be an rvqspec.Tree, 'auto' (the decoding policy) or None, got {tree!r}")
    if drafter is None and isinstance(tree, Tree):
        raise RvqspecError("a tree was given without a drafter: pass drafter=rvqspec.ReusedHeads() or "
                           "rvqspec.Offsets.load(path) to decode speculatively, or drop the tree for plain AR")
    if drafter is not None and tree is None:
        raise RvqspecError("a drafter was given with tree=None: pass tree='auto' (the decoding policy) or a Tree")


def decoding_policy(predictor, drafter, tree: Tree | str | None, calibration: str | Path | None,
                    latency: LatencyTable | None = None, measure: bool = False) -> Policy | None:
    """The policy that picks each frame step's tree for `predictor` (None: AR without a drafter, or the fixed
    `tree`), after checking that `drafter` fits `predictor` and every tree fits `drafter` (`check_arguments` first).
    `latency`: a table to use (default: this device's, `Policy.for_model`); with `measure`, where this device has
    none, one measured now (`measure_first_use`: once, kept in the device file) rather than AR."""
    if drafter is None:
        return None
    drafter.check_model(predictor)
    if isinstance(tree, Tree):
        tree.check_fits(drafter.depth)
        return None
    policy = Policy.for_model(predictor, calibration, latency)
    if measure and policy.latency is None:
        policy = replace(policy, latency=measure_first_use(predictor, policy.trees), choices={})
    for candidate in policy.trees.values():
        candidate.check_fits(drafter.depth)
    return policy


@dataclass
class RowStats:
    """One row of the batches (the i-th text of the generate call): frames and the calls it took part in."""

    frames: int = 0
    calls: int = 0


@dataclass
class Stats:
    """Counters over the frames rvqspec decoded (cumulative until `reset`). A step here (`steps`) is a frame step:
    one frame of every row of the batch at once, in `calls` predictor calls for the whole batch."""

    steps: int = 0  # frame steps
    frames: int = 0  # rows x frame steps
    calls: int = 0  # predictor calls for whole batches, prefills included
    codes: int = 0
    row_calls: int = 0  # calls summed over rows: what each row alone would have made
    rows: list[RowStats] = field(default_factory=list)
    tree_sizes: dict[int, int] = field(default_factory=dict)  # frame steps per tree size N (0: AR)
    upstream_steps: int = 0  # frame steps left to upstream (settings rvqspec does not implement)

    def add(self, result: BatchResult, tree_size: int) -> None:
        self.steps += 1
        self.frames += len(result.rows)
        self.calls += result.calls
        self.codes += result.codes.numel()
        self.row_calls += sum(row.calls for row in result.rows)
        self.rows += [RowStats() for _ in range(len(result.rows) - len(self.rows))]
        for stats, row in zip(self.rows, result.rows):
            stats.frames += 1
            stats.calls += row.calls
        self.tree_sizes[tree_size] = self.tree_sizes.get(tree_size, 0) + 1

    def reset(self) -> None:
        self.__init__()

    @property
    def tokens_per_step(self) -> float:
        """Tokens per step, as `core.decode.tokens_per_step` defines it, over every row decoded: codes per predictor
        call seen from one row (a batch of B rows emits B times as many per call)."""
        return self.codes / self.row_calls if self.row_calls else 0.0

    @property
    def calls_per_frame(self) -> float:
        """Predictor calls per frame step (15 for Qwen3-TTS's AR, 31 for CSM's, whatever the batch)."""
        return self.calls / self.steps if self.steps else 0.0

    def __str__(self) -> str:
        sizes = ", ".join(f"{'AR' if n == 0 else f'N={n}'} x{count}" for n, count in sorted(self.tree_sizes.items()))
        rows = f" in batches of up to {len(self.rows)}" if len(self.rows) > 1 else ""
        upstream = f"; {self.upstream_steps} steps left to upstream" if self.upstream_steps else ""
        return (f"{self.frames} frames{rows}, {self.calls_per_frame:.2f} calls/frame, "
                f"{self.tokens_per_step:.2f} tokens/step ({sizes}){upstream}")


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
    """Counts a stream's frames: `tick()` (once a frame) is True when a chunk is due, at `first`, `first + every`..."""

    def __init__(self, first: int, every: int):
        self.frames, self.due, self.every = 0, first, every

    def tick(self) -> bool:
        self.frames += 1
        if self.frames < self.due:
            return False
        self.due += self.every
        return True
