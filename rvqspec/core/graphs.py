"""CUDA graphs for the predictor's calls: an AR frame, or a speculative frame's prefill and rounds, each replayed
from one captured graph (on CUDA an eager predictor step is launch-bound: benchmarks/results/gpu/bench.md).

The edge: `decode_frames(..., graphs=)` asks `GraphCache.calls` for its context and steps, and gets a captured
context over the bucket's static cache and the same step functions (`decode.Steps`: the AR frame, the prefill, the
round) wrapped as replays; decode.py never imports this module, and its loop is the same either way.

What makes a call capturable: its shapes depend only on (B, N) and it reads no host value. A captured context's path
(`device_path.captured`) gives both: the device walk visits every depth, per-row heads are gathered by device k, the
compaction is fixed. The host still reads each round's result once, between replays (`decode.read_round`).

    graphs = GraphCache()                       # one per decoding object (a handle), never on the shared model
    result = rvqspec.decode_frames(model, talker_hidden, c0, sampler, generator, drafter, tree, graphs=graphs)

Batches are padded up to a bucket (1, 2, 4, ..., 64, as vLLM does) by repeating the last row, so a few graphs
serve every batch size; padding rows start done in a speculative frame and their codes are dropped. A graph is
captured on first use per (call, bucket, tree, sampler settings, dtype, device, model, drafter) and kept on its
GraphCache, least recently used first out past `capacity`. Trees and samplers count by value; the model and the
drafter (whose weights a graph bakes in) by weak reference, so the cache keeps neither alive, and an entry whose model
or drafter is gone is dropped. Batches past the largest bucket decode eagerly.

Draws. Every draw reads the row's Exp(1) noise for its code (`context.py`, Draws) from the entry's static noise
buffer, filled once per decode call from the caller's generator(s), for the real rows only, as eager decoding fills
its own: so the generator is no part of the capture (a fresh seeded generator per request reuses the graphs),
padding rows draw nothing from it, and seeded codes through graphs are eager's.

`capture` is what turns a call into a replay: `cuda_graph` on CUDA; tests on the CPU pass `direct_call`, which
runs the same static-buffer code each time, so everything but the capture itself is tested without a GPU.
"""

import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

from rvqspec.core import device_path
from rvqspec.core.context import RoundContext, frame_noise, frame_slots, new_context
from rvqspec.core.decode import (RoundResult, Steps, autoregressive_codes, eager_calls, first_code, read_round,
                                   round_on_device)
from rvqspec.core.errors import RvqspecError
from rvqspec.core.sampling import Generators, Sampler
from rvqspec.core.tree import Tree

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CAPACITY = 32  # cache entries (each an AR frame, or a speculative frame's start and round) per GraphCache


def bucket_for(batch: int) -> int | None:
    """The smallest bucket that holds `batch` rows (None past the largest: eager)."""
    return next((size for size in BUCKETS if size >= batch), None)


def cuda_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """Capture `fn()` (warmed up on a side stream first) into a CUDA graph; returns replay() -> its outputs, the same
    tensors at every replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # allocations, cuBLAS workspaces and lazy inits happen outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()

    def replay():
        graph.replay()
        return outputs

    return replay


def direct_call(fn: Callable[[], object]) -> Callable[[], object]:
    """The capture of the CPU tests: every replay runs `fn()` again on the same static buffers."""
    return fn


class Captured:
    """`fn(**inputs)` over static input buffers, captured once; calling it copies new inputs in and replays."""

    def __init__(self, fn: Callable[..., object], inputs: dict[str, Tensor], capture):
        self.inputs = {name: value.clone() for name, value in inputs.items()}
        self.fn = fn
        self.replay = capture(lambda: self.fn(**self.inputs))

    def __call__(self, **inputs: Tensor):
        for name, value in inputs.items():
            self.inputs[name].copy_(value)
        return self.replay()

class Key(NamedTuple):
    """What a cache entry serves (module docstring): values, and weak references to the model and the drafter."""

    call: str  # "ar" or "speculative"
    bucket: int
    tree: tuple | None  # the tree's paths
    sampler: Sampler
    dtype: torch.dtype
    device: str
    model: weakref.ref
    drafter: weakref.ref | None

    def alive(self) -> bool:
        return self.model() is not None and (self.drafter is None or self.drafter() is not None)


class Entry:
    """A bucket's static KV cache and noise buffer (None: greedy), and the calls captured over them, by name ("ar",
    or "start" and "round")."""

    def __init__(self, cache, noise: Tensor | None, capture):
        self.cache, self.noise, self.capture = cache, noise, capture
        self.calls: dict[str, Captured] = {}

    def captured(self, name: str, fn: Callable[..., object], inputs: dict[str, Tensor]) -> Captured:
        if name not in self.calls:
            self.calls[name] = Captured(fn, inputs, self.capture)
        return self.calls[name]


class GraphCache:
    """The captured calls `decode_frames(..., graphs=)` replays (module docstring), at most `capacity` cache entries.
    Thread-safe: one lock per cache. Named GraphDecoder before (that name still works, with a DeprecationWarning):
    "decoder" named the predictor, the codec and this cache."""

    def __init__(self, capture: Callable = cuda_graph, capacity: int = CAPACITY):
        if not isinstance(capacity, int) or capacity < 1:
            raise RvqspecError(f"capacity must be an integer >= 1 (cache entries), got {capacity!r}")
        self.capture, self.capacity, self.lock = capture, capacity, threading.Lock()
        self.graphs: OrderedDict[Key, Entry] = OrderedDict()  # least recently used first

    def entry(self, key: Key, make_cache: Callable, make_noise: Callable) -> Entry:
        """`key`'s entry, now the most recently used; entries of a model or drafter that is gone are dropped, and the
        least recently used past `capacity`."""
        for dead in [k for k in self.graphs if not k.alive()]:
            del self.graphs[dead]
        if key in self.graphs:
            self.graphs.move_to_end(key)
        else:
            self.graphs[key] = Entry(make_cache(), make_noise(), self.capture)
            while len(self.graphs) > self.capacity:
                self.graphs.popitem(last=False)
        return self.graphs[key]

    @contextmanager
    def calls(self, model, batch: int, sampler: Sampler, generator: Generators, drafter,
              tree: Tree | None) -> Iterator[tuple[RoundContext, Steps]]:
        """`decode_frames`'s context and steps (it calls this with `graphs=`): over the static cache and noise of
        `batch`'s bucket (its real rows' noise drawn now), each step replayed from its captured call, under this
        cache's lock for the whole decode; past the largest bucket, eager."""
        if self.capture is cuda_graph and not device_path.replays_graphs(model.device):
            raise RvqspecError(f"CUDA graphs replay calls on a GPU but this model is on {model.device}: decode without "
                               "graphs= (accelerate(..., graphs=False)), or move the model to a CUDA device")
        size = bucket_for(batch)
        if size is None:
            with eager_calls(model, batch, sampler, generator, drafter, tree) as found:
                yield found
            return
        tree = tree if drafter is not None else None
        key = Key("ar" if drafter is None else "speculative", size, None if tree is None else tuple(tree.paths),
                  sampler, model.dtype, str(model.device), weakref.ref(model),
                  None if drafter is None else weakref.ref(drafter))
        with self.lock:
            entry = self.entry(key, lambda: model.new_cache(size, frame_slots(model, tree)),
                               lambda: frame_noise(model, sampler, None, 0, size))
            ctx = new_context(model, entry.cache, sampler, generator, drafter, tree, batch, captured=True,
                              noise=entry.noise)
            yield ctx, Steps(replayed_frame(entry, key, ctx), replayed_start(entry, key, ctx),
                             replayed_round(entry, key, ctx))


