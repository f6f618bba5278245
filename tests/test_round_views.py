"""Issue 51, item 1 (the predictor frame's glue): a round whose rows are all at one k verifies with that k's positions,
tables and mask as views shared by every row (as an AR step does), and a one-row round reads its states, noise and
compaction slots as views. Both must be the bits of the gathered per-row tensors."""

import pytest
import torch

from rvqspec.core import fused
from rvqspec.core.context import pick, plan_for
from rvqspec.core.quantize import quantize, w8a8_kernel
from rvqspec.core.tree import default_tree

from helpers.tiny import tiny_model

ROWS, K = 3, 5


def models() -> list:
    float_model = tiny_model(seed=3, dtype=torch.float32, hidden=64, layers=2, vocab=64)
    exact = w8a8_kernel() is not None and fused.kernels() is not None
    return [float_model] + ([quantize(float_model, "w8a8")] if exact else [])


@pytest.mark.parametrize("index", [0, 1], ids=["float32", "w8a8"])
@torch.inference_mode()
def test_rows_at_one_k_share_its_views_and_get_the_gathered_bits(index):
    if index >= len(models()):
        pytest.skip("needs the fused kernels and a w8a8 kernel")
    model, tree = models()[index], default_tree(8)
    plan, groups = plan_for(tree, model), model.config.num_code_groups
    k_host, generator = [K] * ROWS, torch.Generator().manual_seed(0)
    k = torch.tensor(k_host)
    tokens = torch.randint(model.config.vocab_size, (ROWS, tree.size + 1), generator=generator)
    cache = model.new_cache(ROWS, groups + tree.size + 1)
    cache.kv.normal_(generator=generator)  # committed entries for the rows' slots 0..k
    hidden, kv = [], []
    for positions, tables, masks in (plan.at(k, k_host), plan.at(k, None)):
        assert (positions.dim(), masks.dim()) == ((1, 2) if len(hidden) == 0 else (2, 3))  # views, then gathered
        copy = model.new_cache(ROWS, cache.slots)
        copy.kv.copy_(cache.kv)
        hidden.append(model(model.embed_codes(tokens, tables), positions, masks, copy, plan.scratch))
        kv.append(copy.kv)
    assert torch.equal(hidden[0], hidden[1]) and torch.equal(kv[0], kv[1])


@pytest.mark.parametrize("rows", [1, 3])
def test_the_host_compaction_slots_are_the_device_ones(rows):
    plan = plan_for(default_tree(8), tiny_model(seed=3, hidden=64, layers=2, vocab=64))
    k_host, node = [4, 7, 9][:rows], [0, 3, 8][:rows]
    host = plan.compaction(torch.tensor(k_host), k_host, node)
    device = plan.compaction(torch.tensor(k_host), None, torch.tensor(node))
    assert all(torch.equal(a, b) for a, b in zip(host, device))


def test_pick_is_a_view_for_one_row_and_a_gather_for_more():
    rows = torch.arange(24).reshape(2, 3, 4)
    one = pick(rows, [1], [2])
    assert one.shape == (1, 4) and one.data_ptr() == rows[1, 2].data_ptr()
    assert torch.equal(pick(rows, [0, 1], [2, 0]), torch.stack([rows[0, 2], rows[1, 0]]))
    assert torch.equal(pick(rows, [1, 0]), rows[[1, 0]])
