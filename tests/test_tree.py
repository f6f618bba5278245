"""Tree: validation, breadth-first buffers, JSON round trip, greedy growth."""

import itertools
import json

import pytest
import torch

from rvqspec.core.errors import RvqspecError
from rvqspec.core.tree import Tree, default_tree, grow_tree


@pytest.mark.parametrize("paths, problem", [
    ([(0,), (0, 1, 0)], "no parent"),
    ([(1, 0)], "no parent"),
    ([(0,), (0,)], "appears twice"),
    ([(0,), (-1,)], "ranks >= 0"),
    ([(0,), ()], "non-empty"),
    ([(0,), (0, 1.0)], "ranks >= 0"),
    ([(True,)], "ranks >= 0"),
])
def test_invalid_paths_are_refused(paths, problem):
    with pytest.raises(RvqspecError, match=problem):
        Tree.from_paths(paths)


def test_check_fits_refuses_a_tree_deeper_than_the_drafter():
    tree = Tree.chain(4)
    tree.check_fits(4)
    tree.check_fits(5)
    with pytest.raises(RvqspecError, match="4 deep but the drafter drafts only 3"):
        tree.check_fits(3)


def test_check_fits_refuses_ranks_beyond_the_vocabulary():
    tree = Tree.from_paths([(0,), (3,)])
    tree.check_fits(1, vocab_size=4)
    with pytest.raises(RvqspecError, match="rank 3 but a codebook has only 3 codes"):
        tree.check_fits(1, vocab_size=3)


def test_breadth_first_order_and_buffers():
    tree = Tree.from_paths([(0, 0, 2), (1, 0), (0, 1), (1,), (0, 0), (0,)])
    assert tree.paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 2)]
    assert (tree.size, tree.max_depth, tree.top_m) == (6, 3, 3)
    assert tree.parent.tolist() == [0, 0, 0, 1, 1, 2, 3]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.rank.tolist() == [0, 0, 1, 0, 1, 0, 2]
    assert tree.depth_slices == [(0, 1), (1, 3), (3, 6), (6, 7)]
    ancestors = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6]}
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for node, above in ancestors.items():
        expected[node, above] = True
    assert torch.equal(tree.ancestors, expected)


def test_chain_and_one_node_tree():
    chain = Tree.chain(3)
    assert chain.paths == [(0,), (0, 0), (0, 0, 0)]
    assert chain.parent.tolist() == [0, 0, 1, 2] and chain.top_m == 1
    one = Tree.from_paths([(2,)])  # the smallest tree (an empty one is refused: below)
    assert (one.size, one.max_depth, one.depth_slices, one.top_m) == (1, 1, [(0, 1), (1, 2)], 3)


def test_save_load_round_trip(tmp_path):
    tree = Tree.from_paths([(1,), (0,), (0, 3)], {"budget": 3, "note": "hand-made"})
    tree.save(tmp_path / "tree.json")
    on_disk = json.loads((tmp_path / "tree.json").read_text())
    assert on_disk["format"] == "rvqspec-tree/1" and on_disk["paths"] == [[0], [1], [0, 3]]
    loaded = Tree.load(tmp_path / "tree.json")
    assert loaded.paths == tree.paths and loaded.meta == tree.meta
    assert torch.equal(loaded.ancestors, tree.ancestors)


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not valid JSON"),
    ('{"paths": [[0]]}', "not an rvqspec tree"),
    ('{"format": "medusa", "paths": [[0]]}', "not an rvqspec tree"),
    ('{"format": "rvqspec-tree/1", "paths": {"0": 1}}', "not an rvqspec tree"),
    ('[[0], [1]]', "not an rvqspec tree"),
    ('{"format": "rvqspec-tree/1", "paths": [[0, 0]]}', "no parent"),
])
def test_bad_tree_files_are_refused(tmp_path, content, problem):
    path = tmp_path / "tree.json"
    path.write_text(content)
    with pytest.raises(RvqspecError, match=problem):
        Tree.load(path)


def test_missing_tree_file(tmp_path):
    with pytest.raises(RvqspecError, match="does not exist"):
        Tree.load(tmp_path / "nope.json")


