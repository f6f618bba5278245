"""The graph runner (rvqspec.core.graphs) on the CPU, the capture replaced by a direct call on the same static
buffers: batch buckets and padding, one capture per (call, bucket, N, ...) kept per GraphCache, greedy codes
equal to eager decoding, and the sampled distribution exact (enumerated G-test), padded batches included.
The capture itself (torch.cuda.CUDAGraph) runs in tests/test_cuda.py on a GPU."""

import threading

import pytest
import torch
from test_distribution import DEPLOYED, FULL, SAMPLES, exact_joint, g_test, sample_counts, setup

from rvqspec.core.decode import decode_frames, padded
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.graphs import BUCKETS, GraphCache, bucket_for, direct_call
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree, default_tree

from helpers.tiny import random_frames, random_offsets, tiny_model

GREEDY = Sampler(do_sample=False)


class CountingCapture:
    def __init__(self):
        self.captures = 0

    def __call__(self, fn, generator=None):
        self.captures += 1
        return direct_call(fn)


def test_buckets_and_padding():
    assert [bucket_for(b) for b in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket_for(65) is None and BUCKETS[-1] == 64
    x = torch.arange(6).reshape(3, 2)
    assert padded(x, 4).tolist() == [[0, 1], [2, 3], [4, 5], [4, 5]] and padded(x, 3) is x


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=2, groups=16, vocab=24, hidden=32, dtype=torch.float64)


def frames(model, rows: int, seed: int):
    picked = random_frames(model, rows, seed=seed)
    return torch.stack([h for h, _ in picked]), torch.tensor([c for _, c in picked])


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("drafter", [None, "reused", "offsets"])
def test_greedy_codes_through_graphs_equal_eager_decoding(model, rows, drafter):
    drafter = {None: None, "reused": ReusedHeads(model), "offsets": random_offsets(model, 3, seed=1)}[drafter]
    tree = default_tree(8) if drafter is not None else None
    graphs = GraphCache(direct_call)
    for seed in range(3):  # the same captured calls serve every frame
        talker_hidden, c0 = frames(model, rows, seed)
        eager = decode_frames(model, talker_hidden, c0, GREEDY, drafter=drafter, tree=tree)
        ours = decode_frames(model, talker_hidden, c0, GREEDY, drafter=drafter, tree=tree, graphs=graphs)
        assert torch.equal(ours.codes, eager.codes) and len(ours.rows) == rows
        assert [r.calls for r in ours.rows] == [r.calls for r in eager.rows] or drafter is not None
        assert all(torch.equal(a.codes, b.codes) for a, b in zip(ours.rows, eager.rows))


def test_one_capture_per_call_and_bucket_kept_on_its_decoder(model):
    capture, drafter, tree = CountingCapture(), ReusedHeads(model), default_tree(8)
    graphs = GraphCache(capture)
    for rows in (3, 4, 3):  # bucket 4 each time: the start and the round graphs once
        decode_frames(model, *frames(model, rows, rows), GREEDY, drafter=drafter, tree=tree, graphs=graphs)
    assert capture.captures == 2
    decode_frames(model, *frames(model, 2, 0), GREEDY, drafter=drafter, tree=tree, graphs=graphs)  # bucket 2
    decode_frames(model, *frames(model, 2, 0), GREEDY, graphs=graphs)  # AR at bucket 2
    decode_frames(model, *frames(model, 2, 0), GREEDY, drafter=drafter, tree=default_tree(4), graphs=graphs)
    assert capture.captures == 2 + 2 + 1 + 2
    other = GraphCache(capture)  # another decoding object captures its own
    decode_frames(model, *frames(model, 3, 0), GREEDY, drafter=drafter, tree=tree, graphs=other)
    assert capture.captures == 9 and not set(map(id, other.graphs.values())) & set(map(id, graphs.graphs.values()))


def test_past_the_largest_bucket_decodes_eagerly(model):
    capture = CountingCapture()
    talker_hidden, c0 = frames(model, 65, 0)
    ours = decode_frames(model, talker_hidden, c0, GREEDY, graphs=GraphCache(capture))
    assert capture.captures == 0 and torch.equal(ours.codes, decode_frames(model, talker_hidden, c0, GREEDY).codes)


def test_two_threads_with_their_own_decoders_get_their_own_codes(model):
    drafter, tree, results, errors = ReusedHeads(model), default_tree(8), {}, []

    def work(seed: int) -> None:
        try:
            graphs = GraphCache(direct_call)
            for _ in range(3):
                talker_hidden, c0 = frames(model, 3, seed)
                results[seed] = (decode_frames(model, talker_hidden, c0, GREEDY, drafter=drafter, tree=tree,
                                               graphs=graphs).codes,
                                 decode_frames(model, talker_hidden, c0, GREEDY).codes)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and all(torch.equal(ours, eager) for ours, eager in results.values())


@pytest.mark.parametrize("drafter, tree", [(None, None), ("offsets", FULL), ("reused", Tree.chain(3))],
                         ids=["ar", "full12", "chain3"])
@pytest.mark.long
def test_sampling_through_graphs_matches_enumeration(drafter, tree):
    """Three frames in a bucket of four (one padding row): each real row keeps its own AR distribution."""
    small = setup()[0]
    drafter = {None: None, "reused": ReusedHeads(small), "offsets": random_offsets(small, 3, seed=5)}[drafter]
    counts, accepted = sample_counts(DEPLOYED, SAMPLES, seed=7, drafter=drafter, tree=tree, rows=3,
                                     graphs=GraphCache(direct_call))
    pvalues = [g_test(counts[row], exact_joint(DEPLOYED, row, 3)) for row in range(3)]
    print(f"graphs, {'AR' if drafter is None else 'speculative'}: G-test p-values {[f'{p:.3g}' for p in pvalues]}, "
          f"{accepted:.2f} drafts accepted per round")
    assert min(pvalues) > 1e-3 and (drafter is None or accepted > 0.4)
