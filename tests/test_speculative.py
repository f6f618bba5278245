"""The speculative round against plain AR: identical greedy codes, top-k/top-p respected, round bookkeeping."""

import functools

import pytest
import torch

from rvqspec.core import decode, device_path
from rvqspec.core.decode import decode_frame, decode_frames
from rvqspec.core.drafters import Drafter, ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree, default_tree, grow_tree

from helpers.tiny import random_frames, random_medusa, random_offsets, tiny_model

GREEDY = Sampler(do_sample=False)


class OracleDrafter(Drafter):
    """Knows the frame's greedy codes and ranks the true code at random: often first, sometimes absent.

    It makes every tree node win now and then (deep paths, frame ends, late siblings), which random
    weights alone rarely do. `codes` (per row of the batch, c1..c15 of its frame) must be set before each batch.
    """

    kind = "oracle"
    RANKS = [0, 0, 0, 0, 1, 1, 2, 3, 7, None]  # None: the true code is not drafted

    def __init__(self, depth: int, seed: int = 0):
        super().__init__(depth, None)
        self.generator = torch.Generator().manual_seed(seed)
        self.codes: list[list[int]] = []

    def logits(self, model, hidden, positions: list[int], depth: int | None = None, rank_only: bool = False,
               path=None) -> torch.Tensor:
        depth, vocab = depth or self.depth, model.config.vocab_size
        scores = torch.empty(len(positions), depth, vocab, dtype=torch.float64)
        for b, position in enumerate(positions):
            for j in range(depth):
                order = torch.randperm(vocab, generator=self.generator).tolist()
                if position + j < len(self.codes[b]):
                    truth = self.codes[b][position + j]  # c_{position+1+j}
                    rank = self.RANKS[int(torch.randint(len(self.RANKS), (1,), generator=self.generator))]
                    order.remove(truth)
                    order.insert(vocab if rank is None else rank, truth)
                scores[b, j, order] = torch.arange(vocab, 0, -1, dtype=torch.float64)
        return scores.to(hidden.device)


# Two tiny models: the real 16 codebooks, and 6 codebooks where many rounds hit the frame end.
MODELS = {16: dict(seed=0, groups=16, vocab=16), 6: dict(seed=1, groups=6, vocab=32, talker_hidden=24)}
FRAMES_PER_TREE = {16: 7, 6: 29}


@functools.cache
def model(groups: int):
    return tiny_model(**MODELS[groups])


@torch.no_grad()
def greedy_codes(m, talker_hidden: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
    """Greedy AR codes [B, G-1] of a batch of frames by plain causal calls, without the core's cache."""
    codes = torch.zeros(len(c0), m.config.num_code_groups, dtype=torch.long)
    codes[:, 0] = c0
    for i in range(1, m.config.num_code_groups):  # position i only sees c0..c_{i-1}: later codes are ignored
        codes[:, i] = GREEDY.sample(m.teacher_forced_logits(talker_hidden, codes)[:, i - 1])
    return codes[:, 1:]


@functools.cache
def greedy_reference(groups: int, count: int) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """`count` random frames and their greedy AR codes."""
    frames = random_frames(model(groups), count, seed=groups)
    codes = greedy_codes(model(groups), torch.stack([h for h, _ in frames]), torch.tensor([c0 for _, c0 in frames]))
    return [(h, c0, frame_codes) for (h, c0), frame_codes in zip(frames, codes)]


@pytest.mark.parametrize("groups", MODELS)
def test_autoregressive_greedy_equals_the_reference(groups):
    for h, c0, codes in greedy_reference(groups, 40):
        assert torch.equal(decode_frame(model(groups), h, c0, GREEDY).codes, codes)


def random_tree(size: int, depth: int, ranks: int, seed: int) -> Tree:
    generator = torch.Generator().manual_seed(seed)
    paths: set[tuple[int, ...]] = set()
    while len(paths) < size:
        parents = [()] + [p for p in sorted(paths) if len(p) < depth]
        parent = parents[int(torch.randint(len(parents), (1,), generator=generator))]
        paths.add(parent + (int(torch.randint(ranks, (1,), generator=generator)),))
    return Tree.from_paths(paths)


TREES = {  # chains, fans, wide, sparse (some shallower than the drafter), N = 1..64
    "chain1": Tree.chain(1), "chain2": Tree.chain(2), "chain3": Tree.chain(3),
    "fan2": Tree.from_paths([(0,), (1,)]), "fan16": Tree.from_paths([(r,) for r in range(16)]),
    "wide40": Tree.from_paths([(r,) for r in range(8)] + [(r, s) for r in range(8) for s in range(4)]),
    "sparse6-depth2": Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]),
    **{f"default{n}": default_tree(n) for n in (4, 8, 16, 32, 64)},
    "random20": random_tree(20, 3, 6, seed=1), "random64": random_tree(64, 3, 16, seed=2),
}
DEEP_PRIOR = torch.tensor([[0.6 * 0.5 ** r * 0.9 ** d for r in range(8)] for d in range(5)])
DEEP_TREES = {"chain5": Tree.chain(5), "deep16": grow_tree(DEEP_PRIOR, 16), "deep64": grow_tree(DEEP_PRIOR, 64),
              "random48-depth5": random_tree(48, 5, 4, seed=3)}