def path_value(acceptance: torch.Tensor, path: tuple[int, ...]) -> float:
    value = 1.0
    for depth, rank in enumerate(path):
        value *= float(acceptance[depth, rank])
    return value


def random_acceptance(depths: int, ranks: int, seed: int) -> torch.Tensor:
    """Random acceptance rates, decreasing with rank (as calibration measures them)."""
    rates = torch.rand(depths, ranks, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return rates.sort(dim=1, descending=True).values


@pytest.mark.parametrize("budget", [1, 2, 5, 13, 40])
def test_grow_tree_size_depth_cap_and_prediction(budget):
    acceptance = random_acceptance(4, 6, seed=budget)
    for cap in (None, 2):
        tree = grow_tree(acceptance, budget, max_depth=cap)
        assert tree.size == budget
        assert tree.max_depth <= (cap or 4) and tree.top_m <= 6
        predicted = 1 + sum(path_value(acceptance, p) for p in tree.paths)
        assert tree.meta["predicted_tokens_per_round"] == pytest.approx(predicted, rel=1e-12)
        assert tree.meta["budget"] == budget


def best_tree_value(acceptance: torch.Tensor, budget: int) -> float:
    """Brute force: the best sum of path values over every prefix-closed set of `budget` paths."""
    depths, ranks = acceptance.shape
    universe = sorted((p for d in range(1, depths + 1) for p in itertools.product(range(ranks), repeat=d)),
                      key=lambda p: (len(p), p))  # a parent always comes before its children
    best = 0.0

    def extend(start: int, chosen: set, value: float) -> None:
        nonlocal best
        if len(chosen) == budget:
            best = max(best, value)
            return
        for i in range(start, len(universe)):
            path = universe[i]
            if len(path) == 1 or path[:-1] in chosen:
                extend(i + 1, chosen | {path}, value + path_value(acceptance, path))

    extend(0, set(), 0.0)
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depths, ranks", [(2, 3), (3, 2)])
def test_grow_tree_is_optimal_on_small_instances(seed, depths, ranks):
    acceptance = random_acceptance(depths, ranks, seed)
    for budget in range(1, 7):
        tree = grow_tree(acceptance, budget)
        grown = sum(path_value(acceptance, p) for p in tree.paths)
        assert grown == pytest.approx(best_tree_value(acceptance, budget), rel=1e-12)


def test_grow_tree_stops_when_the_candidates_run_out():
    tree = grow_tree(torch.full((2, 2), 0.5), budget=100)
    assert sorted(tree.paths) == [(0,), (0, 0), (0, 1), (1,), (1, 0), (1, 1)]


@pytest.mark.parametrize("budget", [1, 4, 8, 16, 32, 64])
def test_default_trees_are_valid(budget):
    tree = default_tree(budget)
    assert tree.size == budget and tree.max_depth <= 3


def test_empty_or_malformed_trees_are_refused(tmp_path):
    """Inputs that used to be accepted silently: empty trees, malformed tree files."""
    for make in (lambda: Tree.from_paths([]), lambda: default_tree(0), lambda: Tree.chain(0)):
        with pytest.raises(RvqspecError, match="at least one node"):
            make()
    for name, content in (("latin1.json", "\xff\xfe{".encode("latin-1")),
                          ("ints.json", json.dumps({"format": "rvqspec-tree/1", "paths": [5]}).encode())):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(RvqspecError, match="not valid JSON|invalid tree paths"):
            Tree.load(tmp_path / name)


def test_trees_past_the_caps_are_refused_at_once(tmp_path):
    """A tree file of 8,000 nodes took 38 s and 0.8 GB; ranks of 1e30 raised an OverflowError."""
    import time

    paths = [[r] for r in range(8000)]
    (tmp_path / "big.json").write_text(json.dumps({"format": "rvqspec-tree/1", "paths": paths}))
    start = time.perf_counter()
    with pytest.raises(RvqspecError, match="8000 nodes, more than 1024"):
        Tree.load(tmp_path / "big.json")
    assert time.perf_counter() - start < 2
    for path in ([10 ** 30], [0] * 300, [-1]):
        with pytest.raises(RvqspecError, match="invalid tree path"):
            Tree.from_paths([path])
