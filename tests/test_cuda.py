"""The core on a CUDA device: skipped without one. `benchmarks/gpu_check.sh` runs it on a lent GPU machine.

The same checks as on the CPU, through the accelerator's own paths (heads gathered per row, device-side walk,
generators on the device): greedy codes equal to the CPU's AR codes in batches, and sampled codes distributed
exactly as enumerated.
"""

import copy

import pytest
import torch
from test_distribution import DEPLOYED, FULL, SAMPLES, exact_joint, g_test, setup
from test_speculative import DRAFTERS, FRAMES_PER_TREE, GREEDY, greedy_reference, model

from rvqspec.core.decode import decode_frames

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("name", ["reused", "offsets", "medusa", "oracle-depth5"])
def test_batched_greedy_codes_on_cuda_are_the_cpu_ar_codes(name):
    make, trees = DRAFTERS[name]
    frames = 0
    for groups, per_tree in FRAMES_PER_TREE.items():
        gpu = copy.deepcopy(model(groups)).to(CUDA)
        drafter = make(gpu)
        reference = greedy_reference(groups, per_tree * len(trees))
        for t, tree in enumerate(trees.values()):
            rows = [reference[(t * 5 + i) % len(reference)] for i in range(1 + t % 8)]
            drafter.codes = [ar.tolist() for _, _, ar in rows]
            result = decode_frames(gpu, torch.stack([h for h, _, _ in rows]).to(CUDA),
                                   torch.tensor([c0 for _, c0, _ in rows]), GREEDY, drafter=drafter, tree=tree)
            assert result.codes.device.type == "cuda"
            assert torch.equal(result.codes.cpu(), torch.stack([ar for _, _, ar in rows])), (name, groups, tree.paths)
            frames += len(rows)
    assert frames >= 100


def test_batched_sampling_on_cuda_matches_enumeration():
    cpu_model, talker_hidden, c0 = setup(4)
    gpu = copy.deepcopy(cpu_model).to(CUDA)
    from helpers.tiny import random_offsets

    drafter = random_offsets(gpu, 3, seed=5)
    generator = torch.Generator(CUDA).manual_seed(7)
    vocab, last = gpu.config.vocab_size, gpu.config.num_residual_codes
    place = (vocab ** torch.arange(last - 1, -1, -1)).to(CUDA)
    counts = torch.zeros(4, vocab ** last, dtype=torch.long, device=CUDA)
    for _ in range(SAMPLES):
        codes = decode_frames(gpu, talker_hidden.to(CUDA), c0, DEPLOYED, generator, drafter, FULL).codes
        counts[torch.arange(4, device=CUDA), (codes * place).sum(1)] += 1
    pvalues = [g_test(counts[row].cpu(), exact_joint(DEPLOYED, row, 4)) for row in range(4)]
    print(f"CUDA G-test p-values {[f'{p:.3g}' for p in pvalues]} over {SAMPLES} batches of 4")
    assert min(pvalues) > 1e-3


@pytest.mark.parametrize("name", ["reused", "offsets"])
def test_graph_captured_greedy_codes_are_eager_and_cpu_ar_codes(name):
    """CUDA graphs (rvqspec.core.graphs): captured AR and speculative frames, batches padded to their bucket,
    give the eager codes and the CPU's AR codes."""
    from rvqspec.core.graphs import GraphCache

    make, trees = DRAFTERS[name]
    groups, per_tree = next(iter(FRAMES_PER_TREE.items()))
    gpu = copy.deepcopy(model(groups)).to(CUDA)
    drafter, graphs = make(gpu), GraphCache()
    reference = greedy_reference(groups, per_tree * len(trees))
    for t, tree in enumerate(trees.values()):
        for size in (1, 3, 6):  # buckets 1, 4, 8
            rows = [reference[(t * 5 + i) % len(reference)] for i in range(size)]
            drafter.codes = [ar.tolist() for _, _, ar in rows]
            talker_hidden, c0 = torch.stack([h for h, _, _ in rows]).to(CUDA), torch.tensor([c for _, c, _ in rows])
            wanted = torch.stack([ar for _, _, ar in rows])
            for d, tr in ((None, None), (drafter, tree)):
                result = decode_frames(gpu, talker_hidden, c0, GREEDY, drafter=d, tree=tr, graphs=graphs)
                assert torch.equal(result.codes.cpu(), wanted), (name, tree.paths, size, d is None)


def test_graph_captured_sampling_matches_enumeration():
    """Three frames in a bucket of four, sampled through CUDA graphs with a seeded CUDA generator."""
    from rvqspec.core.graphs import GraphCache

    cpu_model, talker_hidden, c0 = setup(3)
    gpu = copy.deepcopy(cpu_model).to(CUDA)
    from helpers.tiny import random_offsets

    drafter, graphs = random_offsets(gpu, 3, seed=5), GraphCache()
    generator = torch.Generator(CUDA).manual_seed(7)
    vocab, last = gpu.config.vocab_size, gpu.config.num_residual_codes
    place = (vocab ** torch.arange(last - 1, -1, -1)).to(CUDA)
    for d, tree in ((None, None), (drafter, FULL)):
        counts = torch.zeros(3, vocab ** last, dtype=torch.long, device=CUDA)
        for _ in range(SAMPLES):
            codes = decode_frames(gpu, talker_hidden.to(CUDA), c0, DEPLOYED, generator, d, tree, graphs=graphs).codes
            counts[torch.arange(3, device=CUDA), (codes * place).sum(1)] += 1
        pvalues = [g_test(counts[row].cpu(), exact_joint(DEPLOYED, row, 3)) for row in range(3)]
        print(f"CUDA graphs {'AR' if d is None else 'speculative'} G-test p-values {[f'{p:.3g}' for p in pvalues]}")
        assert min(pvalues) > 1e-3
