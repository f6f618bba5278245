"""Issue 40, item 4: a seed is a seed in any batch. `decode_frames` with one generator per row: a row's sampled codes,
and how far its generator moves, are the same bits alone and in batches of 2, 4 and 8 (at any place in them), AR and
speculative, on the CPU's walk, the device's walk and through captured calls; a seeded speculative row draws AR's
codes. The engine's requests (joining mid-utterance, leaving early): tests/test_runtime.py; the distribution of
per-row draws: tests/test_distribution.py."""

import pytest
import torch

from rvqspec import RvqspecError
from rvqspec.core import device_path
from rvqspec.core.decode import decode_frames
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.graphs import GraphCache, direct_call
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree

from helpers.tiny import random_frames, random_offsets, tiny_model

SAMPLED = Sampler(temperature=1.0, top_k=0)  # every code possible: a shifted draw shows
ROWS, FRAMES = 8, 3


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=2, groups=6, vocab=24, hidden=16, layers=1)


def generators(seeds) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def decoded(model, rows: list[int], drafter, tree, graphs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """FRAMES frames of `rows` (indices into ROWS fixed frames, row b seeded 100 + b) decoded together, one call per
    frame: each row's codes [FRAMES, G-1] and its generator's final state."""
    frames = random_frames(model, ROWS, seed=4)
    talker_hidden = torch.stack([frames[b][0] for b in rows])
    c0 = torch.tensor([frames[b][1] for b in rows])
    mine = generators(100 + b for b in rows)
    codes = [decode_frames(model, talker_hidden, c0, SAMPLED, mine, drafter, tree, graphs=graphs).codes
             for _ in range(FRAMES)]
    return list(torch.stack(codes, dim=1)), [g.get_state() for g in mine]


@pytest.mark.parametrize("drafter", [None, "reused", "offsets"])
@pytest.mark.parametrize("path", ["host-walk", "device-walk", "graphs"])
def test_a_rows_codes_are_the_same_bits_alone_and_in_any_batch(model, path, drafter, monkeypatch):
    if path != "host-walk":  # as on an accelerator: every depth drafted and walked, every row drawing at each
        monkeypatch.setattr(device_path, "static_shapes", lambda device: True)
    drafter = {None: None, "reused": ReusedHeads(model), "offsets": random_offsets(model, 3, seed=1)}[drafter]
    tree = default_tree(6) if drafter is not None else None
    graphs = GraphCache(direct_call) if path == "graphs" else None
    alone = [decoded(model, [b], drafter, tree, graphs) for b in range(ROWS)]
    for rows in ([3, 0], [1, 2, 0, 3], [7, 6, 5, 4, 3, 2, 1, 0], [5, 1, 6]):  # batches of 2, 4 and 8 (3: padded)
        codes, states = decoded(model, rows, drafter, tree, graphs)
        for b, mine, state in zip(rows, codes, states):
            assert torch.equal(mine, alone[b][0][0]), (rows, b)
            assert torch.equal(state, alone[b][1][0]), (rows, b)  # the generator moved on by the same amount
    assert len({tuple(codes.flatten().tolist()) for (codes,), _ in alone}) == ROWS  # the seeds matter


def test_a_seeded_speculative_row_draws_the_codes_of_ar(model):
    """Each code is one draw with the row's own noise for it, wherever the walk finds it: the same codes as AR."""
    frames = random_frames(model, 4, seed=6)
    talker_hidden, c0 = torch.stack([h for h, _ in frames]), torch.tensor([c for _, c in frames])
    ar = decode_frames(model, talker_hidden, c0, SAMPLED, generators(range(4)))
    speculative = decode_frames(model, talker_hidden, c0, SAMPLED, generators(range(4)), ReusedHeads(model),
                                default_tree(6))
    assert torch.equal(speculative.codes, ar.codes)
    assert sum(r.accepted for row in speculative.rows for r in row.rounds) > 0  # drafts were taken


def test_a_list_of_generators_must_hold_one_per_row(model):
    frames = random_frames(model, 3)
    talker_hidden, c0 = torch.stack([h for h, _ in frames]), torch.tensor([c for _, c in frames])
    for wrong in (generators([1, 2]), [torch.Generator(), None, torch.Generator()]):
        with pytest.raises(RvqspecError, match=r"one torch.Generator per frame \(3\).*one per row"):
            decode_frames(model, talker_hidden, c0, SAMPLED, wrong)
