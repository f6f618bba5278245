"""Properties over random trees, models, drafters and samplers: round bookkeeping and the compacted cache."""

import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rvqspec.core import decode
from rvqspec.core.decode import decode_frame, decode_frames
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree

from helpers.tiny import random_frames, random_medusa, random_offsets, tiny_model

VOCAB = 6


@functools.cache
def model(groups: int, seed: int):
    return tiny_model(seed=seed, groups=groups, vocab=VOCAB)


@st.composite
def trees(draw, max_depth: int = 4, max_size: int = 24) -> Tree:
    """Any valid tree: each new node hangs under a random existing node (or the root) at a random rank."""
    paths: set[tuple[int, ...]] = set()
    for _ in range(draw(st.integers(1, max_size))):
        parent = draw(st.sampled_from([()] + sorted(p for p in paths if len(p) < max_depth)))
        paths.add(parent + (draw(st.integers(0, VOCAB - 1)),))
    return Tree.from_paths(paths)


samplers = st.one_of(st.just(Sampler(do_sample=False)), st.builds(
    Sampler, temperature=st.floats(0.3, 2.0), top_k=st.integers(0, VOCAB), top_p=st.floats(0.2, 1.0)))


@torch.no_grad()
def recomputed_cache(m, talker_hidden: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """K/V of positions 0..len(codes) (talker state, then `codes` = c0..) from one causal call on a fresh cache."""
    length = len(codes) + 1
    x = torch.cat([m.embed_talker_hidden(talker_hidden[None]), m.embed_codes(codes, torch.arange(len(codes)))])
    positions = torch.arange(length)
    cache = m.new_cache(1, length)
    m(x[None], positions, positions[None, :] <= positions[:, None], cache, positions)
    return cache.kv[:, :, 0]


@settings(max_examples=60, deadline=None)
@given(tree=trees(), groups=st.sampled_from([3, 5, 16]), model_seed=st.integers(0, 2),
       drafter_kind=st.sampled_from(["reused", "offsets", "medusa"]), extra_depth=st.integers(0, 2),
       sampler=samplers, seed=st.integers(0, 2 ** 16), batch=st.integers(1, 3))
def test_rounds_and_compacted_cache(tree, groups, model_seed, drafter_kind, extra_depth, sampler, seed, batch):
    """Every row of a batch, after every round it took part in: emitted codes, its compacted cache and the hidden
    state handed to the next round equal a fresh causal pass over its codes so far."""
    m = model(groups, model_seed)
    last = m.config.num_residual_codes
    depth = max(tree.max_depth, 1) + extra_depth
    drafter = {"reused": lambda: ReusedHeads(m, depth), "offsets": lambda: random_offsets(m, depth, seed),
               "medusa": lambda: random_medusa(m, depth, seed)}[drafter_kind]()
    frames = random_frames(m, batch, seed)
    talker_hidden, c0 = torch.stack([h for h, _ in frames]), torch.tensor([c for _, c in frames])

    rounds = []  # (k per row, draws, accepted per row, hidden returned, cache after the round)
    original_round = decode.speculative_round

    def recording_round(*args):
        out = original_round(*args)
        cache, k_host = args[0].cache, args[2]
        rounds.append((list(k_host), out.draws.clone(), list(out.accepted), out.hidden.clone(), cache.kv.clone()))
        return out

    generator = torch.Generator().manual_seed(seed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "speculative_round", recording_round)
        result = decode_frames(m, talker_hidden, c0, sampler, generator, drafter=drafter, tree=tree)

    assert result.codes.shape == (batch, last) and result.calls == 1 + len(rounds)
    for b, row in enumerate(result.rows):
        mine = [(k[b], draws[b], accepted[b], hidden[b], cache[:, :, b])
                for k, draws, accepted, hidden, cache in rounds if k[b] < last]
        assert row.calls == 1 + len(mine) and [r.accepted for r in row.rounds] == [a for _, _, a, _, _ in mine]
        codes = torch.cat([c0[b:b + 1], result.codes[b]])  # c0..c_last
        with torch.no_grad():
            teacher_forced = m.teacher_forced_hidden(talker_hidden[b:b + 1], codes[None])[0]
        emitted_all = [result.codes[b, :1]]
        for k, draws, accepted, hidden, cache in mine:
            ends_frame = k + accepted == last
            emitted = draws[:accepted + (not ends_frame)]  # accepted drafts, then the bonus
            emitted_all.append(emitted)
            assert k + len(emitted) <= last and accepted <= tree.max_depth
            if not ends_frame:
                new_k = k + len(emitted)  # the cache now holds positions 0..new_k, carrying c_{-1}..c_{new_k - 1}
                torch.testing.assert_close(cache[..., :new_k + 1, :],
                                           recomputed_cache(m, talker_hidden[b], codes[:new_k]), rtol=0, atol=1e-10)
                torch.testing.assert_close(hidden, teacher_forced[new_k], rtol=0, atol=1e-10)
        assert torch.equal(torch.cat(emitted_all), result.codes[b])
        if not sampler.do_sample:
            assert torch.equal(result.codes[b], decode_frame(m, talker_hidden[b], c0[b], sampler).codes)
