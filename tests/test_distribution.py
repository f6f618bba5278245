"""Exact distribution: speculative samples against the AR joint of c1..c3, enumerated, by a G-test.

A tiny model with 4 codebooks (c1..c3 drawn) of 4 codes: 64 outcomes whose AR probabilities are the
products of the sampler's p~ under teacher forcing. The same test rejects a subtly biased acceptance
rule run through the same engine, which shows it has power over the acceptance rule.
"""

import functools
import itertools

import pytest
import scipy.stats
import torch

from rvqspec.core.decode import decode_frame, decode_frames
from rvqspec.core.drafters import Drafter, ReusedHeads
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree

from helpers.tiny import random_frames, random_offsets, tiny_model

DEPLOYED = Sampler(temperature=0.9, top_k=3, top_p=1.0)  # top_k 3 of 4 codes: it removes one at each step
SAMPLES = 1500
CHAIN = Tree.chain(3)  # from c1, its third draft would be c4: pruned
FULL = Tree.from_paths([(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)])


@functools.cache
def setup(rows: int = 1, dtype: torch.dtype = torch.float64):
    """The model and `rows` frames: talker_hidden [rows, H], c0 [rows] (the first row is the same for any count)."""
    model = tiny_model(seed=3, groups=4, vocab=4, hidden=16, layers=1, dtype=dtype)
    frames = random_frames(model, 1, seed=4) + random_frames(model, rows - 1, seed=5)
    return model, torch.stack([h for h, _ in frames]), torch.tensor([c0 for _, c0 in frames])


@torch.no_grad()
def exact_joint(sampler: Sampler, row: int = 0, rows: int = 1, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """AR probability of every (c1, c2, c3) of frame `row`, flattened as c1*16 + c2*4 + c3."""
    model, talker_hidden, c0 = setup(rows, dtype)
    talker_hidden, c0 = talker_hidden[row], int(c0[row])
    vocab, last = model.config.vocab_size, model.config.num_residual_codes
    outcomes = torch.tensor(list(itertools.product(range(vocab), repeat=last)))
    codes = torch.cat([torch.full((len(outcomes), 1), c0), outcomes], dim=1)
    logits = model.teacher_forced_logits(talker_hidden.expand(len(outcomes), -1), codes)
    probs = sampler.probs(logits).double().gather(-1, outcomes[..., None]).squeeze(-1).prod(-1)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)
    return probs


def sample_counts(sampler: Sampler, samples: int, seed: int, drafter=None, tree=None, between_frames=None,
                  rows: int = 0, graphs=None, dtype: torch.dtype = torch.float64, per_row: bool = False):
    """Histogram of decoded (c1, c2, c3) over `samples` frames, and the mean accepted drafts per round.
    rows 0: one `decode_frame` at a time; else batches of `rows` frames (`decode_frames`, through `graphs` if
    given; `per_row`: a generator per row, seeded seed, seed + 1, ...), a histogram per row."""
    model, talker_hidden, c0 = setup(max(rows, 1), dtype)
    vocab, last = model.config.vocab_size, model.config.num_residual_codes
    generator = torch.Generator().manual_seed(seed)
    if per_row:
        generator = [torch.Generator().manual_seed(seed + row) for row in range(rows)]
    counts = torch.zeros(max(rows, 1), vocab ** last, dtype=torch.long)
    place = vocab ** torch.arange(last - 1, -1, -1)
    accepted = rounds = 0
    for _ in range(samples):
        if between_frames:
            between_frames()
        if rows:
            result = decode_frames(model, talker_hidden, c0, sampler, generator, drafter=drafter, tree=tree,
                                   graphs=graphs).rows
        else:
            result = [decode_frame(model, talker_hidden[0], c0[0], sampler, generator, drafter=drafter, tree=tree)]
        for row, frame in enumerate(result):
            counts[row, int((frame.codes * place).sum())] += 1
            accepted += sum(r.accepted for r in frame.rounds)
            rounds += len(frame.rounds)
    return (counts if rows else counts[0]), accepted / max(rounds, 1)


