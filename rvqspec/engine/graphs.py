"""CUDA graphs for the predictor's calls: an AR frame, or a speculative frame's prefill and rounds, each replayed
from one captured graph (on CUDA an eager predictor step is launch-bound: benchmarks/results/gpu/bench.md).

What makes a call capturable: its shapes depend only on (B, N) (`decode.round_on_device` with no host k: the
device walk visits every depth, per-row heads are gathered by device k; the fixed compaction) and it reads no
host value. The host still reads each round's result once, between replays (the loop in `decode_speculative`).

    graphs = GraphDecoder()                     # one per decoding object (a handle), never on the shared model
    result = rvqspec.decode_frames(model, talker_hidden, c0, sampler, generator, drafter, tree, graphs=graphs)

Batches are padded up to a bucket (1, 2, 4, ..., 64, as vLLM does) by repeating the last row, so a few graphs
serve every batch size; padding rows start done in a speculative frame and their codes are dropped. A graph is
captured on first use per (call, bucket, N, sampler, generator, drafter, model) and kept on its GraphDecoder.
The sampler's settings and the generator are part of the capture (their draws replay from the generator's
state, so a seeded generator still makes runs reproducible). Batches past the largest bucket decode eagerly.

`capture` is what turns a call into a replay: `cuda_graph` on CUDA; tests on the CPU pass `direct_call`, which
runs the same static-buffer code each time, so everything but the capture itself is tested without a GPU.
"""

import threading
from collections.abc import Callable

import torch
from torch import Tensor

from rvqspec.engine.decode import (BatchResult, EagerCalls, RoundResult, ar_batch, autoregressive_codes,
                                   decode_autoregressive, decode_speculative, first_code, round_on_device)
from rvqspec.engine.sampling import Sampler
from rvqspec.engine.tree import Tree

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_for(batch: int) -> int | None:
    """The smallest bucket that holds `batch` rows (None past the largest: eager)."""
    return next((size for size in BUCKETS if size >= batch), None)


def padded(x: Tensor, size: int) -> Tensor:
    """`x` [B, ...] with its last row repeated up to `size` rows."""
    return torch.cat([x, x[-1:].expand(size - len(x), *x.shape[1:])]) if size > len(x) else x


def cuda_graph(fn: Callable[[], object], generator: torch.Generator | None = None) -> Callable[[], object]:
    """Capture `fn()` (warmed up on a side stream first) into a CUDA graph; returns replay() -> its outputs, the same
    tensors at every replay. A caller's generator is registered with the graph, so its draws advance per replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # allocations, cuBLAS workspaces and lazy inits happen outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    if generator is not None:
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph):
        outputs = fn()

    def replay():
        graph.replay()
        return outputs

    return replay


def direct_call(fn: Callable[[], object], generator: torch.Generator | None = None) -> Callable[[], object]:
    """The capture of the CPU tests: every replay runs `fn()` again on the same static buffers."""
    return fn


class Captured:
    """`fn(**inputs)` over static input buffers, captured once; calling it copies new inputs in and replays."""

    def __init__(self, fn: Callable[..., object], inputs: dict[str, Tensor], capture, generator):
        self.inputs = {name: value.clone() for name, value in inputs.items()}
        self.replay = capture(lambda: fn(**self.inputs), generator)

    def __call__(self, **inputs: Tensor):
        for name, value in inputs.items():
            self.inputs[name].copy_(value)
        return self.replay()


class GraphCalls(EagerCalls):
    """`decode_speculative`'s calls (`EagerCalls`), replayed from graphs over one static cache per bucket."""

    def __init__(self, graphs: "GraphDecoder", key: tuple, model, batch: int, tree: Tree, sampler: Sampler, generator,
                 drafter):
        super().__init__(model, batch, tree, sampler, generator, drafter)
        self.graphs, self.key = graphs, key

    def start(self, talker_hidden: Tensor, c0: Tensor) -> tuple[Tensor, Tensor]:
        call = self.graphs.captured(
            (*self.key, "start"), lambda talker_hidden, c0: first_code(self.model, self.cache, talker_hidden, c0,
                                                                            self.sampler, self.generator),
            {"talker_hidden": talker_hidden, "c0": c0}, self.generator)
        hidden, first = call(talker_hidden=talker_hidden, c0=c0)
        return hidden.clone(), first.clone()

    def round(self, k: Tensor, k_host: list[int], root: Tensor, hidden: Tensor) -> RoundResult:
        call = self.graphs.captured(
            (*self.key, "round"), lambda k, root, hidden: round_on_device(
                self.model, self.cache, self.plan, self.sampler, self.generator, self.drafter, k, None, root, hidden),
            {"k": k, "root": root, "hidden": hidden}, self.generator)
        draws, hidden, found, node = call(k=k, root=root, hidden=hidden)
        accepted, bonus = torch.stack([found, node]).tolist()  # the round's one host read
        return RoundResult(draws.clone(), hidden.clone(), accepted, bonus)


class GraphDecoder:
    """`decode_frames` with its calls captured (module docstring). Thread-safe: one lock per decoder."""

    def __init__(self, capture: Callable = cuda_graph):
        self.capture, self.lock = capture, threading.Lock()
        self.graphs: dict[tuple, Captured] = {}
        self.statics: dict[tuple, object] = {}  # the static caches (a speculative bucket's in its GraphCalls)

    def captured(self, key: tuple, fn: Callable, inputs: dict[str, Tensor], generator) -> Captured:
        if key not in self.graphs:
            self.graphs[key] = Captured(fn, inputs, self.capture, generator)
        return self.graphs[key]

    def decode(self, model, talker_hidden: Tensor, c0: Tensor, sampler: Sampler, generator: torch.Generator | None,
               drafter, tree: Tree | None) -> BatchResult:
        """`decode_frames` past its checks (it calls this with `graphs=`); past the largest bucket, eagerly."""
        batch, size = len(c0), bucket_for(len(c0))
        if size is None:
            if drafter is None:
                return decode_autoregressive(model, talker_hidden, c0, sampler, generator)
            return decode_speculative(model, talker_hidden, c0, sampler, generator, drafter, tree)
        talker_hidden, c0 = padded(talker_hidden, size), padded(c0, size)
        key = (size, model.dtype, id(model), sampler, id(generator), id(drafter), id(tree))
        with self.lock:
            if drafter is None:
                cache = self.static((*key, "ar"), lambda: model.new_cache(size, model.config.num_code_groups))
                call = self.captured((*key, "ar"), lambda talker_hidden, c0: autoregressive_codes(
                    model, cache, talker_hidden, c0, sampler, generator), {"talker_hidden": talker_hidden, "c0": c0},
                    generator)
                return ar_batch(call(talker_hidden=talker_hidden, c0=c0)[:batch].clone())
            calls = self.static((*key, "calls"), lambda: GraphCalls(self, key, model, size, tree, sampler, generator,
                                                                    drafter))
            return decode_speculative(model, talker_hidden, c0, sampler, generator, drafter, tree, calls, rows=batch)

    def static(self, key: tuple, make: Callable):
        if key not in self.statics:
            self.statics[key] = make()
        return self.statics[key]

