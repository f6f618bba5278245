"""Issue 36, cases 16-18: the CUDA-graph path (rvqspec.core.graphs) on the CPU, the capture replaced by a direct call.
16: the cache is bounded (least recently used out), keyed by value (a fresh seeded generator per call, or an equal tree
object, captures nothing new) and keeps no model alive. 17: padding rows draw nothing from the request's generator,
so seeded codes through graphs at batch 3 (padded to 4) are eager's. 18: a CPU model with the real capture is
refused in one line naming the fix."""

import gc
import weakref

import pytest
import torch

from rvqspec import RvqspecError
from rvqspec.core import device_path
from rvqspec.core.decode import decode_frames
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.graphs import GraphCache, direct_call
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree, default_tree

from helpers.tiny import random_frames, random_offsets, tiny_model

GREEDY = Sampler(do_sample=False)
SAMPLED = Sampler(temperature=1.0, top_k=0)  # every code possible: a shifted draw shows


class CountingCapture:
    def __init__(self):
        self.captures = 0

    def __call__(self, fn):
        self.captures += 1
        return direct_call(fn)


def small(seed: int = 2):
    return tiny_model(seed=seed, groups=6, vocab=24, hidden=16, layers=1)


def frames(model, rows: int, seed: int = 0):
    picked = random_frames(model, rows, seed=seed)
    return torch.stack([h for h, _ in picked]), torch.tensor([c for _, c in picked])


def test_the_cache_keeps_no_model_alive():
    graphs, refs = GraphCache(direct_call), []
    for seed in range(30):
        model = small(seed)
        drafter = ReusedHeads(model)
        decode_frames(model, *frames(model, 3), GREEDY, drafter=drafter, tree=default_tree(4), graphs=graphs)
        decode_frames(model, *frames(model, 3), GREEDY, graphs=graphs)
        refs.append(weakref.ref(model))
    del model, drafter
    gc.collect()
    assert not [r for r in refs if r() is not None]
    survivor = small(99)
    decode_frames(survivor, *frames(survivor, 1), GREEDY, graphs=graphs)  # dead models' entries dropped on the way
    assert len(graphs.graphs) == 1


def test_a_fresh_seeded_generator_per_call_reuses_the_graphs():
    model, capture = small(), CountingCapture()
    graphs, drafter = GraphCache(capture), ReusedHeads(model)
    for seed in range(40):
        generator = torch.Generator().manual_seed(seed)
        decode_frames(model, *frames(model, 3), SAMPLED, generator, graphs=graphs)
        decode_frames(model, *frames(model, 3), SAMPLED, torch.Generator().manual_seed(seed), drafter,
                      Tree.from_paths([(0,), (1,), (0, 0)]), graphs=graphs)  # a new tree object, the same tree
    assert capture.captures == 1 + 2 and len(graphs.graphs) == 2


def test_the_cache_is_bounded_least_recently_used_out():
    model, capture = small(), CountingCapture()
    graphs, drafter = GraphCache(capture, capacity=3), ReusedHeads(model)
    for size in (2, 3, 4, 5, 2):  # five trees: 2 is used last, so 3 and 4 went out
        decode_frames(model, *frames(model, 1), GREEDY, drafter=drafter, tree=default_tree(size), graphs=graphs)
    assert len(graphs.graphs) == 3 and capture.captures == 2 * 5
    assert [key.tree for key in graphs.graphs] == [tuple(default_tree(n).paths) for n in (4, 5, 2)]
    decode_frames(model, *frames(model, 1), GREEDY, drafter=drafter, tree=default_tree(5), graphs=graphs)
    assert capture.captures == 10  # still there
    with pytest.raises(RvqspecError, match="capacity must be an integer >= 1"):
        GraphCache(direct_call, capacity=0)


def test_a_new_model_never_replays_a_dead_models_graph():
    graphs = GraphCache(direct_call)
    for seed in range(5):  # ids of dead models are reused: each model must get its own codes
        model = small(seed)
        talker_hidden, c0 = frames(model, 2, seed)
        ours = decode_frames(model, talker_hidden, c0, GREEDY, graphs=graphs).codes
        assert torch.equal(ours, decode_frames(model, talker_hidden, c0, GREEDY).codes)
        del model
        gc.collect()


@pytest.fixture
def walks_every_depth(monkeypatch):
    """Eager decoding as on an accelerator (static shapes: every depth drafted and walked, as a captured round
    does), so that eager and graph rounds make the same draws."""
    monkeypatch.setattr(device_path, "static_shapes", lambda device: True)


@pytest.mark.parametrize("drafter", [None, "reused", "offsets"])
def test_seeded_codes_through_graphs_at_batch_3_are_eagers(walks_every_depth, drafter):
    model = small()
    drafter = {None: None, "reused": ReusedHeads(model), "offsets": random_offsets(model, 3, seed=1)}[drafter]
    tree = default_tree(6) if drafter is not None else None
    graphs = GraphCache(direct_call)
    for seed in range(4):
        talker_hidden, c0 = frames(model, 3, seed)  # padded to 4
        eager = decode_frames(model, talker_hidden, c0, SAMPLED, torch.Generator().manual_seed(seed), drafter, tree)
        ours = decode_frames(model, talker_hidden, c0, SAMPLED, torch.Generator().manual_seed(seed), drafter, tree,
                             graphs=graphs)
        assert torch.equal(ours.codes, eager.codes), seed


def test_padding_draws_nothing_from_the_generator():
    model = small()
    generator, alone = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    decode_frames(model, *frames(model, 3), SAMPLED, generator, graphs=GraphCache(direct_call))
    decode_frames(model, *frames(model, 3), SAMPLED, alone)
    assert torch.equal(generator.get_state(), alone.get_state())


def test_graphs_on_a_cpu_model_say_how_to_decode_instead():
    model = small()
    with pytest.raises(RvqspecError, match=r"this model is on cpu: decode without graphs= \(accelerate\(\.\.\., "
                                           r"graphs=False\)\)"):
        decode_frames(model, *frames(model, 1), GREEDY, graphs=GraphCache())


def test_the_old_name_graph_decoder_still_works_with_a_deprecation_warning():
    from rvqspec.core import graphs

    with pytest.warns(DeprecationWarning, match="GraphCache"):
        assert graphs.GraphDecoder is GraphCache
