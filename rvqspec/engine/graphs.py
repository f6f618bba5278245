"""CUDA graphs for the predictor's calls: an AR frame, or a speculative frame's prefill and rounds, each replayed
from one captured graph (on CUDA an eager predictor step is launch-bound: benchmarks/results/gpu/bench.md).

What makes a call capturable: its shapes depend only on (B, N) (`decode.round_on_device` with no host k: the
device walk visits every depth, per-row heads are gathered by device k; the fixed compaction) and it reads no
host value. The host still reads each round's result once, between replays (the loop in `decode_speculative`).

    graphs = GraphDecoder()                     # one per decoding object (a handle), never on the shared model
    result = rvqspec.decode_frames(model, talker_hidden, c0, sampler, generator, drafter, tree, graphs=graphs)

Batches are padded up to a bucket (1, 2, 4, ..., 64, as vLLM does) by repeating the last row, so a few graphs
serve every batch size; padding rows start done in a speculative frame and their codes are dropped. A graph is
captured on first use per (call, bucket, tree, sampler settings, dtype, device, model, drafter) and kept on its
GraphDecoder, least recently used first out past `capacity`. Trees and samplers count by value; the model and the
drafter (whose weights a graph bakes in) by weak reference, so the cache keeps neither alive, and an entry whose model
or drafter is gone is dropped. Batches past the largest bucket decode eagerly.

Draws. torch.multinomial draws one sample from p as argmax(p / q), q ~ Exp(1) of p's shape. A captured call does
the same with q read from a noise buffer per draw (`Noise`), filled before each replay from the caller's generator,
for the real rows only and in the order eager decoding draws: so the generator is no part of the capture (a fresh
seeded generator per request reuses the graphs), padding rows draw nothing from it, and seeded codes through graphs
are eager's (on a device where eager decoding walks every depth, as graphs do: accelerators).

`capture` is what turns a call into a replay: `cuda_graph` on CUDA; tests on the CPU pass `direct_call`, which
runs the same static-buffer code each time, so everything but the capture itself is tested without a GPU.
"""

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from rvqspec.engine.decode import (BatchResult, RoundResult, ar_batch, autoregressive_codes, decode_autoregressive,
                                   decode_speculative, first_code, plan_for, round_on_device)
from rvqspec.engine.errors import RvqspecError
from rvqspec.engine.sampling import Sampler
from rvqspec.engine.tree import Tree
from rvqspec.engine.walk import depths

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CAPACITY = 32  # cache entries (each an AR frame, or a speculative frame's start and round) per GraphDecoder


def bucket_for(batch: int) -> int | None:
    """The smallest bucket that holds `batch` rows (None past the largest: eager)."""
    return next((size for size in BUCKETS if size >= batch), None)


def padded(x: Tensor, size: int) -> Tensor:
    """`x` [B, ...] with its last row repeated up to `size` rows."""
    return torch.cat([x, x[-1:].expand(size - len(x), *x.shape[1:])]) if size > len(x) else x


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


class Noise:
    """The sampler of a captured call (module docstring, Draws): its i-th draw is argmax(p / noise[i]), noise filled
    by `draw` before each replay. Greedy: the sampler's argmax, no noise."""

    def __init__(self, sampler: Sampler, draws: int, batch: int, vocab: int, device: torch.device):
        self.sampler, self.used = sampler, 0
        self.noise = torch.ones(draws if sampler.do_sample else 0, batch, vocab, device=device)  # float32: p's dtype

    def sample(self, logits: Tensor, generator=None) -> Tensor:
        if not self.sampler.do_sample:
            return self.sampler.sample(logits)
        q, self.used = self.noise[self.used], self.used + 1
        return (self.sampler.process(logits).softmax(-1) / q).argmax(-1)

    def draw(self, rows: int, generator: torch.Generator | None) -> None:
        """Exp(1) noise for the first `rows` rows, one [rows, V] block per draw in order, as torch.multinomial would
        draw them from `generator`; padding rows keep theirs (1) and take nothing from it."""
        for q in self.noise:
            q[:rows].exponential_(generator=generator)


class Captured:
    """`fn(sampler, **inputs)` over static input buffers and the noise of its `draws` draws, captured once; calling
    it copies new inputs in, draws the noise of the real rows and replays."""

    def __init__(self, fn: Callable[..., object], inputs: dict[str, Tensor], sampler: Sampler, draws: int, vocab: int,
                 capture):
        self.inputs = {name: value.clone() for name, value in inputs.items()}
        batch, device = next(iter(inputs.values())).shape[0], next(iter(inputs.values())).device
        self.noise, self.fn = Noise(sampler, draws, batch, vocab, device), fn
        self.replay = capture(self.run)

    def run(self):
        self.noise.used = 0  # every run (the capture's warm-ups included) reads the buffers from the first
        return self.fn(self.noise, **self.inputs)

    def __call__(self, rows: int, generator: torch.Generator | None, **inputs: Tensor):
        for name, value in inputs.items():
            self.inputs[name].copy_(value)
        self.noise.draw(rows, generator)
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
    """A bucket's static KV cache and the calls captured over it, by name ("ar", or "start" and "round")."""

    def __init__(self, cache, sampler: Sampler, vocab: int, capture):
        self.cache, self.sampler, self.vocab, self.capture = cache, sampler, vocab, capture
        self.calls: dict[str, Captured] = {}

    def captured(self, name: str, fn: Callable[..., object], inputs: dict[str, Tensor], draws: int) -> Captured:
        if name not in self.calls:
            self.calls[name] = Captured(fn, inputs, self.sampler, draws, self.vocab, self.capture)
        return self.calls[name]