DRAFTERS = {  # name -> (maker(model), trees)
    "reused": (lambda m: ReusedHeads(m), TREES),
    "offsets": (lambda m: random_offsets(m, 3, seed=5), TREES),
    "medusa": (lambda m: random_medusa(m, 3, seed=6), TREES),
    "offsets-depth5": (lambda m: random_offsets(m, 5, seed=7), TREES | DEEP_TREES),
    "oracle-depth5": (lambda m: OracleDrafter(5, seed=8), TREES | DEEP_TREES),
}


def check_rounds(result, tree: Tree, last: int) -> None:
    """Round statistics add up: prefill 1 code, then accepted + 1 per round (accepted alone when it reaches c_last)."""
    assert result.calls == 1 + len(result.rounds)
    k = 1
    for stats in result.rounds:
        assert stats.accepted == len(stats.path) and k + stats.accepted <= last
        assert [depth for depth, _ in stats.path] == list(range(1, stats.accepted + 1))
        assert stats.accepted == 0 or tuple(rank for _, rank in stats.path) in tree.paths
        k += stats.accepted + (k + stats.accepted < last)
    assert k == last == len(result.codes)


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_codes_equal_autoregressive(name):
    make, trees = DRAFTERS[name]
    frames, accepted, deepest = 0, 0, 0
    for groups, per_tree in FRAMES_PER_TREE.items():
        drafter = make(model(groups))
        reference = greedy_reference(groups, per_tree * len(trees))
        for t, tree in enumerate(trees.values()):
            for h, c0, ar in reference[t * per_tree:(t + 1) * per_tree]:
                drafter.codes = [ar.tolist()]  # only the oracle reads it
                result = decode_frame(model(groups), h, c0, GREEDY, drafter=drafter, tree=tree)
                assert torch.equal(result.codes, ar), (name, groups, tree.paths)
                check_rounds(result, tree, groups - 1)
                frames += 1
                accepted += sum(r.accepted for r in result.rounds)
                deepest = max([deepest] + [r.accepted for r in result.rounds])
    assert frames >= 500
    assert accepted > frames  # drafts were accepted, so acceptance and compaction were exercised
    if name.startswith("oracle"):
        assert deepest == 5


def batched_identity(name: str) -> tuple[int, int]:
    """Decode the reference frames in batches of 1..8 (9 rows per tree) with drafter `name` over its trees: every
    row gets its AR codes and its own statistics add up. Returns (frames, batches with ragged progress)."""
    make, trees = DRAFTERS[name]
    frames, ragged = 0, 0
    for groups, per_tree in FRAMES_PER_TREE.items():
        drafter = make(model(groups))
        reference = greedy_reference(groups, per_tree * len(trees))
        start = 0
        for t, tree in enumerate(trees.values()):
            for batch in (1 + (t + groups) % 8, 8 - (t + groups) % 8):  # every size 1..8, 9 rows per tree
                rows = [reference[(start + i) % len(reference)] for i in range(batch)]
                start += batch
                drafter.codes = [ar.tolist() for _, _, ar in rows]
                result = decode_frames(model(groups), torch.stack([h for h, _, _ in rows]),
                                       torch.tensor([c0 for _, c0, _ in rows]), GREEDY, drafter=drafter, tree=tree)
                assert torch.equal(result.codes, torch.stack([ar for _, _, ar in rows])), (name, groups, tree.paths)
                for row in result.rows:
                    check_rounds(row, tree, groups - 1)
                assert result.calls == max(row.calls for row in result.rows)
                ragged += len({row.calls for row in result.rows}) > 1
                frames += batch
    return frames, ragged


@pytest.mark.parametrize("name", DRAFTERS)
def test_batched_greedy_codes_equal_autoregressive(name):
    """decode_frames over batches of 1..8 rows (ragged progress: rows finish in different rounds) gives every
    row its AR codes, and each row's own statistics add up."""
    frames, ragged = batched_identity(name)
    assert frames >= 200 and ragged >= 20  # x 5 drafters: over 1,000 frames in batches


@pytest.mark.parametrize("name", ["medusa", "oracle-depth5"])
def test_static_shapes_as_on_accelerators_give_the_same_codes(name, monkeypatch):
    """The accelerator path (every depth drafted and walked, rows past the frame end masked; `static_shapes`),
    forced on the CPU: the same codes and statistics."""
    monkeypatch.setattr(device_path, "static_shapes", lambda device: True)
    assert batched_identity(name)[0] >= 200


@pytest.mark.parametrize("tree", [default_tree(16), Tree.chain(3)], ids=["default16", "chain3"])
def test_top_k_1_sampling_is_greedy(tree):
    sampler = Sampler(do_sample=True, temperature=1.3, top_k=1)
    drafter = random_offsets(model(16), 3, seed=9)
    for h, c0, ar in greedy_reference(16, 30):
        assert torch.equal(decode_frame(model(16), h, c0, sampler, drafter=drafter, tree=tree).codes, ar)