def g_test(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of a G-test of `counts` against `probs`; cells expected below 5 are pooled."""
    assert counts[probs == 0].sum() == 0, "an outcome the AR sampler can never produce was decoded"
    expected = probs * counts.sum()
    big, small = expected >= 5, (expected < 5) & (probs > 0)
    observed, wanted = counts[big].double(), expected[big]
    if small.any():
        observed = torch.cat([observed, counts[small].sum(0, keepdim=True).double()])
        wanted = torch.cat([wanted, expected[small].sum(0, keepdim=True)])
    wanted *= observed.sum() / wanted.sum()  # p~ is float32: its products sum to 1 within ~1e-7
    return float(scipy.stats.power_divergence(observed.numpy(), wanted.numpy(), lambda_="log-likelihood").pvalue)


def test_autoregressive_sampling_matches_enumeration():
    counts, _ = sample_counts(DEPLOYED, SAMPLES, seed=1)
    pvalue = g_test(counts, exact_joint(DEPLOYED))
    print(f"AR: G-test p-value {pvalue:.3g} over {SAMPLES} frames")
    assert pvalue > 1e-3


@pytest.mark.parametrize("tree, drafter", [(CHAIN, "reused"), (FULL, "offsets")], ids=["chain3", "full12"])
def test_speculative_sampling_matches_enumeration(tree, drafter):
    model = setup()[0]
    drafter = ReusedHeads(model) if drafter == "reused" else random_offsets(model, 3, seed=5)
    counts, accepted = sample_counts(DEPLOYED, SAMPLES, seed=2, drafter=drafter, tree=tree)
    pvalue = g_test(counts, exact_joint(DEPLOYED))
    print(f"G-test p-value {pvalue:.3g} over {SAMPLES} frames, {accepted:.2f} drafts accepted per round")
    assert accepted > 0.4  # drafts win often, so the acceptance rule shapes the samples
    assert pvalue > 1e-3


def test_bfloat16_speculative_sampling_matches_enumeration():
    """bfloat16 on the CPU fast path (fused kernels, int8 draft ranking, measured matmul choices): where a float
    matmul has no row floor on this class, a verify call's bits may differ from AR's in the last place (the attention
    no longer does: tests/test_bit_exact.py); the distribution of the codes is AR's either way."""
    dtype = torch.bfloat16
    model = setup(1, dtype)[0]
    counts, accepted = sample_counts(DEPLOYED, SAMPLES, seed=7, drafter=ReusedHeads(model), tree=FULL, dtype=dtype)
    pvalue = g_test(counts, exact_joint(DEPLOYED, dtype=dtype))
    print(f"bfloat16: G-test p-value {pvalue:.3g} over {SAMPLES} frames, {accepted:.2f} drafts accepted per round")
    assert accepted > 0.4
    assert pvalue > 1e-3


@pytest.mark.parametrize("per_row", [False, True], ids=["one-generator", "a-generator-per-row"])
def test_batched_speculative_sampling_matches_enumeration(per_row):
    """Four different frames decoded together: each row follows its own AR distribution, drawing from one generator
    for the batch or from its own (a generator per row: tests/test_row_draws.py)."""
    model = setup()[0]
    counts, accepted = sample_counts(DEPLOYED, SAMPLES, seed=6, drafter=random_offsets(model, 3, seed=5), tree=FULL,
                                     rows=4, per_row=per_row)
    pvalues = [g_test(counts[row], exact_joint(DEPLOYED, row, 4)) for row in range(4)]
    print(f"G-test p-values {[f'{p:.3g}' for p in pvalues]} over {SAMPLES} batches, {accepted:.2f} accepted per round")
    assert accepted > 0.4
    assert min(pvalues) > 1e-3
    assert len({tuple(exact_joint(DEPLOYED, row, 4).tolist()) for row in range(4)}) == 4  # four different targets


@pytest.mark.parametrize("sampler", [Sampler(temperature=0.5, top_k=3), Sampler(temperature=1.3, top_k=0),
                                     Sampler(temperature=0.9, top_k=0, top_p=0.7),
                                     Sampler(temperature=1.3, top_k=3, top_p=0.8)], ids=str)
def test_sampler_settings_match_enumeration(sampler):
    model = setup()[0]
    counts, _ = sample_counts(sampler, SAMPLES // 2, seed=3, drafter=ReusedHeads(model), tree=FULL)
    pvalue = g_test(counts, exact_joint(sampler))
    print(f"G-test p-value {pvalue:.3g} over {SAMPLES // 2} frames")
    assert pvalue > 1e-3


def test_an_integral_float_top_k_samples_like_the_int():
    as_float = sample_counts(Sampler(temperature=0.9, top_k=3.0), 20, seed=4)[0]
    assert torch.equal(as_float, sample_counts(DEPLOYED, 20, seed=4)[0])


class RoundMarker(Drafter):
    """ReusedHeads that tells the biased samplers below where a round starts and what it drafted."""

    def __init__(self, model, on_round):
        super().__init__(3, None)
        self.reused, self.on_round = ReusedHeads(model), on_round

    def logits(self, model, hidden, positions, depth=None, rank_only=False, path=None):
        logits = self.reused.logits(model, hidden, positions, depth, path=path)
        self.on_round(logits.argmax(-1))  # each row's chain drafts: the child of its depth-d node is column d
        return logits


class RoundSampler(Sampler):
    """The deployed sampler, except for the draws taken inside a speculative round (one call per depth, a
    draw per row of the batch)."""

    def __init__(self):
        super().__init__(**vars(DEPLOYED))
        object.__setattr__(self, "drafts", None)  # per row, the round's chain drafts; None outside a round
        object.__setattr__(self, "depth", 0)

    def start_round(self, drafts: torch.Tensor) -> None:
        object.__setattr__(self, "drafts", drafts.tolist())
        object.__setattr__(self, "depth", 0)

    def end_frame(self) -> None:
        object.__setattr__(self, "drafts", None)

    def sample_noise(self, logits, noise):
        if self.drafts is None:
            return super().sample_noise(logits, noise)
        depth = self.depth  # the round's draws ignore the core's noise: torch's global RNG
        object.__setattr__(self, "depth", depth + 1)
        return torch.tensor([self.draw(p, drafts[depth] if depth < len(drafts) else None, None)
                             for p, drafts in zip(self.probs(logits), self.drafts)])


class DraftFavouringSampler(RoundSampler):
    """Point-mass speculative sampling: take the chain's draft with probability accept(p~(draft)), else a
    draw from p~ without it. accept(p) = p is exactly p~; accept(p) = min(1, 2p) is the biased rule."""

    def __init__(self, accept):
        super().__init__()
        object.__setattr__(self, "accept", accept)

    def draw(self, p: torch.Tensor, child: int | None, generator) -> int:
        if child is not None and torch.rand((), generator=generator) < self.accept(float(p[child])):
            return child
        if child is not None:
            p = p.clone()
            p[child] = 0
        return int(torch.multinomial(p, 1, generator=generator))


class SharedUniformSampler(RoundSampler):
    """Inverse-CDF draws that reuse one uniform for every draw of a round: each draw alone is p~, but the
    codes of a round are correlated (as if a generator were re-seeded per round)."""

    def start_round(self, drafts: torch.Tensor) -> None:
        super().start_round(drafts)
        object.__setattr__(self, "u", float(torch.rand(())))

    def draw(self, p: torch.Tensor, child: int | None, generator) -> int:
        return min(int((p.cumsum(0) < self.u).sum()), len(p) - 1)


@pytest.mark.parametrize("rows", [0, 4], ids=["frame", "batch4"])
@pytest.mark.parametrize("sampler, biased", [
    (lambda: DraftFavouringSampler(lambda p: p), False),
    (lambda: DraftFavouringSampler(lambda p: min(1.0, 2 * p)), True),
    (SharedUniformSampler, True),
], ids=["accept-p", "accept-min(1,2p)", "shared-uniform"])
def test_the_g_test_rejects_biased_rules(sampler, biased, rows, monkeypatch):
    """The biased rules run inside the core's real round (its tree, walk and cache); only the draws change. In a
    batch, every row must be accepted (unbiased) or rejected (biased) on its own. Batches take the device-side
    walk, which draws for every row at each depth as these samplers expect (the CPU's walk draws for the rows
    still walking)."""
    if rows:
        from rvqspec.core import device_path

        monkeypatch.setattr(device_path, "static_shapes", lambda device: True)
    torch.manual_seed(0)  # SharedUniformSampler's uniforms
    sampler = sampler()
    drafter = RoundMarker(setup()[0], sampler.start_round)
    counts, accepted = sample_counts(sampler, SAMPLES, seed=2, drafter=drafter, tree=CHAIN,
                                     between_frames=sampler.end_frame, rows=rows)
    counts = counts.reshape(-1, counts.shape[-1])
    pvalues = [g_test(counts[row], exact_joint(DEPLOYED, row, max(rows, 1))) for row in range(len(counts))]
    print(f"G-test p-values {[f'{p:.3g}' for p in pvalues]} over {SAMPLES} frames, {accepted:.2f} accepted per round")
    assert max(pvalues) < 1e-6 if biased else min(pvalues) > 1e-3