class GraphCalls:
    """`decode_speculative`'s calls (as `decode.EagerCalls`: start, round), replayed from one entry's graphs. The
    captured functions reach the model and the drafter through the key's weak references."""

    def __init__(self, key: Key, entry: Entry, plan, rows: int, generator: torch.Generator | None):
        self.key, self.entry, self.plan, self.rows, self.generator = key, entry, plan, rows, generator

    def start(self, talker_hidden: Tensor, c0: Tensor) -> tuple[Tensor, Tensor]:
        model, cache = self.key.model, self.entry.cache
        call = self.entry.captured("start", lambda sampler, talker_hidden, c0: first_code(
            model(), cache, talker_hidden, c0, sampler, None), {"talker_hidden": talker_hidden, "c0": c0}, 1)
        hidden, first = call(self.rows, self.generator, talker_hidden=talker_hidden, c0=c0)
        return hidden.clone(), first.clone()

    def round(self, k: Tensor, k_host: list[int], root: Tensor, hidden: Tensor) -> RoundResult:
        model, drafter, cache, plan = self.key.model, self.key.drafter, self.entry.cache, self.plan
        call = self.entry.captured("round", lambda sampler, k, root, hidden: round_on_device(
            model(), cache, plan, sampler, None, drafter(), k, None, root, hidden),
            {"k": k, "root": root, "hidden": hidden}, depths(plan, None, model().config.num_residual_codes))
        draws, hidden, found, node = call(self.rows, self.generator, k=k, root=root, hidden=hidden)
        accepted, bonus = torch.stack([found, node]).tolist()  # the round's one host read
        return RoundResult(draws.clone(), hidden.clone(), accepted, bonus)


class GraphDecoder:
    """`decode_frames` with its calls captured (module docstring), at most `capacity` cache entries. Thread-safe: one
    lock per decoder."""

    def __init__(self, capture: Callable = cuda_graph, capacity: int = CAPACITY):
        if not isinstance(capacity, int) or capacity < 1:
            raise RvqspecError(f"capacity must be an integer >= 1 (cache entries), got {capacity!r}")
        self.capture, self.capacity, self.lock = capture, capacity, threading.Lock()
        self.graphs: OrderedDict[Key, Entry] = OrderedDict()  # least recently used first

    def entry(self, key: Key, make_cache: Callable, sampler: Sampler, vocab: int) -> Entry:
        """`key`'s entry, now the most recently used; entries of a model or drafter that is gone are dropped, and the
        least recently used past `capacity`."""
        for dead in [k for k in self.graphs if not k.alive()]:
            del self.graphs[dead]
        if key in self.graphs:
            self.graphs.move_to_end(key)
        else:
            self.graphs[key] = Entry(make_cache(), sampler, vocab, self.capture)
            while len(self.graphs) > self.capacity:
                self.graphs.popitem(last=False)
        return self.graphs[key]

    def decode(self, model, talker_hidden: Tensor, c0: Tensor, sampler: Sampler, generator: torch.Generator | None,
               drafter, tree: Tree | None) -> BatchResult:
        """`decode_frames` past its checks (it calls this with `graphs=`); past the largest bucket, eagerly."""
        if self.capture is cuda_graph and model.device.type != "cuda":
            raise RvqspecError(f"CUDA graphs replay calls on a GPU but this model is on {model.device}: decode without "
                               "graphs= (accelerate(..., graphs=False)), or move the model to a CUDA device")
        batch, size = len(c0), bucket_for(len(c0))
        if size is None:
            if drafter is None:
                return decode_autoregressive(model, talker_hidden, c0, sampler, generator)
            return decode_speculative(model, talker_hidden, c0, sampler, generator, drafter, tree)
        talker_hidden, c0 = padded(talker_hidden, size), padded(c0, size)
        groups, vocab = model.config.num_code_groups, model.config.vocab_size
        key = Key("ar" if drafter is None else "speculative", size, None if drafter is None else tuple(tree.paths),
                  sampler, model.dtype, str(model.device), weakref.ref(model),
                  None if drafter is None else weakref.ref(drafter))
        with self.lock:
            if drafter is None:
                entry = self.entry(key, lambda: model.new_cache(size, groups), sampler, vocab)
                cache, model_ref = entry.cache, key.model
                call = entry.captured("ar", lambda sampler, talker_hidden, c0: autoregressive_codes(
                    model_ref(), cache, talker_hidden, c0, sampler, None), {"talker_hidden": talker_hidden, "c0": c0},
                    groups - 1)
                return ar_batch(call(batch, generator, talker_hidden=talker_hidden, c0=c0)[:batch].clone())
            entry = self.entry(key, lambda: model.new_cache(size, groups + tree.size + 1), sampler, vocab)
            calls = GraphCalls(key, entry, plan_for(tree, model), batch, generator)
            return decode_speculative(model, talker_hidden, c0, sampler, generator, drafter, tree, calls, rows=batch)