@pytest.mark.parametrize("sampler", [Sampler(temperature=1.3, top_k=2), Sampler(temperature=0.5, top_k=0, top_p=0.5),
                                     Sampler(temperature=0.9, top_k=3, top_p=0.8)], ids=str)
def test_codes_outside_the_target_top_k_top_p_are_never_emitted(sampler):
    """A tree covering every code at depth 1 drafts mostly codes the sampler removes: none may win."""
    m = model(16)
    tree = Tree.from_paths([(r,) for r in range(16)] + [(r, s) for r in range(4) for s in range(4)] + [(0, 0, 0)])
    drafter = random_offsets(m, 3, seed=10, std=2.0)
    generator = torch.Generator().manual_seed(0)
    frames = random_frames(m, 40, seed=11)
    accepted = 0
    for h, c0 in frames:
        result = decode_frame(m, h, c0, sampler, generator, drafter=drafter, tree=tree)
        codes = torch.cat([torch.tensor([c0]), result.codes])
        with torch.no_grad():
            target = sampler.probs(m.teacher_forced_logits(h[None], codes[None]))[0]  # [15, V]
        assert (target.gather(1, result.codes[:, None]) > 0).all()
        accepted += sum(r.accepted for r in result.rounds)
        check_rounds(result, tree, 15)
    assert accepted > len(frames)


@pytest.mark.parametrize("accelerator", [True, False], ids=["accelerator", "cpu"])
def test_the_round_reads_the_device_once(monkeypatch, accelerator):
    """Item 5: on an accelerator the acceptance walk is the round's only device-to-host read (Python-level reads
    counted); the CPU's walk reads the candidates, then each depth it visits (`host_walk`: free on the CPU), and
    nothing else: its result is on the host already (issue 51)."""
    if accelerator:
        monkeypatch.setattr(device_path, "static_shapes", lambda device: True)
    m, tree = model(16), default_tree(32)
    h, c0, _ = greedy_reference(16, 1)[0]
    decode_frame(m, h, c0, Sampler(), drafter=ReusedHeads(m), tree=tree)  # builds the plan once
    reads: list[str] = []
    for name in ("__int__", "__bool__", "__float__", "__index__", "item", "tolist"):
        def counted(self, *args, _original=getattr(torch.Tensor, name), _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    per_round: list[int] = []

    def counting_round(*args, **kwargs):
        before = len(reads)
        out = round_(*args, **kwargs)
        per_round.append(len(reads) - before)
        return out

    round_ = decode.speculative_round
    monkeypatch.setattr(decode, "speculative_round", counting_round)
    result = decode_frame(m, h, c0, Sampler(), drafter=ReusedHeads(m), tree=tree)
    if accelerator:
        assert per_round and set(per_round) == {1}
    else:  # candidates, one read per visited depth (accepted + 1, or fewer at the frame end)
        assert len(per_round) == len(result.rounds)
        assert all(reads <= 2 + r.accepted for reads, r in zip(per_round, result.rounds))


def test_speculative_input_errors():
    m = model(6)
    h, c0 = random_frames(m, 1)[0]
    with pytest.raises(RvqspecError, match="needs a tree"):
        decode_frame(m, h, c0, GREEDY, drafter=ReusedHeads(m))
    with pytest.raises(RvqspecError, match="drafts only 3 codes ahead"):
        decode_frame(m, h, c0, GREEDY, drafter=ReusedHeads(m), tree=Tree.chain(4))
    with pytest.raises(RvqspecError, match="only 32 codes"):
        decode_frame(m, h, c0, GREEDY, drafter=ReusedHeads(m), tree=Tree.from_paths([(0,), (32,)]))


def test_threads_sharing_one_model_get_their_own_codes():
    """The KV cache belongs to the call: two threads decoding with one model (AR beside speculative, batches beside
    single frames) get exactly the codes each gets alone."""
    import threading

    m = tiny_model(seed=4, groups=16, vocab=16, dtype=torch.float32)
    frames = random_frames(m, 40, seed=9)
    hidden, c0 = torch.stack([h for h, _ in frames]), torch.tensor([c for _, c in frames])
    jobs = {"ar": dict(), "spec": dict(drafter=ReusedHeads(m), tree=default_tree(16))}
    alone = {name: decode_frames(m, hidden, c0, GREEDY, **kwargs).codes for name, kwargs in jobs.items()}
    results: dict = {name: [] for name in jobs}

    def work(name: str) -> None:
        for i in range(0, 40, 5):
            rows = slice(i, i + 5) if i % 10 else slice(i, i + 1)
            results[name].append((rows, decode_frames(m, hidden[rows], c0[rows], GREEDY, **jobs[name]).codes))

    threads = [threading.Thread(target=work, args=(name,)) for name in jobs for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, done in results.items():
        assert len(done) == 16
        for rows, codes in done:
            assert torch.equal(codes, alone[name][rows])
