"""Issue 51, item 4: bit-exact rounds. A verify call gives each tree node the hidden state its AR step gives, bit for
bit, in any batch: the predictor's attention visits each query's visible keys in position order
(`fused.attention_in_order`) where SDPA's blocks depend on the call's shape and on where masked keys lie (with SDPA,
91 of the 108 node states compared below differed in some bit for w8a8, all 108 in float32). So the w8a8 model's
speculative codes are AR's, greedy and seeded, alone and in any batch. Rerun under the AVX2 caps by
tests/test_cpu_classes.py; the stand-in's 1,000 frames: benchmarks/exact_rounds.py."""

import pytest
import torch
import torch.nn.functional as F

from rvqspec.core import fused
from rvqspec.core.context import plan_for
from rvqspec.core.decode import decode_frames, prefill
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.quantize import quantize, w8a8_kernel
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree

from helpers.tiny import random_frames, tiny_model

pytestmark = pytest.mark.skipif(w8a8_kernel() is None or fused.kernels() is None,
                                reason="needs the fused kernels and a w8a8 kernel")
GREEDY = Sampler(do_sample=False)
SAMPLED = Sampler(temperature=1.0, top_k=0)


def w8a8_model(dtype: torch.dtype = torch.float32):
    return quantize(tiny_model(seed=3, dtype=dtype, hidden=64, layers=2, vocab=64), "w8a8")


def frames(model, count: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = random_frames(model, count, seed)
    return torch.stack([h for h, _ in inputs]), torch.tensor([c for _, c in inputs])


def feed(model, cache, codes: torch.Tensor, p: int, slots: int) -> torch.Tensor:
    """An AR step: c_{p-1} (codes[:, p-2]) at position and slot p, attending to slots 0..p; its h_p [B, hidden]."""
    position = torch.tensor([p])
    x = model.embed_codes(codes[:, p - 2], position - 1)[:, None]
    return model(x, position, (torch.arange(slots) <= p)[None], cache, position)[:, 0]


@torch.inference_mode()
def ar_states(model, talker_hidden, c0, codes) -> torch.Tensor:
    """h_1..h_{G-1} [B, G-1, hidden] of the AR frame that emits `codes`."""
    groups = model.config.num_code_groups
    cache = model.new_cache(len(c0), groups)
    states = [prefill(model, cache, talker_hidden, c0)]
    return torch.stack(states + [feed(model, cache, codes, p, groups) for p in range(2, groups)], dim=1)


@torch.inference_mode()
def verify_states(model, talker_hidden, c0, codes, tree, k: torch.Tensor) -> torch.Tensor:
    """The verify call of rows at k (c1..c_k emitted) over a frame's cache, every node of `tree` carrying the code
    at its depth (each node is then an AR step): hidden states [B, q, hidden]."""
    groups, plan = model.config.num_code_groups, plan_for(tree, model)
    slots = groups + tree.size + 1
    cache = model.new_cache(len(c0), slots)
    prefill(model, cache, talker_hidden, c0)
    for p in range(2, int(k.max()) + 1):  # a row's slots past its k are masked in its verify call
        feed(model, cache, codes, p, slots)
    tokens = codes.gather(1, (k[:, None] + tree.depth[None, :] - 1).clamp(max=groups - 2))
    return model(model.embed_codes(tokens, plan.tables[k]), plan.positions[k], plan.masks[k], cache, plan.scratch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_verify_call_gives_every_node_its_ar_steps_hidden_state(dtype):
    model, tree = w8a8_model(dtype), default_tree(8)
    talker_hidden, c0 = frames(model, 4)
    codes = decode_frames(model, talker_hidden, c0, GREEDY).codes
    ar = ar_states(model, talker_hidden, c0, codes)
    last = model.config.num_code_groups - 2  # h_{G-1} (index G-2) predicts the last code
    for k in ([1, 3, 5, 7], [2, 2, 2, 2], [4, 1, 6, 9]):
        k = torch.tensor(k)
        together = verify_states(model, talker_hidden, c0, codes, tree, k)
        for b in range(len(k)):
            alone = verify_states(model, talker_hidden[b:b + 1], c0[b:b + 1], codes[b:b + 1], tree, k[b:b + 1])[0]
            assert torch.equal(alone, together[b]), (k.tolist(), b)
            for node, depth in enumerate(tree.depth.tolist()):
                if k[b] + depth <= last:
                    assert torch.equal(together[b, node], ar[b, k[b] + depth]), (k.tolist(), b, node)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_query_gets_the_same_bits_at_any_slots_beside_any_queries(dtype):
    """The kernel alone: a query over keys at slots 0..p of an AR-sized cache, and over the same keys at slots 0..k
    and scratch slots of a wider cache (other slots holding other keys, masked), beside other queries and rows."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, groups, q = 4, 2, 64, 16, 9
    keys = torch.randn(2, 1, kv_heads, 12, dim, generator=g).to(dtype)  # K and V of positions 0..11
    query = torch.randn(1, heads, 1, dim, generator=g).to(dtype)
    ar_k, ar_v = torch.zeros(2, 1, kv_heads, groups, dim, dtype=dtype).unbind()
    ar_k[:, :, :12], ar_v[:, :, :12] = keys
    ar_mask = torch.zeros(1, groups, dtype=dtype).masked_fill_(torch.arange(groups) > 11, float("-inf"))
    alone = fused.attention_in_order(query, ar_k, ar_v, ar_mask)
    wide = torch.randn(2, 3, kv_heads, groups + q, dim, generator=g).to(dtype)  # 3 rows; ours is row 1
    wide[:, 1:2, :, :8], wide[:, 1:2, :, groups + 2:groups + 6] = keys[:, :, :, :8], keys[:, :, :, 8:]
    visible = torch.rand(3, 5, groups + q, generator=g) < 0.5
    visible[:, :, 0] = True
    visible[1, 3] = False
    visible[1, 3, :8], visible[1, 3, groups + 2:groups + 6] = True, True
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))[:, None]
    queries = torch.randn(3, heads, 5, dim, generator=g).to(dtype)
    queries[1, :, 3] = query[0, :, 0]
    inside = fused.attention_in_order(queries, wide[0], wide[1], mask)
    assert torch.equal(inside[1, :, 3], alone[0, :, 0])
    expected = F.scaled_dot_product_attention(queries.double(), wide[0].double(), wide[1].double(),
                                              attn_mask=mask.double(), enable_gqa=True)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(inside.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("budget", [4, 16])
def test_w8a8_speculative_codes_are_ars_greedy_and_seeded_alone_and_in_a_batch(budget):
    model = w8a8_model()
    talker_hidden, c0 = frames(model, 24, seed=5)
    drafter, tree = ReusedHeads(model), default_tree(budget)
    for sampler in (GREEDY, SAMPLED):
        def decode(rows, **speculation):
            seeds = [torch.Generator().manual_seed(100 + b) for b in rows]
            return decode_frames(model, talker_hidden[rows], c0[rows], sampler, seeds, **speculation).codes

        ar = decode(list(range(24)))
        assert torch.equal(decode(list(range(24)), drafter=drafter, tree=tree), ar)
        for b in (0, 7, 23):
            assert torch.equal(decode([b], drafter=drafter, tree=tree)[0], ar[b])