def contexts(key: Key, ctx: RoundContext) -> Callable[[], RoundContext]:
    """The context a captured call runs in: `ctx`'s cache, plan, sampler, noise buffer, path and rows, the model and
    the drafter reached through the key's weak references (a cache entry keeps neither alive)."""
    cache, plan, sampler, noise, path, rows = ctx.cache, ctx.plan, ctx.sampler, ctx.noise, ctx.path, ctx.rows
    return lambda: RoundContext(key.model(), cache, plan, sampler, noise, key.drafter and key.drafter(), path, rows)


def replayed(entry: Entry, key: Key, ctx: RoundContext, name: str, step: Callable) -> Callable:
    """`step(ctx, talker_hidden, c0)` replayed from its capture (its outputs: the capture's static buffers)."""
    live = contexts(key, ctx)

    def run(ctx: RoundContext, talker_hidden: Tensor, c0: Tensor):
        call = entry.captured(name, lambda **inputs: step(live(), **inputs), {"talker_hidden": talker_hidden, "c0": c0})
        return call(talker_hidden=talker_hidden, c0=c0)

    return run


def replayed_frame(entry: Entry, key: Key, ctx: RoundContext) -> Callable:
    """`decode.autoregressive_codes` replayed: the AR frame's codes, copied out."""
    replay = replayed(entry, key, ctx, "ar", autoregressive_codes)
    return lambda ctx, talker_hidden, c0: replay(ctx, talker_hidden, c0).clone()


def replayed_start(entry: Entry, key: Key, ctx: RoundContext) -> Callable:
    """`decode.first_code` replayed: h_1 and c1, copied out."""
    replay = replayed(entry, key, ctx, "start", first_code)

    def start(ctx: RoundContext, talker_hidden: Tensor, c0: Tensor) -> tuple[Tensor, Tensor]:
        hidden, first = replay(ctx, talker_hidden, c0)
        return hidden.clone(), first.clone()

    return start


def replayed_round(entry: Entry, key: Key, ctx: RoundContext) -> Callable:
    """`decode.speculative_round` as the replay of `decode.round_on_device` (no host k), then its one host read."""
    live = contexts(key, ctx)

    def run(ctx: RoundContext, k: Tensor, k_host: list[int], root: Tensor, hidden: Tensor) -> RoundResult:
        call = entry.captured("round", lambda **inputs: round_on_device(live(), k_host=None, **inputs),
                              {"k": k, "root": root, "hidden_k": hidden})
        draws, hidden, found, node = call(k=k, root=root, hidden_k=hidden)
        return read_round(draws.clone(), hidden.clone(), found, node)

    return run


def __getattr__(name: str):
    """`GraphDecoder`, the old name of `GraphCache`, with a DeprecationWarning."""
    if name == "GraphDecoder":
        warnings.warn("rvqspec.core.graphs.GraphDecoder is now GraphCache", DeprecationWarning, stacklevel=2)
        return GraphCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
